"""RecvTensorSeries, the consumer's side: a key's values arrive before they are asked for.

One ``RecvTensor`` per receive waits a round trip for every value, so a consumer that
takes a key's values one after another (a pipeline) gets at most one value per round
trip. When a (step, key) is received a second time and no ``RecvTensor`` of it is in
flight, ``SeriesClient`` opens one ``RecvTensorSeries`` call for it to its producer
(``series_service``): the producer pushes the key's values as they are sent, a reader
thread assembles each (one copy: the chunks into the writable array a receive returns)
and keeps it in the series' table until a receive takes it, in order.

* **Bounded**: a series keeps at most ``prefetch_bytes`` of values nobody took yet (one
  value whatever its size); then its reader stops reading and HTTP/2 flow control stops
  the producer. At most ``max_series`` series are open; other keys use ``RecvTensor``.
* **Order**: while a series of a (step, key) exists every receive of it goes there; a
  series is opened only when no ``RecvTensor`` of the key is in flight (``busy``), so
  values are never served to two methods at once.
* **Ends**: the producer ends an idle series; the reader opens another at once if a
  receive waits, else the series goes once its table is empty (the next receive opens a
  new one). An error (the producer's step aborted or cleaned up, its worker closing,
  the connection lost) fails the receives waiting on it, with the error mapped as for
  ``RecvTensor``; values already there are still taken. A producer that does not know
  the method (``UNIMPLEMENTED``: TensorFlow, an older shmrdv) or refuses one more series
  (``RESOURCE_EXHAUSTED``) gets the waiting receives handed to ``RecvTensor``
  (``fallback``), and no series again (that address, resp. for ``_REFUSED_PAUSE``).
* ``abort_step``, ``cleanup_step`` and ``close`` cancel the step's (every) series and
  fail their waiting receives; values a series held go with its step.

Measured (bench --pipeline, producer and consumer pinned, loopback, same run, medians):
see the closing note of issue 19 for the figures; 64 KiB x 1,000 went from one
``RecvTensor`` per value (~1,200 values/s) to the series.

Thread model (docs/threads.md): one reader thread per series ("shmrdv-rpc-series"),
reading its call; it fills the slot of a blocked receiver that waited, and hands any
other waiting receive's ``done`` to a callback thread (``runner``). A receive whose value is there is
answered in its own thread. One lock per series guards its table and a condition on it
holds the reader while the table is full; one lock guards ``SeriesClient``'s tables.
``done`` never runs under a lock of ours.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from .._callbacks import DoneCallback, invoke_done
from .._errors import CancelledError, InternalError, RendezvousError
from .._keys import ParsedKey
from .._received import Received
from .._rendezvous import Canceller
from . import assembly, messages, series_wire
from .methods import RECV_TENSOR_SERIES_METHOD
from .recv_errors import call_error
from .rpc_errors import error_code
from .runner import Runner

__all__ = ["SeriesClient"]

_log = logging.getLogger("shmrdv.rpc.client")

_PREFETCH_BYTES = 32 << 20
_MAX_SERIES = 64
# Receives counted per (step, key) to find the keys that carry a series.
_COUNTS_KEPT = 4096
# After a producer refused a series (its bounds), how long its keys use RecvTensor.
_REFUSED_PAUSE = 5.0
_JOIN_TIMEOUT = 5.0

#: Start a ``RecvTensor`` receive of (step, key) with ``done``: the fallback.
Fallback = Callable[[int, ParsedKey, DoneCallback], Canceller]


class _Waiter:
    """A receive waiting on a series (hashed by identity)."""

    __slots__ = ("blocking", "done", "redirect")

    def __init__(self, done: DoneCallback, blocking: bool) -> None:
        self.done = done
        self.blocking = blocking  # done only fills a blocked receiver's slot
        self.redirect: Canceller | None = None  # handed to RecvTensor: its canceller


class _Series:
    """One ``RecvTensorSeries`` call for (step, key), its reader thread and its table."""

    def __init__(
        self,
        owner: SeriesClient,
        channel: grpc.Channel,
        address: str,
        step_id: int,
        key: ParsedKey,
    ) -> None:
        self._owner = owner
        self._method = channel.unary_stream(RECV_TENSOR_SERIES_METHOD)
        self.address = address
        self.step_id = step_id
        self.key = key
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._values: collections.deque[Received] = collections.deque()
        self._held = 0
        self._waiters: collections.OrderedDict[_Waiter, None] = collections.OrderedDict()
        self.ended = False  # no value will come any more
        self._closed = False
        self._call: Any = None
        self.thread = threading.Thread(target=self._run, name="shmrdv-rpc-series", daemon=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def _where(self) -> str:
        return f"key {self.key.full_key!r} (step {self.step_id}) from {self.address}"

    # -- receives (any thread) ------------------------------------------------------------

    def start_recv(self, done: DoneCallback, blocking: bool) -> Canceller | None:
        """Take the next value (``done`` now), or wait for it; None: the series has
        ended and holds nothing, the receive must go elsewhere."""
        with self._lock:
            if self._values:
                received = self._values.popleft()
                self._held -= received.value.nbytes
                self._room.notify()
            elif self.ended:
                return None
            else:
                waiter = _Waiter(done, blocking)
                self._waiters[waiter] = None
                return lambda: self._cancel(waiter)
        self._owner.count(received)
        invoke_done(done, None, received)
        return _too_late

    def _cancel(self, waiter: _Waiter) -> bool:
        with self._lock:
            if waiter in self._waiters:
                del self._waiters[waiter]
                return True
            redirect = waiter.redirect
        return redirect() if redirect is not None else False

    def close(self, error: BaseException) -> None:
        """Stop the call; waiting receives fail with ``error``; held values are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = self.ended = True
            call = self._call
            waiters = list(self._waiters)
            self._waiters.clear()
            self._values.clear()
            self._held = 0
            self._room.notify_all()
        if call is not None:
            call.cancel()
        for waiter in waiters:
            invoke_done(waiter.done, error, None)

    # -- the reader thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._read()
        except BaseException as e:  # a bug here must not leave a receiver waiting forever
            _log.exception("RecvTensorSeries of %s failed unexpectedly", self._where())
            self._end(InternalError(f"receiving {self._where()} failed: {e!r}"), fallback=False)

    def _read(self) -> None:
        request = messages.encode_request(self.step_id, self.key.full_key, 0)
        while True:
            with self._lock:
                if self._closed:
                    return
                call = self._method(request, metadata=self._owner.metadata)
                self._call = call
            assembler: assembly.StreamAssembler | None = None
            values = 0
            try:
                for message in call:
                    for chunk in series_wire.series_chunks(message):
                        if assembler is None:
                            assembler = assembly.StreamAssembler()
                        assembler.feed(chunk)
                        if assembler.complete:
                            received = Received(assembler.result(), assembler.is_dead)
                            assembler = None
                            values += 1
                            self._arrived(received)
            except grpc.RpcError as e:
                if self.closed:
                    return
                code = error_code(e)
                fallback = values == 0 and code in (
                    grpc.StatusCode.UNIMPLEMENTED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
                if fallback:
                    self._owner.refused(self.address, code)
                self._end(call_error(code, e, self._where(), None, receiving=False), fallback)
                return
            except RendezvousError as e:  # the assembler refused what arrived
                call.cancel()
                self._end(
                    InternalError(
                        f"bad RecvTensorSeries from {self.address} for {self._where()}: {e}"
                    ),
                    fallback=False,
                )
                return
            if assembler is not None:
                self._end(
                    InternalError(f"RecvTensorSeries of {self._where()} ended inside a value"),
                    fallback=False,
                )
                return
            with self._lock:  # the producer ended it: the key was idle
                if self._closed or not self._waiters:
                    self.ended = True
                    return
            # A receive waits: open another.

    def _arrived(self, received: Received) -> None:
        with self._lock:
            if self._closed:
                return
            if self._waiters:
                waiter, _ = self._waiters.popitem(last=False)
            else:
                self._values.append(received)
                self._held += received.value.nbytes
                while self._held >= self._owner.prefetch_bytes and not self._closed:
                    self._room.wait()
                return
        self._owner.count(received)
        self._owner.deliver(waiter, None, received)

    def _end(self, error: BaseException, fallback: bool) -> None:
        """The series is over: its waiting receives fail with ``error``, or (``fallback``:
        the producer has no series for us) go to ``RecvTensor``, in order."""
        with self._lock:
            self.ended = True
            waiters = list(self._waiters)
            self._waiters.clear()
        for waiter in waiters:
            if fallback:
                canceller = self._owner.fallback(self.step_id, self.key, waiter.done)
                with self._lock:
                    waiter.redirect = canceller
            else:
                self._owner.deliver(waiter, error, None)


class SeriesClient:
    """The series of one client (module docstring).

    ``channel(address)`` gives the channel to a producer, ``metadata`` goes with every
    call, ``busy(step_id, full_key)`` says whether a ``RecvTensor`` of that key is in
    flight, and ``fallback`` starts one.
    """

    def __init__(
        self,
        *,
        channel: Callable[[str], grpc.Channel],
        metadata: Sequence[tuple[str, str]],
        busy: Callable[[int, str], bool],
        fallback: Fallback,
        prefetch_bytes: int = _PREFETCH_BYTES,
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
        self._series: dict[tuple[int, str], _Series] = {}
        self._counts: dict[tuple[int, str], int] = {}
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
        """Receive through the key's series (opened now if the key qualifies); None: use
        ``RecvTensor`` for this receive. ``address()`` gives the producer's address or
        raises ``RendezvousError``. ``blocking``: ``done`` only fills a blocked
        receiver's slot (the reader runs it); other ``done``s run on a callback thread
        when the value arrives later."""
        if os.getpid() != self._pid:
            self._reset()  # a forked child: the parent's series are not ours
        k = (step_id, key.full_key)
        with self._lock:
            series = self._series.get(k)
            if series is None:
                if len(self._counts) >= _COUNTS_KEPT and k not in self._counts:
                    self._counts.clear()  # a bound, not an LRU
                n = self._counts[k] = self._counts.get(k, 0) + 1
                if n < 2 or self._closed or step_id in self._aborted:
                    return None
                if len(self._series) >= self._max_series:
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
        if self._busy(*k):
            return None
        try:
            where = address()
            channel = self._channel(where)
        except RendezvousError:
            return None  # RecvTensor retries and explains
        with self._lock:
            until = self._unsupported.get(where)
            if until is not None and time.monotonic() < until:
                return None
            if self._closed or k in self._series or k[0] in self._aborted:
                return None
            series = self._series[k] = _Series(self, channel, where, k[0], key)
            self._stats["series_opened"] += 1
        canceller = series.start_recv(done, blocking)
        try:
            series.thread.start()
        except RuntimeError as e:  # "can't start new thread"
            series.close(InternalError(f"cannot start a series reader: {e}"))
        return canceller

    def deliver(
        self, waiter: _Waiter, error: BaseException | None, received: Received | None
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
        """Forget the step: its series (stopped), counts and abort."""
        with self._lock:
            self._aborted.discard(step_id)
            gone = [s for k, s in self._series.items() if k[0] == step_id]
            for s in gone:
                del self._series[(s.step_id, s.key.full_key)]
            for k in [k for k in self._counts if k[0] == step_id]:
                del self._counts[k]
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
        out = dict(self._stats)
        with self._lock:
            out["series"] = len(self._series)
        return out


def _too_late() -> bool:
    return False
