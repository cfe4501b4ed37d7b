"""RecvTensorSeries, the consumer's side: a key's values arrive before they are asked for.

One ``RecvTensor`` per receive waits a round trip for every value, so a consumer that
takes a key's values one after another (a pipeline) gets at most one value per round
trip. When a (step, key) is received a second time (or the first time, for a key that
had a series in an earlier step) and no ``RecvTensor`` of it is in flight,
``SeriesClient`` opens one ``RecvTensorSeries`` call for it to its producer
(``series_service``): the producer pushes the key's values as they are sent; each is
assembled as it comes (one copy: the chunks into the writable array a receive returns)
and goes to the oldest waiting receive, or waits in the series' table, in order.

* **Bounded**: a series keeps at most ``prefetch_bytes`` of values nobody took yet, plus
  what one message carries (it is taken apart whole: one value, or values packed up to
  the producer's ``chunk_bytes``, 4 MiB by default); what came of a value cut into
  several messages counts as it comes, so a large value passes the bound by one message,
  not by itself (a value larger than the bound comes whole into an empty table). Then
  its reader stops reading and HTTP/2 flow control stops the producer. ``stats()`` shows
  what the open series hold (``series_held_bytes``, ``series_held_peak``). At most
  ``max_series`` series are open; other keys use ``RecvTensor``.
* **Order**: while a series of a (step, key) exists every receive of it goes there; a
  series is opened only when no ``RecvTensor`` of the key is in flight (``busy``), so
  values are never served to two methods at once.
* **Ends**: the producer ends an idle series; the reader opens another at once if a
  receive waits, else the series goes once its table is empty (the next receive opens a
  new one). An error (the producer's step aborted or cleaned up, its worker closing)
  fails the receives waiting on it, with the error mapped as for ``RecvTensor``; values
  already there are still taken. A call that fails before any value came on the series
  hands its waiting receives to ``RecvTensor`` (``fallback``), in order: a producer that
  does not know the method (``UNIMPLEMENTED``: TensorFlow, an older shmrdv; no series to
  that address again), refuses one more series (``RESOURCE_EXHAUSTED``; none for
  ``_REFUSED_PAUSE``), or cannot be reached (``UNAVAILABLE``: ``RecvTensor`` retries
  it, or names it gone).
* **A dropped connection loses nothing**: a series has a request_id of its own
  (``series_reader``), on every call of it. The producer keeps each value it hands to
  the series until the consumer acknowledges it (``RecvTensorSeriesAck``, when the
  producer asks: ``series_retained``); a call that fails with ``UNAVAILABLE`` after
  values came is opened again (50 ms doubling to 1 s) saying how many values the series
  holds, and the producer sends again, in order, what it lacks: every value once. A
  producer gone (its server stopping, or unreachable for ``GONE_GRACE``) fails the
  receives waiting; the next receive opens the series again.
* ``abort_step``, ``cleanup_step`` and ``close`` cancel the step's (every) series and
  fail their waiting receives; values a series held go with its step.

Measured (``bench --pipeline --pipeline-cases 64k:1000,16m:100``, pinned, loopback, one
session, three runs each, against raw grpcio server-streaming): one ``RecvTensor`` per
value gave x0.109-0.156 at 64 KiB (763-1,175 values/s) and x0.52-0.74 at 16 MiB; the
series x0.98-1.14 and x0.94-1.03 (8,457-10,067 values/s at 64 KiB).

Modules: ``series_reader`` (one series: its call, reader thread and table),
``series_wire`` (its messages); this one opens series, routes receives to them and ends
them.

Thread model (docs/threads.md): one reader thread per series ("shmrdv-rpc-series",
``series_reader``) drives its call; each message is assembled in gRPC's channel thread,
which fills the slot of a blocked receiver that waited, and hands any other waiting
receive's ``done`` to a callback thread (``runner``). A receive whose value is there is
answered in its own thread. One lock guards ``SeriesClient``'s tables;
``done`` never runs under a lock of ours.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from .._errors import CancelledError, InternalError, RendezvousError
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback, Received, invoke_done
from .runner import Runner
from .series_reader import SeriesReader, Waiter

__all__ = ["PREFETCH_BYTES", "SeriesClient"]

#: What one series keeps of values nobody took yet, by default (plus one message).
PREFETCH_BYTES = 32 << 20
_MAX_SERIES = 64
# Keys that had a series, remembered (a bound: those of open series are kept).
_KEYS_KEPT = 4096
# After a producer refused a series (its bounds), how long its keys use RecvTensor.
_REFUSED_PAUSE = 5.0
_JOIN_TIMEOUT = 5.0

#: Start a ``RecvTensor`` receive of (step, key) with ``done``: the fallback.
Fallback = Callable[[int, ParsedKey, DoneCallback], Canceller]


class SeriesClient:
    """The series of one client (module docstring).

    ``channel(address)`` gives the channel to a producer, ``metadata`` goes with every
    call, ``busy((step_id, full_key))`` says whether a ``RecvTensor`` of that key is in
    flight, and ``fallback`` starts one.
    """

    def __init__(
        self,
        *,
        channel: Callable[[str], grpc.Channel],
        metadata: Sequence[tuple[str, str]],
        busy: Callable[[tuple[int, str]], bool],
        fallback: Fallback,
        prefetch_bytes: int = PREFETCH_BYTES,
        max_series: int = _MAX_SERIES,
    ) -> None:
        self._channel = channel
        self.metadata = metadata
        self._busy = busy
        self.fallback = fallback
        self.prefetch_bytes = prefetch_bytes
        self._max_series = max_series
        self._reset()

    def _reset(self) -> None:
        self._runner = Runner()  # callback receives' done, off the reader thread
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._series: dict[tuple[int, str], SeriesReader] = {}
        # The full keys that had a series, in any step: always those of the open series
        # (read without the lock by the transport, to pick RecvTensor or a series).
        self.keys: dict[str, None] = {}
        self._aborted: set[int] = set()
        self._unsupported: dict[str, float] = {}  # address -> until (monotonic)
        self._closed = False
        self._stats = {"received": 0, "received_bytes": 0, "series_opened": 0}

    def start_recv(
        self,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        address: Callable[[], str],
        *,
        blocking: bool = False,
    ) -> Canceller | None:
        """Receive through the key's series (opened now unless too many are open); None:
        use ``RecvTensor`` for this receive. The transport asks only for a (step, key)
        received before, or a key in ``keys``. ``address()`` gives the producer's address or
        raises ``RendezvousError``. ``blocking``: ``done`` only fills a blocked
        receiver's slot (the reader runs it); other ``done``s run on a callback thread
        when the value arrives later."""
        if os.getpid() != self._pid:
            self._reset()  # a forked child: the parent's series are not ours
        k = (step_id, key.full_key)
        with self._lock:
            series = self._series.get(k)
            if series is None and (
                self._closed or step_id in self._aborted or len(self._series) >= self._max_series
            ):
                return None
        if series is not None:
            canceller = series.start_recv(done, blocking)
            if canceller is None:  # over and drained: a new one opens at the next receive
                with self._lock:
                    if self._series.get(k) is series:
                        del self._series[k]
            return canceller
        return self._open(k, key, done, address, blocking)

    def _open(
        self,
        k: tuple[int, str],
        key: ParsedKey,
        done: DoneCallback,
        address: Callable[[], str],
        blocking: bool,
    ) -> Canceller | None:
        if self._busy(k):
            return None
        try:
            where = address()
        except RendezvousError:
            return None  # RecvTensor retries and explains
        with self._lock:
            until = self._unsupported.get(where)
            if until is not None and time.monotonic() < until:
                return None
            if self._closed or k in self._series or k[0] in self._aborted:
                return None
            series = self._series[k] = SeriesReader(self, where, k[0], key)
            if len(self.keys) >= _KEYS_KEPT and k[1] not in self.keys:
                self.keys = dict.fromkeys(key for _, key in self._series)
            self.keys[k[1]] = None
            self._stats["series_opened"] += 1
        canceller = series.start_recv(done, blocking)
        try:
            series.thread.start()
        except RuntimeError as e:  # "can't start new thread"
            series.close(InternalError(f"cannot start a series reader: {e}"))
        return canceller

    def channel(self, address: str) -> grpc.Channel:
        """The channel to a producer (a series' reader thread asks)."""
        return self._channel(address)

    def deliver(
        self, waiter: Waiter, error: BaseException | None, received: Received | None
    ) -> None:
        """Complete a receive that waited: a blocked receiver's slot here (the reader's
        thread), any other ``done`` on a callback thread (it may block, or receive)."""
        if waiter.blocking:
            invoke_done(waiter.done, error, received)
        else:
            self._runner.submit(invoke_done, waiter.done, error, received)

    def count(self, received: Received) -> None:
        self._stats["received"] += 1
        self._stats["received_bytes"] += received.value.nbytes

    def refused(self, address: str, code: grpc.StatusCode) -> None:
        """``address`` has no series for us: none at all, or none for a while."""
        pause = float("inf") if code == grpc.StatusCode.UNIMPLEMENTED else _REFUSED_PAUSE
        with self._lock:
            self._unsupported[address] = time.monotonic() + pause

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Fail the step's waiting receives with ``error`` and stop its series."""
        with self._lock:
            self._aborted.add(step_id)
            gone = [s for k, s in self._series.items() if k[0] == step_id]
            for s in gone:
                del self._series[(s.step_id, s.key.full_key)]
        for s in gone:
            s.close(error)

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step: its series (stopped) and abort."""
        with self._lock:
            self._aborted.discard(step_id)
            gone = [s for k, s in self._series.items() if k[0] == step_id]
            for s in gone:
                del self._series[(s.step_id, s.key.full_key)]
        for s in gone:
            s.close(CancelledError(f"step {step_id} was cleaned up"))

    def close(self, error: BaseException) -> None:
        """Stop every series (waiting receives fail with ``error``) and join the readers."""
        if os.getpid() != self._pid:
            self._reset()
        with self._lock:
            self._closed = True
            gone = list(self._series.values())
            self._series.clear()
        for s in gone:
            s.close(error)
        for s in gone:
            if s.thread.is_alive() and s.thread is not threading.current_thread():
                s.thread.join(_JOIN_TIMEOUT)
        self._runner.shutdown(_JOIN_TIMEOUT)

    def stats(self) -> dict[str, int]:
        """Counters; ``series_held_bytes``: what the open series hold that no receive
        took yet (``series_held_values``: the values), ``series_held_peak``: the most one
        of them held at once."""
        out = dict(self._stats)
        with self._lock:
            out["series"] = len(self._series)
            open_now = list(self._series.values())
        held = [s.held() for s in open_now]
        out["series_held_bytes"] = sum(now for now, _, _ in held)
        out["series_held_peak"] = max((peak for _, peak, _ in held), default=0)
        out["series_held_values"] = sum(values for _, _, values in held)
        return out


def _too_late() -> bool:
    return False
