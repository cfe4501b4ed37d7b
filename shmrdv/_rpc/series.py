"""RecvTensorSeries, shmrdv's one streaming method: a key received again is pushed.

Between shmrdv workers, a key a consumer takes again and again has its values pushed
as they are sent, over one server-streaming call, instead of a round trip per value.

* Exactly once across dropped connections: a series has its own request_id; the
  producer keeps what it pushed until the consumer says how many values it holds
  (``MarkRecvFinished`` with ``held``, asked for by field 1003). Opened again, a series
  gets what it lacks; released or expired, what it did not hold goes back, in order.
* Bounds (``guard.Limits``): series open, and ``max_pushed_bytes`` ahead of the acks.
* Ends: ``OK`` when idle, the step's error, ``UNAVAILABLE`` when the server stops; an
  idle series ticks every ``TICK`` so that its blocked reader sees its deadline.

``SeriesService``: the producer's end, on the serving loop (no lock). ``SeriesCall``:
the consumer's end, read by one blocked receiver at a time in its own thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from .._errors import (
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import ParsedKey
from .._rendezvous import Received
from .._window import counted_bytes
from .channels import Peer
from .guard import Limits, Parked, out_of_time, refuse
from .messages import ASK, Assembly, decode_request, encode_request, pack, take_ids
from .outbox import Outbox, Sent, Taker

__all__ = ["TICK", "SeriesCall", "SeriesService"]

#: How often an idle series tells its reader it is still there (the core's wait turn).
TICK = 0.2
# A series waiting for a value with values not acknowledged asks for an ack after this
# long (a producer blocked on its window gets room back), and every _ASK_BYTES pushed.
_ASK_DELAY = 0.01
_ASK_BYTES = 16 << 20
# Values sent faster than they are pushed go several to a message, up to this many bytes.
_PACK_BYTES = 1 << 20


class _Pushed(Taker):
    """What one series (by its request_id) pushed and its consumer has not acknowledged."""

    def __init__(self, outbox: Outbox, rid: int, k: tuple[int, str], key: ParsedKey) -> None:
        self.outbox = outbox
        self.rid = rid
        self.k = k
        self.key = key
        self.kept: deque[Sent] = deque()  # pushed, not acknowledged, oldest first
        self.base = 0  # values acknowledged so far
        self.kept_bytes = 0
        self.unasked = 0  # bytes pushed since the last ask
        self.running = False
        self.released = False
        self.got: tuple[Sent | None, BaseException | None] | None = None
        self.woken: asyncio.Future[bool] | None = None
        self.room: asyncio.Event | None = None
        self.expiry: asyncio.TimerHandle | None = None

    def settle(self, sent: Sent | None, error: BaseException | None) -> None:
        if not self.running:  # taken for a call that ended: not pushed, so back it goes
            if sent is not None:
                self.outbox.requeue(sent)
            return
        self.got = (sent, error)
        if self.woken is not None and not self.woken.done():
            self.woken.set_result(True)

    def ack(self, held: int, outbox: Outbox) -> None:
        """The consumer holds the series' first ``held`` values: they are delivered."""
        if held > self.base + len(self.kept):
            raise InvalidArgumentError(
                f"RecvTensorSeries {self.rid}: {held} values held, {self.base + len(self.kept)} sent"
            )
        while self.base < held:
            sent = self.kept.popleft()
            self.kept_bytes -= counted_bytes(sent.encoded.nbytes)
            self.base += 1
            outbox.release(sent)
        if self.room is not None:
            self.room.set()

    def give_back(self, outbox: Outbox) -> None:
        """What the consumer does not hold goes back to its key's head, in order."""
        while self.kept:
            outbox.requeue(self.kept.pop())
        self.kept_bytes = 0


