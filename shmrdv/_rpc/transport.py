"""The cross-host transport: TensorFlow's pull model over gRPC.

Producer side: ``send`` to a consumer on another host buffers the value in this worker's
*outbox* for the step (an in-process ``LocalRendezvous``); the consumer's RecvTensor
call, served by ``RpcServer``, takes it from there, waiting up to the call's deadline.
The outbox is created on the first send or request of a step and dropped by
``cleanup_step``; a request for a step already cleaned up fails at once with ``ABORTED``
(TensorFlow's FindOrCreate would wait forever).

Backpressure (``TransportContext.max_inflight_bytes``): one ``InflightWindow`` per
consumer task. ``send`` reserves the value's bytes before copying it into the outbox
(waiting up to the send's timeout); a pull that takes the value gives them back, a
``requeue`` counts them again, ``cleanup_step`` gives back what the step's outbox still
holds and ``close`` everything; a consumer that died (its presence record on this host,
looked at while a reservation waits) frees its window. The bytes a step holds per consumer are counted here
(``_held``), so the window and the outboxes cannot drift apart.

Consumer side: ``start_recv`` pulls the next value of the key from the producer's
address (``TransportContext.peers``: the cluster's, else the producer's presence record)
through ``RpcClient``; aborting or cleaning up the step cancels the calls in flight.

Implements ``Transport`` (``_transport.py``) and nothing else: it is given a
``TransportContext``, never the Worker.

Thread model: the server runs its own event loop thread; the client needs no thread per
receive (a small value arrives in a gRPC future's callback; a large one streams in a
thread of its own). ``done`` callbacks run in client threads through ``invoke_done``,
never under a lock of ours. A blocked receiver (``waits=True``) is woken by gRPC's thread
directly: its ``done`` only fills a ``RecvSlot``; ``wait`` just waits on that slot.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._callbacks import DoneCallback, invoke_done
from .._errors import (
    AbortedError,
    InvalidArgumentError,
    RendezvousError,
    UnavailableError,
    closed_error,
)
from .._keys import ParsedKey
from .._local import LocalRendezvous
from .._received import Received
from .._rendezvous import Canceller, RecvSlot
from .._status import code_for_error
from .._transport import PeerRecord, TransportContext
from .._window import ConsumerWatch, InflightWindow, Windows
from .client import RpcClient
from .limits import ServerLimits
from .server import RpcServer

if TYPE_CHECKING:
    from .security import TLSConfig

__all__ = ["GrpcTransport"]

# How often a receive looks again for the address of a producer that has not started.
_RESOLVE_PERIOD = 0.05
# How long explain_wait waits for a peer's GetStatus. A peer with nothing listening
# answers at once (connection refused, or the channel's last failure); only a host that
# drops packets makes the probe wait this long, on a receive that already timed out.
_PROBE_TIMEOUT = 0.25

_log = logging.getLogger("shmrdv.rpc")


@dataclass(eq=False)
class _RemoteWaiter:
    """One receive of a remote key: queued, or at the head with its RPC in flight."""

    done: DoneCallback
    copy: bool
    direct: bool = False  # done is quick and never blocks (a blocked receiver's RecvSlot)
    cancel_rpc: Canceller | None = None
    resolving: bool = False  # waiting for the producer's address (not started yet)


class GrpcTransport:
    """gRPC transport of one Worker; also the ``TensorSource`` its server serves from.

    ``bind``: the address to serve on (``host:port``; port 0 picks one), or None for a
    client only (this worker receives from other hosts but nobody pulls from it).
    ``limits``: the server's connection and call bounds (``ServerLimits``; default ones).
    """

    name = "grpc"

    def __init__(
        self,
        ctx: TransportContext,
        bind: str | None,
        *,
        tls: TLSConfig | None,
        token: str | None,
        limits: ServerLimits | None = None,
    ) -> None:
        self._ctx = ctx
        self.task: str = ctx.task_name
        self.incarnation: int = ctx.incarnation
        self._lock = threading.Lock()
        self._outboxes: dict[int, LocalRendezvous] = {}
        self._aborted: dict[int, BaseException] = {}
        self._queues: dict[tuple[int, str], deque[_RemoteWaiter]] = {}
        self._sent_steps: set[int] = set()
        self._owned: dict[int, weakref.ref[npt.NDArray[Any]]] = {}
        self._closed = False
        self._counters = {"sent": 0, "sent_bytes": 0, "received": 0, "received_bytes": 0}
        limit = ctx.max_inflight_bytes
        self._windows: Windows | None = None if limit is None else Windows(limit)
        # Per step, per consumer's window: bytes in its outbox not taken yet.
        self._held: dict[int, dict[InflightWindow, int]] = {}
        self._watches: dict[InflightWindow, ConsumerWatch] = {}
        self._client = RpcClient(tls=tls, token=token)
        self._server: RpcServer | None = None
        self.address: str | None = None
        if bind is not None:
            self._server = RpcServer(bind, self, tls=tls, token=token, limits=limits).start()
            self.address = self._server.address

    def __repr__(self) -> str:
        return f"<GrpcTransport {self.task} address={self.address} closed={self._closed}>"

    # -- producer side --------------------------------------------------------------

    def _outbox(self, step_id: int, *, for_send: bool) -> LocalRendezvous:
        with self._lock:
            if self._closed:
                raise closed_error(self.task)
            err = self._aborted.get(step_id)
            if err is not None:
                raise err
            box = self._outboxes.get(step_id)
            if box is None:
                box = self._outboxes[step_id] = LocalRendezvous()
            if for_send:
                self._sent_steps.add(step_id)
            return box

    def _drop_if_unused(self, step_id: int) -> None:
        """Forget an outbox a request created for a step this worker never sent in.

        A peer naming arbitrary step ids must not grow the producer's memory: such an
        outbox goes as soon as nothing waits in it. (One a send touched stays until
        ``cleanup_step``; checking under the lock means a send never lands in a dropped box.)
        """
        with self._lock:
            box = self._outboxes.get(step_id)
            if box is None or step_id in self._sent_steps:
                return
            st = box.stats()
            if st["pending_waiters"] == 0 and st["pending_values"] == 0:
                del self._outboxes[step_id]

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        try:
            arr: npt.NDArray[Any] = np.empty(shape, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"allocate({key.full_key!r}): bad shape {shape!r} or dtype {dtype!r}: {e}"
            ) from e
        with self._lock:
            self._owned[id(arr)] = weakref.ref(arr)
        weakref.finalize(arr, self._owned.pop, id(arr), None)
        return arr

    def can_reach(self, peer: PeerRecord) -> bool:
        """Any host: a peer not yet known gets its address once it publishes it."""
        return True

    def explain_wait(self, peer: PeerRecord) -> str | None:
        """None if ``peer``'s server answers a GetStatus within ``_PROBE_TIMEOUT``; else
        its address and the gRPC status the probe got (issue 19 §4: "nothing listening"
        used to read as "not alive anywhere on this host")."""
        address = peer.address
        if address is None:
            return None  # not started: its presence record will carry its address
        try:
            self._client.get_status(address, timeout=_PROBE_TIMEOUT)
        except RendezvousError as e:
            return (
                f"the gRPC server of {peer.task} at {address} does not answer: "
                f"{code_for_error(e).name}: {e}"
            )
        return None

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None,
    ) -> None:
        box = self._outbox(step_id, for_send=True)
        if self._windows is None:
            self._put(box, key, value, is_dead)
            return
        nbytes = value.nbytes
        window = self._windows.for_key(key)
        watch = self._watches.get(window)
        if watch is None:
            watch = self._watches.setdefault(window, ConsumerWatch(self._ctx.peers, key.dst))

        def refresh() -> None:
            if watch.died():
                self._forget(window)

        window.reserve(nbytes, timeout, refresh, key.full_key)
        try:
            self._hold(step_id, window, nbytes)
        except BaseException:
            window.release(nbytes)
            raise
        try:
            self._put(box, key, value, is_dead)
        except BaseException:
            self._unhold(step_id, window, nbytes)
            raise

    def _put(
        self, box: LocalRendezvous, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool
    ) -> None:
        ref = self._owned.pop(id(value), None)
        if ref is not None and ref() is value:
            # From allocate(): hand it over as is, and stop the producer writing into it.
            value.flags.writeable = False
        else:
            # The caller keeps its array and may reuse it at once: buffer a copy (the
            # same one copy the shared-memory path makes).
            value = np.array(value, copy=True, order="C")
        box.send(key, value, is_dead=is_dead)
        self._counters["sent"] += 1
        self._counters["sent_bytes"] += value.nbytes

    # -- the window's accounting (only with max_inflight_bytes) -------------------------

    def _hold(self, step_id: int, window: InflightWindow, nbytes: int) -> None:
        """``nbytes`` counted in ``window`` are now held by the step's outbox."""
        with self._lock:
            if self._closed:
                raise closed_error(self.task)
            err = self._aborted.get(step_id)
            if err is not None:
                raise err
            per = self._held.setdefault(step_id, {})
            per[window] = per.get(window, 0) + nbytes

    def _unhold(self, step_id: int, window: InflightWindow, nbytes: int) -> None:
        """``nbytes`` left the step's outbox (taken, or never put): give them back.

        At most what the step still holds: after ``cleanup_step`` gave it all back, a
        late take gives back nothing twice."""
        with self._lock:
            per = self._held.get(step_id)
            have = 0 if per is None else per.get(window, 0)
            gone = min(have, nbytes)
            if per is not None and gone:
                per[window] = have - gone
        if gone:
            window.release(gone)

    def _forget(self, window: InflightWindow) -> None:
        """Its consumer died: what it did not take no longer counts (it stays in the
        outboxes until their steps are cleaned up, for a consumer that comes back)."""
        with self._lock:
            for per in self._held.values():
                per.pop(window, None)
        window.reset()

    def _release_held(self, step_id: int) -> None:
        """Give back the bytes the step's outbox still holds (it dropped them)."""
        if self._windows is None:
            return
        with self._lock:
            per = self._held.pop(step_id, None)
        for window, nbytes in (per or {}).items():
            if nbytes:
                window.release(nbytes)

    # TensorSource, called by the server for every RecvTensor.
    def serve_recv(self, step_id: int, key: ParsedKey, done: DoneCallback) -> Canceller:
        if self._ctx.cleaned_up(step_id):
            raise AbortedError(
                f"Cleanup {step_id}: step {step_id} of {self.task} was already cleaned up"
            )
        box = self._outbox(step_id, for_send=False)

        def finished(error: BaseException | None, received: Received | None) -> None:
            if received is not None and self._windows is not None:
                self._unhold(step_id, self._windows.for_key(key), received.value.nbytes)
            invoke_done(done, error, received)
            self._drop_if_unused(step_id)

        cancel = box._start_recv(key, finished, False)

        def canceller() -> bool:
            removed = cancel()
            if removed:
                self._drop_if_unused(step_id)
            return removed

        return canceller

    def requeue(self, step_id: int, key: ParsedKey, received: Received) -> None:
        """A value taken for a call that then failed goes back to the head of its key."""
        with self._lock:
            box = self._outboxes.get(step_id)
        if box is None:
            return
        if self._windows is None:
            box.requeue(key, received)
            return
        nbytes = received.value.nbytes
        window = self._windows.for_key(key)
        try:
            self._hold(step_id, window, nbytes)
        except RendezvousError:
            return  # aborted or closed meanwhile: the value is dropped, like the outbox's
        window.charge(nbytes)  # in flight again, without waiting
        box.requeue(key, received)
        if box.aborted is not None:
            self._unhold(step_id, window, nbytes)  # dropped by an abort that came in between

    # -- consumer side --------------------------------------------------------------

    def start_recv(
        self, step_id: int, key: ParsedKey, done: DoneCallback, copy: bool, waits: bool
    ) -> Canceller:
        """Queue a receive of ``key``; one RecvTensor per key is in flight at a time.

        Concurrent RPCs for one key would reach the producer in any order and break the
        channel's FIFO promise (the oldest receive gets the oldest value), so later
        receives of a key wait here, in order, until the one ahead of them is answered.
        ``waits``: ``done`` is a blocked receiver's slot (quick, never blocks), so it may
        run in gRPC's own thread: one thread switch from the response to the caller.
        """
        k = (step_id, key.full_key)
        waiter = _RemoteWaiter(done, copy, waits)
        with self._lock:
            if self._closed:
                raise closed_error(self.task)
            err = self._aborted.get(step_id)
            if err is not None:
                raise err
            queue = self._queues.setdefault(k, deque())
            queue.append(waiter)
            first = len(queue) == 1
        if first:
            self._issue(k, key, waiter)
        return lambda: self._cancel(k, key, waiter)

    def wait(self, slot: RecvSlot, timeout: float) -> None:
        """Nothing to help with: gRPC's thread fills the slot."""
        slot.wait(timeout)

    def _address(self, key: ParsedKey) -> str:
        """The producer's gRPC address: the cluster's, else its presence record's."""
        address = self._ctx.peers.lookup(key.src).address
        if address is None:
            raise UnavailableError(
                f"no address known for task {key.src} for key {key.full_key!r}: not in the "
                "cluster spec and not running here"
            )
        return address

    def _issue(self, k: tuple[int, str], key: ParsedKey, waiter: _RemoteWaiter) -> None:
        """Start the head waiter's RecvTensor; wait for the producer's address if it is not
        known yet (a producer that has not started: its record appears when it does)."""
        try:
            address = self._address(key)
        except UnavailableError:
            with self._lock:
                waiter.resolving = True
            threading.Thread(
                target=self._await_address,
                args=(k, key, waiter),
                daemon=True,
                name="shmrdv-rpc-resolve",
            ).start()
            return
        except RendezvousError as e:
            # Cannot even look (out of descriptors, a record that is not ours): answer this
            # waiter, never leave it at the head where the key's later receives queue.
            self._fail_head(k, key, waiter, e)
            return
        self._start(k, key, address, waiter)

    def _fail_head(
        self, k: tuple[int, str], key: ParsedKey, waiter: _RemoteWaiter, error: BaseException
    ) -> None:
        """Answer the head waiter with ``error`` and move the key's queue on."""
        ours, nxt = self._pop_head(k, waiter)
        if ours:
            invoke_done(waiter.done, error, None)
            if nxt is not None:
                self._issue(k, key, nxt)

    def _await_address(self, k: tuple[int, str], key: ParsedKey, waiter: _RemoteWaiter) -> None:
        while True:
            with self._lock:
                queue = self._queues.get(k)
                if self._closed or not queue or queue[0] is not waiter:
                    return  # cancelled, aborted or closed meanwhile: answered there
            try:
                address = self._address(key)
            except UnavailableError:
                time.sleep(_RESOLVE_PERIOD)
                continue
            except RendezvousError as e:
                self._fail_head(k, key, waiter, e)
                return
            with self._lock:
                queue = self._queues.get(k)
                if not queue or queue[0] is not waiter:
                    return
                waiter.resolving = False
            self._start(k, key, address, waiter)
            return

    def _start(
        self, k: tuple[int, str], key: ParsedKey, address: str, waiter: _RemoteWaiter
    ) -> None:
        def finish(error: BaseException | None, received: Received | None) -> None:
            ours, nxt = self._pop_head(k, waiter)
            if not ours:
                return  # aborted or cancelled meanwhile: someone else answered
            if nxt is not None:
                self._issue(k, key, nxt)
            if received is not None:
                self._counters["received"] += 1
                self._counters["received_bytes"] += received.value.nbytes
                if waiter.copy or not received.value.flags.writeable:
                    received = Received(np.array(received.value, copy=True), received.is_dead)
            invoke_done(waiter.done, error, received)

        try:
            cancel = self._client.start_recv(address, k[0], key, finish, direct=waiter.direct)
        except BaseException as e:
            # Nothing is in flight for this waiter: take it off the head (or the key would
            # be stuck behind it forever), answer it, and move the queue on.
            self._fail_head(
                k,
                key,
                waiter,
                e
                if isinstance(e, RendezvousError)
                else UnavailableError(
                    f"cannot start receiving {key.full_key!r} from {address}: {e!r}"
                ),
            )
            return
        with self._lock:
            waiter.cancel_rpc = cancel

    def _pop_head(
        self, k: tuple[int, str], waiter: _RemoteWaiter
    ) -> tuple[bool, _RemoteWaiter | None]:
        """Remove ``waiter`` from the head of its queue: (was it there, the next waiter)."""
        with self._lock:
            queue = self._queues.get(k)
            if not queue or queue[0] is not waiter:
                return False, None
            queue.popleft()
            if queue:
                return True, queue[0]
            del self._queues[k]
            return True, None

    def _cancel(self, k: tuple[int, str], key: ParsedKey, waiter: _RemoteWaiter) -> bool:
        with self._lock:
            queue = self._queues.get(k)
            if not queue or waiter not in queue:
                return False
            if queue[0] is not waiter:
                queue.remove(waiter)  # not in flight yet
                return True
            rpc = waiter.cancel_rpc
            resolving = waiter.resolving
        if not resolving and (rpc is None or not rpc()):
            return False  # its value is arriving: done will be called
        ours, nxt = self._pop_head(k, waiter)
        if not ours:
            return False
        if nxt is not None:
            self._issue(k, key, nxt)
        return True

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        with self._lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            box = self._outboxes.get(step_id)
            waiters: list[_RemoteWaiter] = []
            for k in [k for k in self._queues if k[0] == step_id]:
                waiters.extend(self._queues.pop(k))
        if box is not None:
            box.start_abort(error)  # drops the values it holds: they give back their bytes
        self._release_held(step_id)
        for waiter in waiters:
            # Stop the call in flight; if its value already arrived, finish() finds the
            # queue gone and drops it: this error is the answer the caller gets.
            if waiter.cancel_rpc is not None:
                waiter.cancel_rpc()
            invoke_done(waiter.done, error, None)

    def cleanup_step(self, step_id: int) -> None:
        with self._lock:
            self._outboxes.pop(step_id, None)
            self._sent_steps.discard(step_id)
            self._aborted.pop(step_id, None)
        self._release_held(step_id)
        if self._server is not None:
            self._server.drop_step(step_id)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            boxes = list(self._outboxes.values())
            self._outboxes.clear()
            steps = {k[0] for k in self._queues}
        error = closed_error(self.task)
        for step in steps:
            self.abort_step(step, error)
        for box in boxes:
            box.start_abort(error)
        if self._windows is not None:
            with self._lock:
                self._held.clear()
            self._windows.reset()
        if self._server is not None:
            self._server.stop()
        self._client.close()

    def stats(self) -> dict[str, int]:
        out = dict(self._counters)
        with self._lock:
            out["outbox_steps"] = len(self._outboxes)
            out["outbox_values"] = sum(b.stats()["pending_values"] for b in self._outboxes.values())
            out["receives_pending"] = sum(len(q) for q in self._queues.values())
        if self._windows is not None:
            out["inflight_bytes"] = self._windows.used()
            out["window_waits"] = self._windows.waits()
        if self._server is not None:
            out.update({f"server_{k}": v for k, v in self._server.stats().items()})
        return out
