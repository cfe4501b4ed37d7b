"""Worker: one task of a job, its transports and its steps (``StepRendezvous``).

A Worker is TensorFlow's worker process reduced to its rendezvous part: a task, an
incarnation, a namespace, and the transports that reach other workers. ``cleanup(step)``
aborts and frees a step (TensorFlow's ``RendezvousMgr::Cleanup``), leaving a tombstone so
a late call fails at once. Which rendezvous carries a key is ``_routes.py``'s.

Thread model (``docs/threads.md``): thread-safe. ``Worker._lock`` guards the steps, the
tombstones and the lazy gRPC client, and each step's abort; none is held across a
transport call.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from ._cluster import (
    ALL_TRANSPORTS,
    ClusterSpec,
    NoPresence,
    Peers,
    canonical_task,
    is_local_host,
    namespace_id,
    resolve_namespace,
)
from ._errors import (
    AbortedError,
    DeadlineExceededError,
    InvalidArgumentError,
    cleanup_error,
    closed_error,
)
from ._keys import DeviceName, ParsedKey, parse_key
from ._rendezvous import (
    Canceller,
    Closing,
    DoneCallback,
    LocalRendezvous,
    Received,
    RecvSlot,
    Rendezvous,
    as_parsed_key,
    check_timeout,
    timeout_error,
    wait_received,
)
from ._routes import Ends, RaceRecv, Routes
from ._rpc.guard import DEFAULT_FIRST_MESSAGE_TIMEOUT, DEFAULT_MAX_CONCURRENT_RPCS, Limits
from ._transport import PresenceBoard, Transport, TransportContext
from ._values import check_value
from ._window import check_window

if TYPE_CHECKING:
    from ._rpc.guard import TLSConfig

__all__ = ["StepRendezvous", "Worker"]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1  # a step id's range
_log = logging.getLogger("shmrdv.worker")

# How many cleaned-up step ids a worker remembers (TensorFlow keeps none and lets a late
# RecvTensor wait forever; an unbounded set would leak in a long job).
_TOMBSTONES = 65536
_INF = float("inf")

_live_workers: weakref.WeakSet[Worker] = weakref.WeakSet()


def _mark_forked() -> None:
    for w in list(_live_workers):
        w._forked = True
        w._routes.refused = w._unusable


os.register_at_fork(after_in_child=_mark_forked)


class StepRendezvous(Rendezvous):
    """The rendezvous of one step of one Worker (``Worker.rendezvous(step_id)``).

    ``send`` copies the array once into shared memory for a consumer on this host (none
    for an ``allocate``d array or a consumer in this worker) and buffers it for one on
    another host, which pulls it. ``start_abort`` (or ``Worker.cleanup``) fails everything
    pending in this step and every later call. See docs/api.md.
    """

    def __init__(self, routes: Routes, step_id: int, lock: threading.Lock) -> None:
        self._routes = routes
        self.step_id = step_id
        # Keys with both ends in this worker: made on first use (most steps have none).
        self._local: LocalRendezvous | None = None
        self._lock = lock  # the Worker's: it aborts a step under it (``Worker.cleanup``)
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = f"aborted: {self._error!r}" if self._error is not None else "open"
        return f"<StepRendezvous step={self.step_id} of {self._routes.ctx.task_name} ({state})>"

    def send(
        self,
        key: str | ParsedKey,
        value: Any,
        *,
        is_dead: bool = False,
        timeout: float | None = None,
    ) -> None:
        pk, ends = self._route(key)
        if not ends.sends or self._error is not None:
            raise self._refusal(pk, ends, sending=True)
        if timeout is not None and (type(timeout) is not float or not 0.0 <= timeout < _INF):
            timeout = check_timeout(timeout)  # not a plain finite float >= 0: convert or refuse
        arr = check_value(value, pk.full_key)
        dead = is_dead if type(is_dead) is bool else bool(is_dead)
        if ends.local:
            (self._local or self._make_local()).put(pk, arr, dead)
        else:
            t = ends.transport or self._routes.transport(ends, pk)
            t.send(self.step_id, pk, arr, dead, timeout)

    def _make_local(self) -> LocalRendezvous:
        """The step's in-process table, made on first use (aborted if the step is)."""
        with self._lock:
            local = self._local
            if local is None:
                local = self._local = LocalRendezvous()
            error = self._error
        if error is not None:
            local.start_abort(error)
        return local

    def _route(self, key: str | ParsedKey) -> tuple[ParsedKey, Ends]:
        routes = self._routes
        if routes.refused is not None:
            raise routes.refused()
        pk = parse_key(key) if type(key) is str else as_parsed_key(key)
        ends = routes.ends.get((pk.src_device, pk.src_incarnation, pk.dst_device))
        return pk, routes.of(pk) if ends is None else ends

    def _refusal(self, pk: ParsedKey, ends: Ends, *, sending: bool) -> BaseException:
        """Why this step may not send (receive) ``pk``: the key's, else the step's abort."""
        if sending and not ends.sends:
            return self._routes.send_error(pk, ends)
        if not sending and not ends.receives:
            return self._routes.recv_error(pk, ends)
        assert self._error is not None
        return self._error

    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        pk, ends = self._route(key)
        if not ends.receives or self._error is not None:
            raise self._refusal(pk, ends, sending=False)
        if ends.local:
            local = self._local or self._make_local()
            return local.start_recv(pk, done, copy=copy, blocking=blocking)
        t = ends.transport
        if t is None:
            t = self._routes.transport(ends, pk)
            if ends.transport is None and self._routes.others_reaching(ends, t):
                return self._routes.race(ends, pk, t, self.step_id, done, copy)
        cancel = t.start_recv(self.step_id, pk, done, copy=copy, blocking=blocking)
        error = self.aborted  # (read again: the step may have been aborted meanwhile)
        if error is not None and cancel():  # after the transport failed what it had
            raise error
        return cancel

    def _wait_blocked(
        self, slot: RecvSlot, cancel: Canceller, key: str | ParsedKey, timeout: float | None
    ) -> Received:
        """A blocked receiver helps its transport (``Transport.wait``) and reports a wait
        that lasts."""
        pk, ends = self._route(key)
        if ends.local:
            return wait_received(slot, cancel, pk, timeout)
        if isinstance(cancel, RaceRecv):  # its legs are callback receives: nothing to help
            return wait_received(slot, cancel, pk, timeout, observer=self)
        # The transport start_recv chose (asked again while the peer's record is provisional).
        helper = ends.wait or self._routes.transport(ends, pk).wait
        return wait_received(slot, cancel, pk, timeout, helper, self)

    def allocate(self, key: str | ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """An array to fill and then ``send(key, array)``, once, under this key only; for a
        consumer on this host it lies in shared memory and ``send`` only publishes it."""
        pk, ends = self._route(key)
        if not ends.sends or self._error is not None:
            raise self._refusal(pk, ends, sending=True)
        if ends.local:
            return super().allocate(pk, shape, dtype)
        t = ends.transport or self._routes.transport(ends, pk)
        return t.allocate(self.step_id, pk, shape, dtype)

    def start_abort(self, error: BaseException) -> None:
        if not isinstance(error, BaseException):
            raise InvalidArgumentError(f"start_abort needs an exception, not {error!r}")
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            local = self._local
        if local is not None:
            local.start_abort(error)
        self._routes.abort_step(self.step_id, error)

    @property
    def aborted(self) -> BaseException | None:
        """The abort error, or ``None`` while the step is open."""
        return self._error

    # -- WaitObserver ---------------------------------------------------------------------

    def timeout_error(self, key: ParsedKey, timeout: float | None) -> DeadlineExceededError:
        error = timeout_error(key, timeout)
        if self._routes.of(key).local:
            return error
        hint = self._routes.diagnose(key, probe=True)
        return error if hint is None else DeadlineExceededError(f"{error}; {hint}")

    _timeout_error = timeout_error

    def waiting_long(self, slot: RecvSlot, key: ParsedKey, waited: float) -> None:
        self._routes.long_wait(slot, (self.step_id, key, time.monotonic() - waited))
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "recv of %r in step %d has waited %.0fs: %s",
                key.full_key,
                self.step_id,
                waited,
                self._routes.diagnose(key) or f"its producer {key.src} is alive in this namespace",
            )

    def stopped_waiting(self, slot: RecvSlot) -> None:
        self._routes.long_wait(slot, None)

    def stats(self) -> dict[str, int]:
        return {} if self._local is None else self._local.stats()


