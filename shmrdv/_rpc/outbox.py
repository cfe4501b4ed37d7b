"""Outbox: the producer's values for consumers on other hosts, until their RecvTensor.

``send`` to a consumer on another host buffers the value here, per step (an in-process
``LocalRendezvous``); the consumer's RecvTensor call, served by ``RpcServer``, takes it
through ``serve_recv`` (the server's ``TensorSource``), waiting up to the call's
deadline. A step's box is created on the first send or request and dropped by
``cleanup_step``; a request for a step already cleaned up fails at once with ``ABORTED``
(TensorFlow's FindOrCreate would wait forever).

Backpressure (``TransportContext.max_inflight_bytes``): one ``InflightWindow`` per
consumer task. ``send`` reserves the value's bytes (``methods.counted_bytes``: at least
``VALUE_FLOOR``, so that empty values are bounded too) before copying it in (waiting up
to the send's timeout). They count until the server is done with the value
(``done_with``: the call that carried it has ended, or the value was dropped), not when
a call takes it: a consumer that asks and never reads holds the window, not this
process's memory (issue 19 §4). A ``requeue`` counts them again, ``cleanup_step`` gives
back what the step still holds and ``close`` everything; a consumer that died (its
presence record on this host, looked at while a reservation waits) frees its window. The
bytes a step holds per consumer are counted here (``_held``), so the window and the
boxes cannot drift apart.

Thread model (docs/threads.md): every method may be called from any thread; one lock
guards the tables. ``serve_recv``'s ``done`` runs in the caller's thread when the value
is already there (the server's event loop: no hop), else in the sending thread.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import (
    AbortedError,
    InvalidArgumentError,
    RendezvousError,
    UnavailableError,
    closed_error,
    is_closed_error,
)
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback, LocalRendezvous, Received
from .._transport import TransportContext
from .._window import ConsumerWatch, InflightWindow, Windows, counted_bytes
from . import series_wire
from .methods import SERVER_STOPPING
from .send_pool import SendPool

__all__ = ["Outbox"]

# What the pool of sent copies keeps at most without a window (max_inflight_bytes).
_POOL_BYTES = 64 << 20


class Outbox:
    """The values one worker has sent to consumers on other hosts (a ``TensorSource``)."""

    def __init__(self, ctx: TransportContext) -> None:
        self._ctx = ctx
        self.task: str = ctx.task_name
        self.incarnation: int = ctx.incarnation
        self.max_inflight_bytes: int | None = ctx.max_inflight_bytes
        self._lock = threading.Lock()
        self._boxes: dict[int, LocalRendezvous] = {}
        self._aborted: dict[int, BaseException] = {}
        self._sent_steps: set[int] = set()
        self._owned: dict[int, weakref.ref[npt.NDArray[Any]]] = {}
        self._closed = False
        self._counters = {"sent": 0, "sent_bytes": 0}
        limit = ctx.max_inflight_bytes
        self._windows: Windows | None = None if limit is None else Windows(limit)
        # Per step, per consumer's window: bytes its box (or the server) holds.
        self._held: dict[int, dict[InflightWindow, int]] = {}
        self._watches: dict[InflightWindow, ConsumerWatch] = {}
        # The memory of the copies sent, kept for the next ones: as much as the window
        # lets a consumer hold (what a pipeline runs ahead), else _POOL_BYTES.
        self._pool = SendPool(_POOL_BYTES if limit is None else limit)

    def __repr__(self) -> str:
        return f"<Outbox {self.task} steps={len(self._boxes)} closed={self._closed}>"

    def _box(self, step_id: int, *, for_send: bool) -> LocalRendezvous:
        with self._lock:
            if self._closed:
                raise closed_error(self.task)
            err = self._aborted.get(step_id)
            if err is not None:
                raise err
            box = self._boxes.get(step_id)
            if box is None:
                box = self._boxes[step_id] = LocalRendezvous()
            if for_send:
                self._sent_steps.add(step_id)
            return box

    def _drop_if_unused(self, step_id: int) -> None:
        """Forget a box a request created for a step this worker never sent in.

        A peer naming arbitrary step ids must not grow the producer's memory: such a box
        goes as soon as nothing waits in it. (One a send touched stays until
        ``cleanup_step``; checking under the lock means a send never lands in a dropped box.)
        """
        with self._lock:
            box = self._boxes.get(step_id)
            if box is None or step_id in self._sent_steps:
                return
            st = box.stats()
            if st["pending_waiters"] == 0 and st["pending_values"] == 0:
                del self._boxes[step_id]

    def allocate(self, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """An array that ``send`` hands over as is (no copy); the producer must not write
        into it after sending."""
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

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None,
    ) -> None:
        """Buffer ``value`` for its consumer (``Transport.send``)."""
        box = self._box(step_id, for_send=True)
        if self._windows is None:
            self._put(box, key, value, is_dead)
            return
        nbytes = counted_bytes(value.nbytes)
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
            # same one copy the shared-memory path makes). From 32 KiB, in memory an
            # earlier copy used (``SendPool``: no page faults); a smaller one is made as
            # the series message that carries it, so that sending it copies it no more.
            copy = self._pool.copy(value)
            if copy is None and not is_dead:
                copy = series_wire.packed_copy(value)
            value = np.array(value, copy=True, order="C") if copy is None else copy
        box.send(key, value, is_dead=is_dead)
        self._counters["sent"] += 1
        self._counters["sent_bytes"] += value.nbytes

    # -- the window's accounting (only with max_inflight_bytes) -------------------------

    def _hold(self, step_id: int, window: InflightWindow, nbytes: int) -> None:
        """``nbytes`` counted in ``window`` are now held by the step."""
        with self._lock:
            if self._closed:
                raise closed_error(self.task)
            err = self._aborted.get(step_id)
            if err is not None:
                raise err
            per = self._held.setdefault(step_id, {})
            per[window] = per.get(window, 0) + nbytes

    def _unhold(self, step_id: int, window: InflightWindow, nbytes: int) -> None:
        """``nbytes`` left the step (delivered, dropped, or never put): give them back.

        At most what the step still holds: after ``cleanup_step`` gave it all back, a
        late one gives back nothing twice."""
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
        boxes until their steps are cleaned up, for a consumer that comes back)."""
        with self._lock:
            for per in self._held.values():
                per.pop(window, None)
        window.reset()

    def _release_held(self, step_id: int) -> None:
        """Give back the bytes the step still holds (it dropped them)."""
        if self._windows is None:
            return
        with self._lock:
            per = self._held.pop(step_id, None)
        for window, nbytes in (per or {}).items():
            if nbytes:
                window.release(nbytes)

    # -- the TensorSource of the server ------------------------------------------------

    def serve_recv(self, step_id: int, key: ParsedKey, done: DoneCallback) -> Canceller:
        """Take the next value of ``key`` for a RecvTensor call (``TensorSource``)."""
        if self._ctx.cleaned_up(step_id):
            raise AbortedError(
                f"Cleanup {step_id}: step {step_id} of {self.task} was already cleaned up"
            )
        box = self._box(step_id, for_send=False)

        def finished(error: BaseException | None, received: Received | None) -> None:
            done(error, received)
            self._drop_if_unused(step_id)

        cancel = box.start_recv(key, finished)

        def canceller() -> bool:
            removed = cancel()
            if removed:
                self._drop_if_unused(step_id)
            return removed

        return canceller

    def done_with(self, step_id: int, key: ParsedKey, nbytes: int) -> None:
        """The server is done with a value it took: the window counts it no more."""
        if self._windows is not None:
            self._unhold(step_id, self._windows.for_key(key), nbytes)

    def requeue(self, step_id: int, key: ParsedKey, received: Received) -> None:
        """A value taken for a call that then failed goes back to the head of its key,
        and counts in the window again (without waiting)."""
        with self._lock:
            box = self._boxes.get(step_id)
        if box is None:
            return
        if self._windows is None:
            box.requeue(key, received)
            return
        nbytes = counted_bytes(received.value.nbytes)
        window = self._windows.for_key(key)
        try:
            self._hold(step_id, window, nbytes)
        except RendezvousError:
            return  # aborted or closed meanwhile: the value is dropped, like the box's
        window.charge(nbytes)  # in flight again, without waiting
        box.requeue(key, received)
        if box.aborted is not None:
            self._unhold(step_id, window, nbytes)  # dropped by an abort that came in between

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Drop the step's values; later sends and requests fail with ``error``.

        The worker closing is, to a consumer on another host, its producer going away:
        its waiting calls fail with ``UNAVAILABLE`` saying the server is stopping, and
        the consumer fails its receive at once (issue 19, bug 3a)."""
        if is_closed_error(error, self.task):
            error = UnavailableError(f"Worker {self.task} is closed: its server {SERVER_STOPPING}")
        with self._lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            box = self._boxes.get(step_id)
        if box is not None:
            box.start_abort(error)  # drops the values it holds
        self._release_held(step_id)

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step (its box, its abort) and give back what it holds."""
        with self._lock:
            self._boxes.pop(step_id, None)
            self._sent_steps.discard(step_id)
            self._aborted.pop(step_id, None)
        self._release_held(step_id)

    def close(self) -> None:
        """Drop every value; later calls fail with the closed error. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            boxes = list(self._boxes.values())
            self._boxes.clear()
        error = closed_error(self.task)
        for box in boxes:
            box.start_abort(error)
        self._pool.close()
        if self._windows is not None:
            with self._lock:
                self._held.clear()
            self._windows.reset()

    def stats(self) -> dict[str, int]:
        """Counters: sent, sent bytes, steps and values held, and the window's."""
        out = dict(self._counters)
        out.update(self._pool.stats())
        with self._lock:
            out["outbox_steps"] = len(self._boxes)
            out["outbox_values"] = sum(b.stats()["pending_values"] for b in self._boxes.values())
        if self._windows is not None:
            out["inflight_bytes"] = self._windows.used()
            out["window_waits"] = self._windows.waits()
        return out
