"""Outbox: the values a worker sent to consumers on other hosts, until a call takes them.

``send`` encodes the value (its one copy) into the core's per-key ``WaiterTable``. The
server's calls and series (``Taker``s) take values or park; a send hands them over with
one wake-up of the loop for every answer ready meanwhile. A value not delivered goes back
to its key's head (``requeue``). The window (``_window``) counts a value until it is
delivered, dropped, its step ends or its consumer died.

Thread model (docs/threads.md): any thread; one lock guards the table; takers are
settled after it is released, on the serving loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy.typing as npt

from .._channels import MISSING, WaiterTable
from .._errors import (
    AbortedError,
    InvalidArgumentError,
    UnavailableError,
    closed_error,
    is_closed_error,
)
from .._keys import DeviceName, ParsedKey, parse_key
from .._transport import PeerDirectory
from .._window import ConsumerWatch, InflightWindow, Windows, counted_bytes
from .messages import CHUNK_BYTES, Encoded, encode_value

__all__ = ["SERVER_STOPPING", "Outbox", "Sent", "Taker", "served_key"]

#: What an UNAVAILABLE from a server shutting down says: its producer is gone for good.
SERVER_STOPPING = "is stopping"


def served_key(key: str, task: DeviceName, task_name: str, incarnation: int) -> ParsedKey:
    """``key`` parsed, if this worker is its source; else TensorFlow's errors, word for word
    (``InvalidArgumentError`` "Invalid rendezvous key (src)", ``AbortedError`` for another
    incarnation)."""
    pk = parse_key(key)
    if not pk.src.same_task(task):
        raise InvalidArgumentError(f"Invalid rendezvous key (src): {pk.full_key} @ {task_name}")
    if pk.src_incarnation not in (0, incarnation):
        raise AbortedError(
            f"RecvTensor expects a different device incarnation: {pk.src_incarnation:016x} "
            f'vs. {incarnation:016x}. Your worker job ("{task_name}") was probably '
            "restarted. Check your worker job for the reason why it was restarted."
        )
    return pk


class Sent:
    """One value sent and not delivered yet: its responses and what it holds of a window."""

    __slots__ = ("counted", "encoded", "k", "key", "window")

    def __init__(self, encoded: Encoded, k: tuple[int, str], key: ParsedKey) -> None:
        self.encoded = encoded
        self.k = k
        self.key = key
        self.window: InflightWindow | None = None
        self.counted = 0


class Taker:
    """A call (or series) waiting on the serving loop for the next value of one key;
    ``settle`` runs on the loop with the value or the error."""

    __slots__ = ()

    def settle(self, sent: Sent | None, error: BaseException | None) -> None:
        raise NotImplementedError


class Outbox:
    """The values one worker sent to consumers on other hosts (module docstring).

    ``cleaned_up(step)``: whether the worker cleaned the step up (its requests fail at
    once); ``peers``: to see a consumer die (its window is then freed).
    """

    def __init__(
        self, task: str, incarnation: int, *,
        cleaned_up: Callable[[int], bool] = lambda step_id: False,
        peers: PeerDirectory | None = None, max_inflight_bytes: int | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:  # fmt: skip
        self.task = task
        self.incarnation = incarnation
        self.max_inflight_bytes = max_inflight_bytes
        self._cleaned_up = cleaned_up
        self._peers = peers
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._table: WaiterTable[tuple[int, str], Sent, Taker] = WaiterTable()
        self._aborted: dict[int, BaseException] = {}
        self._closed = False
        self._windows = None if max_inflight_bytes is None else Windows(max_inflight_bytes)
        self._watches: dict[InflightWindow, ConsumerWatch] = {}
        self._live: dict[int, set[Sent]] = {}  # per step, what holds window bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = -1
        self._ready: list[tuple[Taker, Sent | None, BaseException | None]] = []
        self.sent = self.sent_bytes = 0

    def __repr__(self) -> str:
        return f"<Outbox {self.task} values={self._table.pending_values} closed={self._closed}>"

    def serve_from(self, loop: asyncio.AbstractEventLoop) -> None:
        """Parked calls live on ``loop`` (called in it, by the server that starts)."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    # -- the producer's side -------------------------------------------------------------

    def send(
        self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool,
        timeout: float | None,
    ) -> None:  # fmt: skip
        """Buffer ``value`` for its consumer (``Transport.send``); waits only for room in a
        full window, up to ``timeout`` (``ResourceExhaustedError``, nothing sent)."""
        with self._lock:
            error = self._error(step_id)
        if error is not None:
            raise error
        window = None
        counted = counted_bytes(value.nbytes)
        if self._windows is not None:
            window = self._reserve(key, counted, timeout)
        try:
            encoded = encode_value(value, is_dead, chunk_bytes=self._chunk_bytes)
        except BaseException:
            if window is not None:
                window.release(counted)
            raise
        sent = Sent(encoded, (step_id, key.full_key), key)
        with self._lock:
            error = self._error(step_id)
            if error is None:
                if window is not None:
                    sent.window, sent.counted = window, counted
                    self._live.setdefault(step_id, set()).add(sent)
                taker = self._table.put(sent.k, sent)
                self.sent += 1
                self.sent_bytes += encoded.nbytes
        if error is not None:
            if window is not None:
                window.release(counted)
            raise error
        if taker is not None:
            self._hand(taker, sent, None)

    def _reserve(self, key: ParsedKey, counted: int, timeout: float | None) -> InflightWindow:
        assert self._windows is not None
        window = self._windows.for_key(key)
        watch = self._watches.get(window)
        if watch is None and self._peers is not None:
            watch = self._watches.setdefault(window, ConsumerWatch(self._peers, key.dst))

        def refresh() -> None:
            if watch is not None and watch.died():
                self._forget(window)

        window.reserve(counted, timeout, refresh, key.full_key)
        return window

    def release(self, sent: Sent) -> None:
        """``sent`` was delivered, dropped or is its dead consumer's: the window counts it
        no more (once)."""
        window = sent.window
        if window is None:
            return
        with self._lock:
            live = self._live.get(sent.k[0])
            if live is None or sent not in live:
                return
            live.discard(sent)
        window.release(sent.counted)

    def _forget(self, window: InflightWindow) -> None:
        """Its consumer died: what it did not take counts no more (it stays queued for a
        consumer that comes back, until its step is cleaned up)."""
        with self._lock:
            for live in self._live.values():
                for sent in [s for s in live if s.window is window]:
                    live.discard(sent)
        window.reset()

    def _error(self, step_id: int) -> BaseException | None:
        if self._closed:
            return closed_error(self.task)
        return self._aborted.get(step_id)

    # -- the server's side (the serving loop) -------------------------------------------

    def take(self, step_id: int, key: ParsedKey, taker: Taker | None) -> Sent | None:
        """The next value of ``key`` now, or None: ``taker`` parked (``settle`` comes on
        the loop), or nothing there and no ``taker``. Raises ``AbortedError`` at once for
        a step cleaned up, and the step's abort error."""
        if self._cleaned_up(step_id):
            raise AbortedError(
                f"Cleanup {step_id}: step {step_id} of {self.task} was already cleaned up"
            )
        k = (step_id, key.full_key)
        with self._lock:
            error = self._error(step_id)
            if error is None:
                got = self._table.take(k)
                if got is not MISSING:
                    return got
                if taker is not None:
                    self._table.wait(k, taker)
                return None
        raise error

    def cancel(self, step_id: int, key: ParsedKey, taker: Taker) -> bool:
        """Unpark ``taker``: True if it was still waiting (it gets nothing)."""
        with self._lock:
            return self._table.cancel((step_id, key.full_key), taker)

    def requeue(self, sent: Sent) -> None:
        """A value taken but not delivered goes back to the head of its key (or to the
        taker parked there); dropped if its step was aborted meanwhile."""
        gone = self._cleaned_up(sent.k[0])
        with self._lock:
            error = self._error(sent.k[0]) or (closed_error(self.task) if gone else None)
            taker = None if error is not None else self._table.put(sent.k, sent, front=True)
            live = self._live.setdefault(sent.k[0], set())
            charge = error is None and sent.window is not None and sent not in live
            if charge:
                live.add(sent)  # delivered, and now in flight again
        if charge:
            assert sent.window is not None
            sent.window.charge(sent.counted)
        if error is not None:
            self.release(sent)
        elif taker is not None:
            self._hand(taker, sent, None)

    def _hand(self, taker: Taker, sent: Sent | None, error: BaseException | None) -> None:
        """Complete ``taker`` on the loop: at once in the loop's thread, else with one
        wake-up for every answer that is ready meanwhile."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            taker.settle(sent, error)
            return
        with self._lock:
            self._ready.append((taker, sent, error))
            first = len(self._ready) == 1
        if first:
            try:
                loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is gone: the server stopped
                self._drain()

    def _drain(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for taker, sent, error in ready:
            taker.settle(sent, error)

    # -- steps and lifetime ----------------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Drop the step's values and fail its parked calls; later sends and requests fail
        with ``error``. The worker closing is, to consumers on other hosts, their producer
        going away: ``UNAVAILABLE``, "is stopping"."""
        if is_closed_error(error, self.task):
            error = UnavailableError(f"Worker {self.task} is closed: its server {SERVER_STOPPING}")
        with self._lock:
            error = self._aborted.setdefault(step_id, error)
            takers = self._table.abort(lambda k: k[0] == step_id)
            live = self._live.pop(step_id, set())
        for sent in live:
            if sent.window is not None:
                sent.window.release(sent.counted)
        for taker in takers:
            self._hand(taker, None, error)

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; what it still holds of the window is given back."""
        with self._lock:
            self._aborted.pop(step_id, None)
            live = self._live.pop(step_id, set())
        for sent in live:
            if sent.window is not None:
                sent.window.release(sent.counted)

    def close(self) -> None:
        """Drop every value; parked calls and later calls fail. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            takers = self._table.abort()
            self._live.clear()
        error = UnavailableError(f"Worker {self.task} is closed: its server {SERVER_STOPPING}")
        for taker in takers:
            self._hand(taker, None, error)
        if self._windows is not None:
            self._windows.reset()

    def stats(self) -> dict[str, int]:
        out = {"sent": self.sent, "sent_bytes": self.sent_bytes}
        with self._lock:
            out["outbox_values"] = self._table.pending_values
            out["outbox_parked"] = self._table.pending_waiters
        if self._windows is not None:
            out["inflight_bytes"] = self._windows.used()
            out["window_waits"] = self._windows.waits()
        return out