class Worker(Closing):
    """One task of a job: hands out step-scoped rendezvous and owns their transports.

    ``Worker(task, cluster=None, namespace=None, ...)``; docs/api.md has every option.

    Args:
        task: this worker's task, e.g. ``"/job:worker/replica:0/task:0"``. At most one
            live Worker per task and namespace on a host.
        cluster: a ``ClusterSpec`` (or its dict) of each task's ``host:port``; ``None``:
            every task is on this host and no server is needed.
        namespace: the job's secret token (``shmrdv.new_namespace()``), else env
            ``SHMRDV_NAMESPACE``; messages name it by ``w.namespace_id`` only.
        transports: priority list among ``"shm"`` and ``"grpc"``; ``("grpc",)`` forces
            the network path and starts the server.
        incarnation: this run's id, a non-zero uint64; random unless given.
        tls, token: gRPC security options (``TLSConfig``, a shared bearer secret).
        shm_pool_bytes: warm shared-memory slots kept for sends (0: no pool).
        max_inflight_bytes: backpressure: at most this many bytes sent to one consumer
            worker and not received yet; a ``send`` beyond waits up to its ``timeout``,
            then raises ``ResourceExhaustedError`` having sent nothing. None: no window.
        busy_poll: seconds a receive blocked on this host polls shared memory after the
            last message instead of sleeping (0: a short spin only); cost in ``stats()``.
        max_connections, max_concurrent_rpcs, first_message_timeout: the gRPC server's
            bounds against clients that never finish a call (checked even when no
            server starts).

    ``close()`` (or ``with``) aborts every step and releases every OS object. A Worker
    cannot be used in a ``fork`` child of the process that created it.
    """

    def __init__(
        self,
        task: str | DeviceName,
        *,
        cluster: ClusterSpec | Mapping[str, Any] | None = None,
        namespace: str | None = None,
        transports: Iterable[str] | None = None,
        incarnation: int | None = None,
        tls: TLSConfig | None = None,
        token: str | None = None,
        shm_pool_bytes: int = 512 << 20,
        max_inflight_bytes: int | None = None,
        busy_poll: float = 0.0,
        max_connections: int | None = None,
        max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
        first_message_timeout: float = DEFAULT_FIRST_MESSAGE_TIMEOUT,
    ) -> None:
        self._closed = True  # until fully built, so close() from the finalizer is a no-op
        self._forked = False
        self._pid = os.getpid()
        dev = task if isinstance(task, DeviceName) else DeviceName.parse(task)
        if not dev.has_task:
            raise InvalidArgumentError(
                f"a Worker needs a task name with a job and a task index, like "
                f"'/job:worker/replica:0/task:0', not {str(task)!r}"
            )
        self._task = canonical_task(dev)
        self.task: str = str(self._task)
        self.cluster: ClusterSpec | None = (
            None
            if cluster is None
            else cluster
            if isinstance(cluster, ClusterSpec)
            else ClusterSpec(cluster)
        )
        self.namespace: str = resolve_namespace(namespace)
        self.namespace_id: str = namespace_id(self.namespace)  # what messages name; public
        explicit = transports is not None
        names = tuple(transports) if transports is not None else ALL_TRANSPORTS
        if isinstance(transports, str):
            raise InvalidArgumentError(
                f"transports must be a list like ('shm', 'grpc'), not the string {transports!r}"
            )
        bad = [t for t in names if t not in ALL_TRANSPORTS]
        if bad or not names or len(set(names)) != len(names):
            raise InvalidArgumentError(
                f"transports must be one or more distinct names among {ALL_TRANSPORTS}, "
                f"not {names!r}"
            )
        self.transports: tuple[str, ...] = names
        if incarnation is None:
            incarnation = 0
            while incarnation == 0:
                incarnation = secrets.randbits(64)
        if (
            isinstance(incarnation, bool)
            or not isinstance(incarnation, int)
            or not 0 < incarnation < 2**64
        ):
            raise InvalidArgumentError(
                f"incarnation must be a non-zero uint64, not {incarnation!r}"
            )
        self.incarnation: int = incarnation
        if (
            isinstance(shm_pool_bytes, bool)
            or not isinstance(shm_pool_bytes, int)
            or shm_pool_bytes < 0
        ):
            raise InvalidArgumentError(
                f"shm_pool_bytes must be an int >= 0, not {shm_pool_bytes!r}"
            )
        self.max_inflight_bytes: int | None = check_window(max_inflight_bytes)
        self._server_limits = Limits(
            max_connections=max_connections,
            max_concurrent_rpcs=max_concurrent_rpcs,
            first_message_timeout=first_message_timeout,
        )
        self._tls = tls
        self._token = token
        self._shm_pool_bytes = shm_pool_bytes
        if isinstance(busy_poll, bool) or not isinstance(busy_poll, (int, float)):
            raise InvalidArgumentError(
                f"busy_poll must be a number of seconds >= 0, not {busy_poll!r}"
            )
        if not 0.0 <= busy_poll <= 3600.0:
            raise InvalidArgumentError(
                f"busy_poll must be between 0 and 3600 seconds, not {busy_poll!r}"
            )
        self._busy_poll = float(busy_poll)

        self._lock = threading.Lock()
        self._steps: dict[int, StepRendezvous] = {}
        self._tombstones: OrderedDict[int, None] = OrderedDict()  # steps cleaned up
        self._shm: Transport | None = None
        self._grpc: Transport | None = None
        self._active: tuple[Transport, ...] = ()  # those made so far (``_made``)
        self._board = board = self._presence_board()
        self._peers = Peers(board, self.cluster)
        self._ctx = TransportContext(
            task=self._task,
            task_name=self.task,
            incarnation=self.incarnation,
            namespace=self.namespace,
            peers=self._peers,
            cleaned_up=self._tombstones.__contains__,
            max_inflight_bytes=self.max_inflight_bytes,
        )
        self._routes = Routes(self._ctx, self.transports, self._transport, lambda: self._active)
        self.address: str | None = None

        try:
            self._start(explicit)
        except BaseException:
            self._closed = False
            self.close()
            raise
        self._closed = False
        _live_workers.add(self)
        self._finalizer = weakref.finalize(self, _log.debug, "worker %s collected", self.task)

    def _presence_board(self) -> PresenceBoard:
        """The shared-memory board, or none for a gRPC-only worker where /dev/shm cannot
        be used (peers are then found by the cluster spec alone)."""
        from ._shm.transport import ShmBoard, usable

        if "shm" not in self.transports and not usable():
            _log.info(
                "%s: /dev/shm cannot be used: no presence record (peers found by the cluster "
                "spec only, same-host peers cannot see this worker's liveness)",
                self.task,
            )
            return NoPresence()
        return ShmBoard(self.namespace)

    def _start(self, explicit_transports: bool) -> None:
        start_server = (
            "grpc" in self.transports
            and (
                (explicit_transports and self.transports[0] == "grpc")
                or self._cluster_has_remote_task()
            )
        ) or (explicit_transports and "shm" not in self.transports)
        if start_server:
            from ._rpc.transport import GrpcTransport

            cluster = self.cluster
            bind = "127.0.0.1:0"
            if cluster is not None and self.task in cluster:
                bind = cluster.task_address(self.task)
            grpc_t = GrpcTransport(
                self._ctx, bind, tls=self._tls, token=self._token, limits=self._server_limits
            )
            self._grpc = grpc_t
            self.address = grpc_t.address
        # Else a gRPC client is made on the first remote key (``_transport``).
        self._board.publish(self.task, self.incarnation, self.address, self.transports)
        if "shm" in self.transports:
            from ._shm.transport import ShmTransport

            self._shm = ShmTransport(
                self._ctx, pool_bytes=self._shm_pool_bytes, busy_poll=self._busy_poll
            )
        self._made()

    def _cluster_has_remote_task(self) -> bool:
        cluster = self.cluster
        return cluster is not None and any(
            not is_local_host(cluster.host_of(t)) for t in cluster.tasks()
        )

    def __repr__(self) -> str:
        window = self.max_inflight_bytes
        return (
            f"<shmrdv.Worker {self.task} namespace_id={self.namespace_id} "
            f"incarnation={self.incarnation:016x} transports={self.transports}"
            f"{'' if window is None else f' max_inflight_bytes={window}'} "
            f"steps={len(self._steps)} {'closed' if self._closed else 'open'}>"
        )

    def rendezvous(self, step_id: int) -> StepRendezvous:
        """The rendezvous of step ``step_id``, made on first use; after ``cleanup(step_id)``
        one whose every call fails at once with ``AbortedError("Cleanup <step_id>")``."""
        step = (
            step_id
            if type(step_id) is int and _I64_MIN <= step_id <= _I64_MAX
            else self._check_step(step_id)
        )
        if self._closed or self._forked:
            raise self._unusable()
        with self._lock:
            rdv = self._steps.get(step)
            if rdv is not None:
                return rdv
            rdv = StepRendezvous(self._routes, step, self._lock)
            if step not in self._tombstones:
                self._steps[step] = rdv
            else:  # aborted here only: the transports forgot the step at its cleanup
                rdv._error = cleanup_error(step, self.task)
        return rdv

    def cleanup(self, step_id: int) -> None:
        """Abort step ``step_id`` with ``AbortedError("Cleanup <step_id>")``: its pending
        and later calls fail at once; values sent to this worker in it and not received
        are freed. Nothing to do once the worker is closed."""
        step = (
            step_id
            if type(step_id) is int and _I64_MIN <= step_id <= _I64_MAX
            else self._check_step(step_id)
        )
        if self._closed or self._forked:
            if self._forked:
                raise self._unusable()
            return  # close aborted every step and freed what they held
        error = cleanup_error(step, self.task)
        tombstones, local = self._tombstones, None
        with self._lock:
            rdv = self._steps.pop(step, None)
            if step in tombstones:
                tombstones.move_to_end(step)
            tombstones[step] = None
            if len(tombstones) > _TOMBSTONES:
                tombstones.popitem(last=False)
            if rdv is not None and rdv._error is None:  # aborted as ``start_abort`` does
                rdv._error = error
                local = rdv._local
        if local is not None:
            local.start_abort(error)
        for t in self._active:
            t.cleanup_step(step, error)  # fails its receives, unless aborted before

    def is_cleaned_up(self, step_id: int) -> bool:
        """True if ``cleanup(step_id)`` ran (and is still remembered)."""
        return self._check_step(step_id) in self._tombstones

    def close(self) -> None:
        """Abort every step, stop the server, release every OS object. Idempotent.
        Values already sent to a worker on this host stay its own."""
        if self._closed:
            return
        self._closed = True
        _live_workers.discard(self)
        self._routes.refused = self._unusable
        if self._forked:
            return  # the parent owns every OS object; touch nothing
        with self._lock:
            steps = list(self._steps.items())
            self._steps.clear()
        error = closed_error(self.task)
        for _step, rdv in steps:
            rdv.start_abort(error)
        for t in self._active:
            try:
                t.close()
            except Exception:  # pragma: no cover - keep closing the rest
                _log.exception("closing transport %s of %s", t.name, self.task)
        self._peers.close()  # and its presence board: this worker's record goes

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Counters per transport, steps, tombstones, ``max_inflight_bytes``, ``routes``
        (pairs of key ends remembered) and ``waiting`` (receives blocked over a second,
        with step, key, seconds and a diagnosis). Lists presence records for a diagnosis."""
        out: dict[str, Any] = {
            "task": self.task,
            "namespace_id": self.namespace_id,
            "steps": len(self._steps),
            "tombstones": len(self._tombstones),
            "max_inflight_bytes": self.max_inflight_bytes,
            "routes": len(self._routes.ends),
            "waiting": self._routes.waiting(),
        }
        local: dict[str, int] = {}
        for rdv in list(self._steps.values()):
            for k, v in rdv.stats().items():
                local[k] = local.get(k, 0) + v
        out["local"] = local
        for t in self._active:
            out[t.name] = t.stats()
        return out

    # -- the transports it built (given to the router as callables) -----------------------

    @staticmethod
    def _check_step(step_id: int) -> int:
        if (
            isinstance(step_id, bool)
            or not isinstance(step_id, int)
            or not _I64_MIN <= step_id <= _I64_MAX
        ):
            raise InvalidArgumentError(f"step_id must be an int64, not {step_id!r}")
        return step_id

    def _unusable(self) -> InvalidArgumentError | AbortedError:
        """What a call of a closed or forked-off worker (and of its steps) raises."""
        if self._forked:
            return InvalidArgumentError(
                f"this Worker ({self.task}) was created in pid {self._pid} and inherited across "
                f"fork by pid {os.getpid()}; a Worker cannot be shared: create a new Worker in the child"
            )
        return closed_error(self.task)

    def _made(self) -> None:
        self._active = tuple(t for t in (self._shm, self._grpc) if t is not None)

    def _transport(self, name: str) -> Transport:
        """The named transport of this worker; gRPC's client is made on first use."""
        if name == "shm" and self._shm is not None:
            return self._shm
        if name == "grpc":
            with self._lock:
                if self._grpc is None:
                    from ._rpc.transport import GrpcTransport

                    self._grpc = GrpcTransport(self._ctx, None, tls=self._tls, token=self._token)
                    self._made()
                return self._grpc
        raise InvalidArgumentError(f"{self.task} has no transport {name!r}")  # pragma: no cover