class SeriesService:
    """The producer's end of every series of one server (module docstring)."""

    def __init__(
        self, outbox: Outbox, key_of: Callable[[str], ParsedKey],
        release: Callable[[int], None], limits: Limits,
    ) -> None:  # fmt: skip
        self._outbox = outbox
        self._key_of = key_of
        self._release = release
        self._limits = limits
        window = outbox.max_inflight_bytes
        self._ask_bytes = min(_ASK_BYTES, limits.max_pushed_bytes // 2 or 1)
        if window is not None:
            self._ask_bytes = min(self._ask_bytes, window // 2 or 1)
        self._open = Parked(
            (limits.max_series, limits.max_series_per_peer, limits.max_series_per_connection),
            "series open",
            "max_series",
        )
        self._pushed: dict[int, _Pushed] = {}
        self._stopping: BaseException | None = None
        self._stats = dict.fromkeys(("series", "series_values", "series_refused", "series_asks"), 0)

    def stats(self) -> dict[str, int]:
        return {**self._stats, "series_open": self._open.total, "series_kept": len(self._pushed)}

    async def serve(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """The handler: push (step, key)'s values (the module docstring)."""
        self._stats["series"] += 1
        try:
            if self._stopping is not None:
                raise self._stopping
            req = decode_request(request)
            for rid in req.released:  # given up before this series: back to their keys first
                self._release(rid)
            pk = self._key_of(req.rendezvous_key)
            if not req.request_id:
                raise InvalidArgumentError("RecvTensorSeries needs a request_id")
            k = (req.step_id, pk.full_key)
            state = self._pushed.get(req.request_id)
            if state is None:
                state = _Pushed(self._outbox, req.request_id, k, pk)
                state.base = max(req.held, 0)  # a series that ended idle goes on from there
            elif state.running or state.k != k:
                raise InvalidArgumentError(f"RecvTensorSeries {req.request_id} is open already")
            state.ack(req.held, self._outbox)
            peer = context.peer()
            why = self._open.refusal(peer)
            if why is not None:
                self._stats["series_refused"] += 1
                raise ResourceExhaustedError(f"RecvTensorSeries on {self._outbox.task}: {why}")
        except RendezvousError as e:
            await refuse(context, e)
        self._pushed[state.rid] = state
        if state.expiry is not None:
            state.expiry.cancel()
        state.running, state.room = True, asyncio.Event()
        self._open.add(peer, 1)
        try:
            for sent in list(state.kept):  # what a consumer that re-opened lacks
                for chunk in sent.encoded.chunks:
                    yield chunk
            async for message in self._push(state, context):
                yield message
        finally:
            state.running = False
            self._open.add(peer, -1)
            self._outbox.cancel(state.k[0], state.key, state)  # a value on its way goes back
            if state.got is not None:
                taken, _ = state.got
                state.got = None
                if taken is not None:
                    self._outbox.requeue(taken)
            self._ended(state)

    async def _push(
        self, state: _Pushed, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        idle = 0.0
        while not state.released:
            assert state.room is not None
            if state.kept and state.kept_bytes >= self._limits.max_pushed_bytes:
                state.room.clear()  # kept to the bound: more once the consumer holds some
                if state.unasked:
                    yield self._ask(state)
                await state.room.wait()
                continue
            try:
                sent = self._take(state)
                if sent is None:
                    asking = bool(state.unasked and state.kept)
                    if not await self._wait(state, loop, _ASK_DELAY if asking else TICK):
                        if _released(state):
                            return
                        if asking:
                            yield self._ask(state)
                            continue
                        idle += TICK
                        if idle >= self._limits.series_idle and not state.kept:
                            return  # idle: the consumer opens another series when it waits
                        yield b""  # a tick
                        continue
                    sent = self._settled(state)
            except RendezvousError as e:
                await refuse(context, e)
            idle = 0.0
            batch = self._batch(state, sent)
            for value in batch:
                state.kept.append(value)
                counted = counted_bytes(value.encoded.nbytes)  # an empty value costs too
                state.kept_bytes += counted
                state.unasked += counted
            self._stats["series_values"] += len(batch)
            if len(batch) > 1:
                yield pack([value.encoded.chunks[0] for value in batch])
            else:
                for chunk in sent.encoded.chunks:
                    yield chunk
            if state.unasked >= self._ask_bytes:
                yield self._ask(state)

    def _batch(self, state: _Pushed, sent: Sent) -> list[Sent]:
        """``sent``, and the whole values queued behind it that one message can carry."""
        batch = [sent]
        if len(sent.encoded.chunks) > 1:
            return batch
        size, counted = len(sent.encoded.chunks[0]), counted_bytes(sent.encoded.nbytes)
        while size < _PACK_BYTES and state.kept_bytes + counted < self._limits.max_pushed_bytes:
            try:
                following = self._outbox.take(state.k[0], state.key, None)
            except RendezvousError:
                break  # the next take fails the series
            if following is None:
                break
            if len(following.encoded.chunks) > 1:
                state.got = (following, None)  # a large value goes next, in its chunks
                break
            batch.append(following)
            size += len(following.encoded.chunks[0])
            counted += counted_bytes(following.encoded.nbytes)
        return batch

    def _take(self, state: _Pushed) -> Sent | None:
        if state.got is not None:
            return self._settled(state)
        return self._outbox.take(state.k[0], state.key, state)

    def _settled(self, state: _Pushed) -> Sent:
        assert state.got is not None
        (sent, error), state.got = state.got, None
        if error is not None:
            raise error if isinstance(error, RendezvousError) else UnavailableError(repr(error))
        assert sent is not None
        return sent

    async def _wait(self, state: _Pushed, loop: asyncio.AbstractEventLoop, timeout: float) -> bool:
        """Wait for the value ``take`` parked for: True once it (or the error) is there;
        False after ``timeout`` (unparked) or once the series was released."""
        timer = None
        while state.got is None and not state.released:
            woken = state.woken = loop.create_future()
            if timer is None:
                timer = loop.call_later(timeout, out_of_time, woken)
            try:
                settled = await woken
            finally:
                state.woken = None
            if settled or state.got is not None or state.released:
                break
            if self._outbox.cancel(state.k[0], state.key, state):
                timer.cancel()
                return False
            # Too late to unpark: the value is on its way; settle() comes next.
        if timer is not None:
            timer.cancel()
        return state.got is not None

    def _ask(self, state: _Pushed) -> bytes:
        state.unasked = 0
        self._stats["series_asks"] += 1
        return ASK

    def _ended(self, state: _Pushed) -> None:
        """A series' call ended: its state waits for the consumer to come back, release or
        acknowledge it, or for ``cache_ttl``."""
        if state.released:
            return
        if not state.kept and state.got is None:
            self._pushed.pop(state.rid, None)
            return
        loop = asyncio.get_running_loop()
        state.expiry = loop.call_later(self._limits.cache_ttl, self._expire, state)

    def _expire(self, state: _Pushed) -> None:
        if not state.running and self._pushed.get(state.rid) is state:
            self._drop(state)

    def _drop(self, state: _Pushed) -> None:
        """The series is over: what its consumer does not hold goes back to its key."""
        self._pushed.pop(state.rid, None)
        state.released = True
        if state.got is not None:
            sent, _ = state.got
            state.got = None
            if sent is not None:
                state.kept.append(sent)
        state.give_back(self._outbox)
        if state.woken is not None and not state.woken.done():
            state.woken.set_result(False)
        if state.room is not None:
            state.room.set()

    def finished(self, rid: int, released: bool, held: int) -> bool:
        """``MarkRecvFinished`` of series ``rid`` (False: ``rid`` names no series): its
        consumer holds ``held`` values; ``released``: it left the series."""
        state = self._pushed.get(rid)
        if state is None:
            return False
        state.ack(held, self._outbox)
        if released:
            if state.running:
                self._outbox.cancel(state.k[0], state.key, state)
            self._drop(state)
        return True

    def stop(self, error: BaseException) -> None:
        """The server stops: every series ends with ``error``."""
        self._stopping = error
        for state in list(self._pushed.values()):
            if state.running and self._outbox.cancel(state.k[0], state.key, state):
                state.settle(None, error)


def _released(state: _Pushed) -> bool:
    return state.released  # read again after an await (a release may have come)


# -- the consumer's end ---------------------------------------------------------------------


class SeriesCall:
    """The consumer's end of one series of (step, key): its call, opened again as needed
    under its request_id, and the count of values read (``held``). ``read`` runs in one
    blocked receiver's thread at a time, the ``reader`` (set under the caller's lock, as
    is ``flush``, its timer of a late ack); ``cancel`` and ``release`` in any thread.
    """

    def __init__(self, peer: Peer, step_id: int, key: str, rid: int) -> None:
        self.peer = peer
        self.reader: Any = None
        self.flush: Any = None
        self._step_id = step_id
        self._key = key
        self.rid = rid
        self.held = 0
        self.acked = 0  # of ``held``, what the producer was told
        self.values = 0  # read into the current call (0: nothing came on it yet)
        self._call: Any = None
        self._assembly = Assembly()

    def read(self) -> list[Received]:
        """The next values, reading the series (one, or those a message packed; blocks up
        to ``TICK`` while it is idle); none after a tick or when the call ended well (it
        is opened again next time). Raises ``grpc.RpcError`` when the call fails (it is
        opened again next time) and ``InvalidArgumentError`` for bytes that do not parse."""
        call = self._call
        if call is None:
            released = take_ids(self.peer.releases)  # given up before: back to their keys
            request = encode_request(
                self._step_id, self._key, self.rid, held=self.held, released=released
            )
            call = self._call = self.peer.series(request, metadata=self.peer.metadata)
            self.values = 0
        while True:
            try:
                message = next(call)
            except StopIteration:
                self._call = None
                return []
            except grpc.RpcError:
                self._call = None
                self._assembly = Assembly()
                raise
            if not message:
                return []
            got = self._assembly.feed(message, owned=True)
            if got is not None or self._assembly.packed:
                values = [got] if got is not None else self._unpack(self._assembly.packed)
                self.held += len(values)
                self.values += len(values)
                self._assembly = Assembly()
                return values
            if self._assembly.ask:
                self.ack()

    @staticmethod
    def _unpack(parts: list[memoryview]) -> list[Received]:
        values = []
        for part in parts:
            got = Assembly().feed(part)
            if got is None:
                raise InvalidArgumentError("a packed response is not a whole value")
            values.append(got)
        return values

    def ack(self) -> None:
        """Tell the producer what this consumer holds (it counts no more in its window)."""
        if self.held > self.acked:
            self.acked = self.held
            self.peer.finished(self.rid, held=self.held)

    def cancel(self) -> None:
        """End the call (a reader blocked on it returns with ``CANCELLED``)."""
        call = self._call
        if call is not None:
            call.cancel()

    def release(self) -> Any:
        """Leave the series: the producer gives back what was not read, in order. The
        ``MarkRecvFinished`` call's future (None: the channel is closed)."""
        self.cancel()
        self.acked = self.held
        return self.peer.finished(self.rid, released=True, held=self.held)
