"""One ``RecvTensorSeries`` call of a consumer: its reader thread and its table.

A ``SeriesReader`` is opened by ``series_client.SeriesClient`` for one (step, key) and
reads the call: each value is assembled (``assembly.StreamAssembler``: one copy, the
chunks into the writable array a receive returns) and handed to the oldest waiting
receive, or kept (in order, at most ``prefetch_bytes`` with what came of a value being
assembled, plus one message; then the reader stops reading and HTTP/2 flow control holds
the producer; ``held`` says how much). The producer ending an idle series makes the
reader open another if a receive waits. Every call of the series carries its own
request_id and how many values came on it (``held``): the producer keeps what it sent
until acknowledged (``series_ack``: when a message asks, one call at a time), and a
call that drops is opened again and gets what it lacks. What the series
does on errors and ends is described on ``series_client``; what it uses of its owner is
``SeriesOwner``.

Thread model (docs/threads.md): each message is taken apart where gRPC hands it over,
in the channel's own thread, as the call's response deserializer (``series_feed``): its
values are assembled and delivered there, so a blocked receiver is woken by that thread,
with no thread of ours in between (measured: ``series_feed``). The reader thread
("shmrdv-rpc-series") only drives the call: it looks up the channel and makes the
acks (the receive that opened the series only registers it), asks for the next message
once the table has room, opens the next call, and ends the series. Receives, cancels and
``close`` come from any thread. One lock guards the table and waiters; the ``room``
condition on it holds the reader while the table is full. ``done`` never runs under it,
and nothing under it calls into gRPC.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from .._errors import InternalError, RendezvousError
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback, Received, invoke_done
from .._window import counted_bytes
from . import messages
from .methods import RECV_TENSOR_SERIES_METHOD
from .recv_context import new_request_id
from .recv_errors import PeerWatch, call_error
from .rpc_errors import error_code
from .series_ack import SeriesAcks
from .series_feed import SeriesFeed

__all__ = ["SeriesOwner", "SeriesReader", "Waiter"]

_log = logging.getLogger("shmrdv.rpc.client")

# Re-opening a series after its connection dropped: pauses from 50 ms doubling to 1 s.
_RETRY_INITIAL = 0.05
_RETRY_MAX = 1.0


class SeriesOwner(Protocol):
    """What a series uses of the client that opened it."""

    metadata: Sequence[tuple[str, str]]
    prefetch_bytes: int

    def channel(self, address: str) -> grpc.Channel:
        """The channel to ``address``; ``RendezvousError`` if there can be none."""

    def count(self, received: Received) -> None:
        """A value was received."""

    def deliver(
        self, waiter: Waiter, error: BaseException | None, received: Received | None
    ) -> None:
        """Complete a receive that waited (in this thread or on a callback thread)."""

    def refused(self, address: str, code: grpc.StatusCode) -> None:
        """The producer at ``address`` has no series for us."""

    def fallback(self, step_id: int, key: ParsedKey, done: DoneCallback) -> Canceller:
        """Start a ``RecvTensor`` receive instead."""


class Waiter:
    """A receive waiting on a series (hashed by identity)."""

    __slots__ = ("blocking", "done", "redirect")

    def __init__(self, done: DoneCallback, blocking: bool) -> None:
        self.done = done
        self.blocking = blocking  # done only fills a blocked receiver's slot
        self.redirect: Canceller | None = None  # handed to RecvTensor: its canceller


class SeriesReader:
    """One ``RecvTensorSeries`` call for (step, key), its reader thread and its table."""

    def __init__(self, owner: SeriesOwner, address: str, step_id: int, key: ParsedKey) -> None:
        self._owner = owner
        self.address = address
        self.step_id = step_id
        self.key = key
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._values: collections.deque[Received] = collections.deque()
        self._held = 0  # bytes of the values in the table
        self._partial = 0  # bytes of the value being assembled, as of the last message
        self._peak = 0  # the most ``_held + _partial`` was
        self._waiters: collections.OrderedDict[Waiter, None] = collections.OrderedDict()
        self.ended = False  # no value will come any more
        self._closed = False
        self._parked = False  # the reader waits for a receive to re-open the series
        self._call: Any = None
        # Resumable: the series' own request_id, on every call of it and its acks, and
        # how many values came on it (all calls), which a re-open and an ack say.
        self._id = new_request_id(63) | 1
        self._count = 0
        self._acks: SeriesAcks | None = None  # made by the reader thread (``_connect``)
        self._backoff = _RETRY_INITIAL
        self.thread = threading.Thread(target=self._run, name="shmrdv-rpc-series", daemon=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def held(self) -> tuple[int, int, int]:
        """Bytes this series holds that no receive took (its table, and what came of a
        value still being assembled), the most it held at once, and the values in its
        table."""
        with self._lock:
            return self._held + self._partial, self._peak, len(self._values)

    def where(self) -> str:
        """The series' key, step and producer, for messages."""
        return f"key {self.key.full_key!r} (step {self.step_id}) from {self.address}"

    # -- receives (any thread) ------------------------------------------------------------

    def start_recv(self, done: DoneCallback, blocking: bool) -> Canceller | None:
        """Take the next value (``done`` now), or wait for it; None: the series has
        ended and holds nothing, the receive must go elsewhere."""
        with self._lock:
            if self._values:
                received = self._values.popleft()
                self._held -= counted_bytes(received.value.nbytes)
                self._room.notify()
            elif self.ended:
                return None
            else:
                waiter = Waiter(done, blocking)
                self._waiters[waiter] = None
                if self._parked:
                    self._room.notify()  # a reader waiting for a receive to resume
                return lambda: self._cancel(waiter)
        self._owner.count(received)
        invoke_done(done, None, received)
        return _too_late

    def _cancel(self, waiter: Waiter) -> bool:
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
            self._held = self._partial = 0
            self._room.notify_all()
            acks = self._acks
        if acks is not None:
            acks.close()
        if call is not None:
            call.cancel()
        for waiter in waiters:
            invoke_done(waiter.done, error, None)

    # -- the reader thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            connected = self._connect()
            if connected is not None:
                self._read(*connected)
        except BaseException as e:  # a bug here must not leave a receiver waiting forever
            _log.exception("RecvTensorSeries of %s failed unexpectedly", self.where())
            self._end(InternalError(f"receiving {self.where()} failed: {e!r}"), fallback=False)

    def _connect(self) -> tuple[grpc.Channel, SeriesAcks] | None:
        """The series' channel and acks, made here: the receive that opened the series
        does not wait for them. None: the series is over (closed, or no channel: its
        receives go to ``RecvTensor``, which explains)."""
        try:
            channel = self._owner.channel(self.address)
        except RendezvousError as e:
            self._end(e, fallback=True)
            return None
        acks = SeriesAcks(channel, self._owner.metadata, self._held_request)
        with self._lock:
            if not self._closed:
                self._acks = acks
                return channel, acks
        acks.close()
        return None

    def _read(self, channel: grpc.Channel, acks: SeriesAcks) -> None:
        watch = PeerWatch()
        while True:
            feed = SeriesFeed(self)
            # One callable per call: its deserializer is the call's own ``SeriesFeed``.
            method = channel.unary_stream(RECV_TENSOR_SERIES_METHOD, response_deserializer=feed)
            call = method(self._held_request(), metadata=self._owner.metadata)
            with self._lock:
                closed = self._closed
                self._call = call
                self._partial = 0
            if closed:
                call.cancel()
                return
            try:
                for _ in call:  # each message was delivered by ``feed`` as it came
                    if feed.error is not None:
                        break
                    if feed.asked:
                        feed.asked = False
                        acks.ask()
                    with self._lock:  # the next message is asked for once there is room
                        self._partial = feed.partial
                        self._peak = max(self._peak, self._held + self._partial)
                        while self._full() and not self._closed:
                            self._room.wait()
                        if self._closed:
                            return
            except grpc.RpcError as e:
                if self.closed:
                    return
                if feed.messages:  # it was reached: a drop now is a new one
                    watch.reset()
                    self._backoff = _RETRY_INITIAL
                if not self._failed(e, watch):
                    return
                continue
            if feed.error is not None:
                call.cancel()
                self._end(feed.error, fallback=False)
                return
            if feed.inside_value:
                self._end(
                    InternalError(f"RecvTensorSeries of {self.where()} ended inside a value"),
                    fallback=False,
                )
                return
            with self._lock:  # the producer ended it: the key was idle
                if self._closed or not self._waiters:
                    self.ended = True
                    return
            # A receive waits: open another.

    def _failed(self, e: grpc.RpcError, watch: PeerWatch) -> bool:
        """A call of the series failed: whether to open it again (the connection
        dropped: the producer keeps what it sent until acknowledged, and the re-open
        says what came), else the series is over."""
        code = error_code(e)
        if self._count == 0 and code in (
            grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE,
        ):
            # Nothing came on the series, so the consumer holds none of it: RecvTensor
            # takes over (it retries a peer not up yet, and knows one that is gone).
            if code != grpc.StatusCode.UNAVAILABLE:
                self._owner.refused(self.address, code)
            self._end(call_error(code, e, self.where(), None, receiving=False), True)
            return False
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # A re-open refused (the producer's series bounds): again after a pause; a
            # new series instead would get again what this one holds.
            pause, self._backoff = self._backoff, min(self._backoff * 2, _RETRY_MAX)
            return self._pause(pause) and self._park()
        if code != grpc.StatusCode.UNAVAILABLE:
            self._end(call_error(code, e, self.where(), None, receiving=False), False)
            return False
        gone = watch.gone(e, str(self.key.src), self.where())
        if gone is None:  # dropped: again after a pause, or when a receive comes
            pause, self._backoff = self._backoff, min(self._backoff * 2, _RETRY_MAX)
            return self._pause(watch.pause(pause)) and self._park()
        # The producer went away: the receives waiting fail; the series stays, to be
        # re-opened (with what it holds) by the next receive.
        with self._lock:
            waiters = list(self._waiters)
            self._waiters.clear()
        for waiter in waiters:
            self._owner.deliver(waiter, gone, None)
        if not self._park():
            return False
        watch.reset()
        self._backoff = _RETRY_INITIAL
        return True

    def _park(self) -> bool:
        """Wait until a receive waits on the series (it re-opens the call; the producer
        keeps what it sent meanwhile); whether the series is still open."""
        with self._lock:
            self._parked = True
            while not self._closed and not self._waiters:
                self._room.wait()
            self._parked = False
            return not self._closed

    def _pause(self, pause: float) -> bool:
        """Wait ``pause`` seconds (``close`` ends it); whether the series is still open."""
        deadline = time.monotonic() + pause
        with self._lock:
            while not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._room.wait(left)
            return not self._closed

    def _held_request(self) -> bytes:
        """The request of the series' next call or ack: how many values came on it."""
        return messages.encode_request(self.step_id, self.key.full_key, self._id, held=self._count)

    def _full(self) -> bool:
        """No room for the next message (lock held): the table and what came of a value
        being assembled reach ``prefetch_bytes``. An empty table always has room: a value
        larger than the bound comes whole, and a receive can only take a whole value."""
        held = self._held
        return held > 0 and held + self._partial >= self._owner.prefetch_bytes

    def arrived(self, received: Received) -> None:
        """A value came (the channel's thread, ``SeriesFeed``): to the oldest waiting receive,
        else into the table. Never blocks: the reader waits for room."""
        with self._lock:
            self._count += 1
            if self._closed:
                return
            if self._waiters:
                waiter, _ = self._waiters.popitem(last=False)
            else:
                self._values.append(received)
                self._held += counted_bytes(received.value.nbytes)
                self._peak = max(self._peak, self._held)
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


def _too_late() -> bool:
    return False
