"""Routing: which rendezvous carries a key, asked by the step-scoped rendezvous a Worker
hands out (``_step.py``).

Both ends in this worker: the step's in-process ``LocalRendezvous`` (no copy). The other
end in another worker: the first transport of the worker's priority list that the peer
takes (its ``PeerRecord.transports``) and that ``can_reach`` it (TensorPipe's
``canCommunicateWithRemote``). Like TensorFlow's ``BaseRemoteRendezvous``, a step's
rendezvous only sends keys whose src task is its worker and only receives keys whose
dst task is its worker; tasks are compared as parsed names (``task:1`` is not
``task:10``, the string-prefix trap of TF's ``IsLocalDevice``).

Per-message work is only what the message needs. What a key string implies — its parse,
the own-task and incarnation checks, the peer and the chosen transport — is derived once
per key string and kept in a bounded table, the oldest entry going first (TensorFlow
reuses a key in every step, each with a new step id, so the table is keyed by the key
alone; a hit is one C-level dict lookup). A peer's transport is cached once
its record is final (its own presence record); a provisional answer (from the cluster
spec) is asked again next time. A receive started while its producer's record is
provisional, where another transport may reach the producer, also listens on the
producer's pick once that is known (``_race.py``).

The router is given a ``RouterContext``, never the Worker.

Thread model (``docs/threads.md``): thread-safe; no thread of its own but ``_race.py``'s
(while a receive waits for its producer's pick). ``Router._lock`` guards the final
per-peer routes and the long-wait records, and is never held across a transport call.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._diagnose import explain_absent_producer
from ._errors import AbortedError, InvalidArgumentError, RendezvousError
from ._keys import DeviceName, ParsedKey, parse_key
from ._race import LegStarter, PickWatch, RaceRecv
from ._rendezvous import (
    Canceller,
    DoneCallback,
    RecvSlot,
)
from ._transport import PeerRecord, Transport, TransportContext
from ._values import check_value

__all__ = ["KeyRoute", "Router", "RouterContext"]

_log = logging.getLogger("shmrdv.router")


# How many key strings' routes a worker remembers: far more than the distinct keys of any
# graph (TensorFlow reuses each key in every step), small enough to bound a job that
# makes a new key per message.
_KEY_ROUTES = 4096


@dataclass(frozen=True, slots=True)
class RouterContext:
    """What the router is given of its Worker."""

    ctx: TransportContext
    order: tuple[str, ...]  # the worker's transport priority list
    transport: Callable[[str], Transport]  # the named transport (created on first use)
    active: Callable[[], tuple[Transport, ...]]  # the transports created so far


# Matches no array: a dtype object of our own (never handed out) and an impossible shape.
_NOTHING_ACCEPTED: tuple[np.dtype[Any], tuple[int, ...]] = (np.dtype([("never", "u1")]), (-1,))


class _RouteTable(dict[str, "KeyRoute"]):
    """Key string -> its ``KeyRoute``, derived on a miss (``__missing__``), so that a hit
    is ``table[key]`` alone (half the cost of an ``lru_cache`` hit, which also moves the
    entry in its list). At most ``limit`` entries: the oldest goes first."""

    def __init__(self, derive: Callable[[str], KeyRoute], limit: int) -> None:
        super().__init__()
        self._derive = derive
        self._limit = limit
        self._lock = threading.Lock()

    def __missing__(self, key: str) -> KeyRoute:
        r = self._derive(key)  # (raises for a key that does not parse: nothing is kept)
        with self._lock:
            if len(self) >= self._limit:
                self.pop(next(iter(self)), None)
            return self.setdefault(key, r)  # (another thread's, if it came first)


class KeyRoute:
    """What one key string means to this worker, derived once (see the module docstring).

    ``peer`` is the other end's task (None when both ends, or neither, are this worker);
    ``transport`` and ``wait`` are filled in once the peer's record is final. ``accepted``
    is the (dtype, shape) of the last array ``check_value`` accepted under the key (one
    tuple, replaced whole: threads never mix two arrays' halves): an array of the same
    dtype object and shape needs no second look.
    """

    __slots__ = (
        "accepted",
        "dst_own",
        "inc_ok",
        "local",
        "peer",
        "pk",
        "src_own",
        "transport",
        "wait",
    )

    def __init__(self, pk: ParsedKey, task: DeviceName, incarnation: int) -> None:
        self.pk = pk
        self.src_own = task.same_task(pk.src)
        self.dst_own = task.same_task(pk.dst)
        self.inc_ok = not self.src_own or pk.src_incarnation in (0, incarnation)
        self.local = self.src_own and self.dst_own
        self.peer: DeviceName | None = (
            pk.dst
            if self.src_own and not self.dst_own
            else pk.src
            if self.dst_own and not self.src_own
            else None
        )
        self.transport: Transport | None = None
        self.wait: Callable[[RecvSlot, float], None] | None = None
        self.accepted: tuple[np.dtype[Any], tuple[int, ...]] = _NOTHING_ACCEPTED

    def checked(self, value: Any) -> npt.NDArray[Any]:
        """``check_value(value)``, skipped for an ndarray like the last one accepted."""
        dtype, shape = self.accepted
        if type(value) is np.ndarray and value.dtype is dtype and value.shape == shape:
            return value
        arr = check_value(value, self.pk.full_key)
        self.accepted = (arr.dtype, arr.shape)
        return arr


class Router:
    """The routing of one Worker, shared by all its steps. Thread-safe."""

    def __init__(self, rc: RouterContext) -> None:
        self.rc = rc
        self.task_name = rc.ctx.task_name
        self._lock = threading.Lock()
        # (peer task, this worker produces) -> transport: each direction its producer's pick.
        self._peer_routes: dict[tuple[tuple[str, int, int], bool], Transport] = {}
        # The route of a key string: the table's own lookup (a step's hot path's one).
        self._routes = _RouteTable(self._derive, _KEY_ROUTES)
        self.route_str: Callable[[str], KeyRoute] = self._routes.__getitem__
        # Blocked receives that have waited long (WaitObserver), by id of their slot:
        # (step, key, since when). Only long waits get here, never every message.
        self._long_waits: dict[int, tuple[int, ParsedKey, float]] = {}
        self._picks = PickWatch()
        # What every call of this worker's steps raises once the Worker may not be used
        # (closed, or inherited across fork): ``refuse``. One attribute read per call.
        self.refused: Callable[[], BaseException] | None = None

    def refuse(self, error: Callable[[], BaseException]) -> None:
        """From now on every call of a step of this worker raises ``error()``."""
        self.refused = error

    def _derive(self, full_key: str) -> KeyRoute:
        return KeyRoute(parse_key(full_key), self.rc.ctx.task, self.rc.ctx.incarnation)

    def route(self, key: str | ParsedKey) -> KeyRoute:
        """The route of ``key``; ``InvalidArgumentError`` for a key that does not parse."""
        if type(key) is str:
            return self.route_str(key)
        if isinstance(key, ParsedKey):
            return self.route_str(key.full_key)
        raise InvalidArgumentError(
            f"a rendezvous key must be a str (see shmrdv.create_key), not {type(key).__name__}"
        )

    def cached_routes(self) -> int:
        """How many key strings' routes are remembered (bounded by ``_KEY_ROUTES``)."""
        return len(self._routes)

    # -- the checks, their errors built only when they fail ---------------------------

    def send_error(self, r: KeyRoute) -> Exception:
        pk = r.pk
        if not r.src_own:
            return _not_this_task(pk, "src", self.task_name)
        inc = self.rc.ctx.incarnation
        return AbortedError(
            f"key {pk.full_key!r} names incarnation {pk.src_incarnation:016x} of "
            f"{self.task_name}, but this worker is incarnation {inc:016x}: the key is from a "
            "previous run of this worker"
        )

    def recv_error(self, r: KeyRoute) -> Exception:
        pk = r.pk
        if not r.dst_own:
            return _not_this_task(pk, "dst", self.task_name)
        inc = self.rc.ctx.incarnation
        return AbortedError(
            f"RecvTensor expects a different device incarnation: {pk.src_incarnation:016x} "
            f'vs. {inc:016x}. Your worker job ("{self.task_name}") was probably restarted; '
            f"key {pk.full_key!r}"
        )

    # -- choosing a transport ---------------------------------------------------------

    def transport(self, r: KeyRoute) -> Transport:
        """The transport for ``r``'s peer (``r.peer`` must be set)."""
        t = r.transport
        if t is not None:
            return t
        peer = r.peer
        assert peer is not None
        tk = (peer.task_key(), r.src_own)
        t = self._peer_routes.get(tk)
        if t is None:
            record = self.rc.ctx.peers.lookup(peer)
            t = self._choose(record, r.pk, producer=r.src_own)
            if not record.final:
                return t  # provisional: ask again next time
            with self._lock:
                t = self._peer_routes.setdefault(tk, t)
        r.wait = t.wait
        r.transport = t
        return t

    def others_reaching(self, r: KeyRoute, first: Transport) -> bool:
        """Whether a receive of ``r``'s key, started on ``first`` by a provisional record
        (the producer's order not known), may have to listen elsewhere too: whether its
        peer may take another transport of this worker's that may reach it. A transport
        not made yet is not made for this (gRPC's client: asked once the record is final)."""
        peer = r.peer
        assert peer is not None
        record = self.rc.ctx.peers.lookup(peer)
        if record.final:
            return True  # final since ``transport(r)`` looked: the watch settles it at once
        made = {t.name: t for t in self.rc.active()}
        return any(
            n != first.name
            and n in record.transports
            and (n not in made or made[n].can_reach(record))
            for n in self.rc.order
        )

    def watch_pick(
        self,
        r: KeyRoute,
        race: RaceRecv,
        first: Transport,
        leg: Callable[[Transport, DoneCallback], Canceller],
    ) -> None:
        """Start ``leg``'s receive on the producer's pick once ``r``'s record is final and
        the pick is not ``first`` (``_race.PickWatch``)."""

        def pick() -> tuple[LegStarter | None] | None:
            t = r.transport or self.transport(r)
            if r.transport is None:
                return None  # still provisional
            return (None if t is first else functools.partial(leg, t),)

        self._picks.watch(race, pick)

    def _choose(self, record: PeerRecord, pk: ParsedKey, *, producer: bool) -> Transport:
        """The transport of a key between this worker and ``record``'s: the first of the
        *producer's* priority list that both take and that reaches the peer, so that both
        ends pick the same one whatever order each lists them in (a consumer listing
        ``("grpc", "shm")`` waited on gRPC for what a ``("shm", "grpc")`` producer had
        put in shared memory)."""
        if producer or not record.final:
            # A provisional record (the cluster spec's, before the producer has started)
            # does not know the producer's order: this worker's own is the best guess.
            order = [n for n in self.rc.order if n in record.transports]
        else:
            order = [n for n in record.transports if n in self.rc.order]
        for name in order:
            t = self.rc.transport(name)
            if t.can_reach(record):
                return t
        where = "this host" if record.same_host else "another host"
        raise InvalidArgumentError(
            f"key {pk.full_key!r}: task {record.task} is on {where} and takes transports "
            f"{record.transports}; none of this worker's transports={self.rc.order} reaches it"
        )

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Abort ``step_id`` in every transport created so far (each once)."""
        for t in self.rc.active():
            t.abort_step(step_id, error)

    # -- why a receive waits (never per message) --------------------------------------

    def diagnose(self, pk: ParsedKey, *, probe: bool = False) -> str | None:
        """Why a receive of ``pk`` may be waiting: where its producer is alive, if not in
        this worker's namespace; with ``probe``, also what the key's transport finds (a
        gRPC address that does not answer, and its status: ``Transport.explain_wait``).

        None when there is nothing to tell. Lists the presence records
        (``PeerDirectory.sightings``), and a probe may wait a moment: only for a timeout, a
        long wait or ``stats()``.
        """
        peers = self.rc.ctx.peers
        try:
            record = peers.lookup(pk.src)
        except RendezvousError as e:
            return f"the presence record of {pk.src} cannot be read: {e}"
        hints = []
        if probe:
            hint = self._transport_hint(pk, record)
            if hint is not None:
                hints.append(hint)
        if record.same_host:
            absent = explain_absent_producer(record.task, peers.sightings(pk.src))
            if absent is not None:
                hints.append(absent)
        return "; ".join(hints) or None

    def _transport_hint(self, pk: ParsedKey, record: PeerRecord) -> str | None:
        r = self.route(pk)
        if r.peer is None:
            return None
        try:
            return self.transport(r).explain_wait(record)
        except Exception:  # a diagnosis must never replace the error it explains
            _log.debug("explaining the wait for %r failed", pk.full_key, exc_info=True)
            return None

    def long_wait_started(self, slot: RecvSlot, step_id: int, pk: ParsedKey, since: float) -> None:
        with self._lock:
            self._long_waits[id(slot)] = (step_id, pk, since)

    def long_wait_ended(self, slot: RecvSlot) -> None:
        with self._lock:
            self._long_waits.pop(id(slot), None)

    def waiting(self) -> list[dict[str, Any]]:
        """The blocked receives waiting for over a second: step, key, seconds, diagnosis."""
        with self._lock:
            waits = list(self._long_waits.values())
        now = time.monotonic()
        hints: dict[str, str | None] = {}  # one look (and probe) per producer task
        for _, pk, _ in waits:
            if str(pk.src) not in hints:
                hints[str(pk.src)] = self.diagnose(pk, probe=True)
        return [
            {
                "step": step,
                "key": pk.full_key,
                "waited_s": round(now - since, 3),
                "diagnosis": hints[str(pk.src)],
            }
            for step, pk, since in waits
        ]


def _not_this_task(pk: ParsedKey, side: str, task_name: str) -> InvalidArgumentError:
    """TensorFlow's "Invalid rendezvous key (src|dst)", saying which task the key names,
    which task this worker is, and what to do instead."""
    device = pk.src if side == "src" else pk.dst
    role, verb = ("producer", "sends") if side == "src" else ("consumer", "receives")
    call = "send" if side == "src" else "recv"
    named = (
        f"task {device.task_part}"
        if device.has_task
        else f"device {str(device) or '(empty)'}, which names no task (it needs /job: and /task:)"
    )
    return InvalidArgumentError(
        f"Invalid rendezvous key ({side}): {pk.full_key} @ {task_name}: the key's {role} "
        f"({side}) is {named}, but this worker is {task_name}, and a worker {verb} only keys "
        f"whose {side} device is on its own task; call {call} on the Worker of the task the "
        f"key names, or build the key with a {side} device of this task (e.g. "
        f"{task_name}/device:CPU:0)"
    )
