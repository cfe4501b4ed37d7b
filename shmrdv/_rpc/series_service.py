"""RecvTensorSeries, the producer's side: every value of one key, pushed as it is sent.

A consumer that receives one key again and again (a channel: a pipeline of tensors)
would otherwise make one ``RecvTensor`` per value, and wait a round trip for each: the
values must reach it before it asks. Between two shmrdv workers it then opens one
server-streaming ``RecvTensorSeries`` call for that (step, key) (``series_client``); the
handler here takes the key's values from the ``TensorSource`` in order, as they are
sent, and writes each as the ``TensorChunk`` messages of ``RecvTensorStream`` (a header
with the first data, then chunks of at most ``chunk_bytes``), back to back.

* **Flow control** is HTTP/2's: a write returns once gRPC has taken the message within
  the stream's window, so a consumer that stops reading stops the handler. A value is
  taken from the source only once the previous one is written.
* **The window** (``max_inflight_bytes``): a value counts until its last chunk is
  written (``TensorSource.done_with``), not when it is taken: a consumer that opens a
  series and never reads holds the window, not this process's memory (issue 19 §4).
  A value whose writing did not finish (the consumer went away, the server stops) goes
  back to the head of its key (``TensorSource.requeue``): a receive that comes later,
  by either method, gets it.
* **Resumable** (a request with a ``request_id``, as shmrdv's consumers send): each
  value counts until the consumer acknowledges it (``RecvTensorSeriesAck``, which the
  series asks for with ``series_wire.ASK`` every ``_ASK_BYTES`` or half the window, and
  after ``_ASK_DELAY`` of waiting for a value), and the series takes no more while it
  keeps ``max_retained_bytes`` (``SeriesLimits``); when its call ends, every value not
  acknowledged goes back to the head of its key, and a re-open of the series (after a
  dropped connection) skips those its consumer says it holds (``series_retained``).
  Nothing sent is lost with a connection; ``series_values`` counts what was
  acknowledged.
* **Ends**: with ``OK`` once the key had no value for ``idle`` seconds (the consumer
  opens a new series when it waits again); with the source's error (an aborted or
  cleaned-up step: ``ABORTED``, a closed worker: ``UNAVAILABLE``); with ``UNAVAILABLE``
  when the server stops.
* **Bounds** (a hostile client, issue 19 §4): series open at once are counted in all,
  per peer host and per connection (``ParkedCalls``); beyond them ``RESOURCE_EXHAUSTED``
  and the client uses ``RecvTensor``. The token, the request gate and the call and
  connection caps of ``RpcServer`` hold as for every method. The key is checked as
  ``RecvTensor`` checks it (``keycheck``).

The figures that keep this method (faster than ``RecvTensor`` per value, in the same
run) are in ``series_client``'s docstring.

Thread model (docs/threads.md): the handler runs on the server's event loop, and all
the state here lives there (no lock). A value already there is taken in the loop with
no hop; one sent later is handed over by the producer's ``send`` thread with
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._devices import DeviceName
from .._errors import (
    InternalError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import ParsedKey
from .._rendezvous import Received
from .._status import code_for_error
from .._window import counted_bytes
from . import messages, series_wire
from .keycheck import check_served_key
from .methods import SERVER_STOPPING, SHMRDV_SERVICE
from .parked import ParkedCalls
from .series_retained import Retained, RetainedTable
from .tensor_source import TensorSource

__all__ = ["SeriesLimits", "SeriesService"]

_log = logging.getLogger("shmrdv.rpc.server")

# What a take settles with: (error, value).
_Outcome = tuple[BaseException | None, Received | None]
# A resumable series asks its consumer for an ack once it handed out this many bytes
# since the last ask (half the producer's window if that is less), and when it has
# waited this long for a value with some not acknowledged (a producer held by its window
# waits for the ack). An ack costs a unary call, ~0.6 ms of CPU on loopback (both ends):
# every 4 MiB, a 64 KiB pipeline spent ~10 us more per value; every 16 MiB, ~2 us.
_ASK_BYTES = 16 << 20
_ASK_DELAY = 0.005


@dataclasses.dataclass(frozen=True)
class SeriesLimits:
    """How long an idle series lives, and how many may be open: in all, from one peer
    host and on one connection (beyond: ``RESOURCE_EXHAUSTED``, and the client uses
    ``RecvTensor``); how many bytes of values not acknowledged a resumable series keeps
    before it takes no more (without a window, the bound of what it keeps; a value
    larger goes alone). Bad values raise ``InvalidArgumentError`` naming them."""

    idle: float = 10.0
    max_series: int = 4096
    max_series_per_peer: int = 1024
    max_series_per_connection: int = 256
    max_retained_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        idle = self.idle
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0 < idle < 1e6:
            raise InvalidArgumentError(f"series idle must be seconds > 0, not {idle!r}")
        for name in (
            "max_series",
            "max_series_per_peer",
            "max_series_per_connection",
            "max_retained_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")


class SeriesService:
    """The ``RecvTensorSeries`` handler of one server, serving values of ``source``.

    ``handler()`` is registered on the gRPC server; ``started`` is called in the loop
    before the first call; ``stop_serving`` ends every series (loop thread).
    """

    def __init__(
        self,
        source: TensorSource,
        task: DeviceName,
        *,
        chunk_bytes: int,
        limits: SeriesLimits,
    ) -> None:
        self._source = source
        self._task = task
        self._chunk_bytes = chunk_bytes
        self._idle = float(limits.idle)
        self._retain = limits.max_retained_bytes
        window = source.max_inflight_bytes
        self._ask_bytes = _ASK_BYTES if window is None else min(_ASK_BYTES, window // 2)
        self._open = ParkedCalls(
            limits.max_series,
            limits.max_series_per_peer,
            limits.max_series_per_connection,
            what="series open",
            option="max_series",
        )
        self._address = "(not started)"
        self._loop_thread = -1
        self._stopping = False
        # Takes waiting for a value, with their cancellers (stop_serving fails them).
        self._waiting: dict[asyncio.Future[_Outcome], Callable[[], bool]] = {}
        self._retained = RetainedTable(source, self._requeue)
        self._stats = {
            "series": 0,
            "series_values": 0,
            "series_bytes": 0,
            "series_refused": 0,
            "series_asks": 0,
        }

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SHMRDV_SERVICE,
            {
                "RecvTensorSeries": grpc.unary_stream_rpc_method_handler(self._series),
                "RecvTensorSeriesAck": grpc.unary_unary_rpc_method_handler(self._ack),
            },
        )

    def started(self, address: str) -> None:
        """The server listens on ``address`` (called in the loop)."""
        self._address = address
        self._loop_thread = threading.get_ident()

    def stop_serving(self, error: RendezvousError) -> None:
        """End every series: a take waiting for a value fails with ``error``."""
        self._stopping = True
        for fut, cancel in list(self._waiting.items()):
            if cancel() and not fut.done():
                fut.set_result((error, None))

    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        out["series_open"] = self._open.total
        out["series_retained"] = len(self._retained)
        out["series_resumed"] = self._retained.resumed
        out["series_acks"] = self._retained.acks
        return out

    # -- the handler (event loop) ----------------------------------------------------------

    async def _series(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        self._stats["series"] += 1
        try:
            if self._stopping:
                raise UnavailableError(f"shmrdv RPC server {self._address} {SERVER_STOPPING}")
            req = messages.decode_request(request)
            pk = check_served_key(
                req.rendezvous_key, self._task, self._source.task, self._source.incarnation
            )
            peer = context.peer()
            why = self._open.refusal(peer)
            if why is not None:
                self._stats["series_refused"] += 1
                raise ResourceExhaustedError(
                    f"RecvTensorSeries on {self._source.task}: {why}; key {pk.full_key!r}"
                )
        except RendezvousError as e:
            await _abort(context, e)
        self._open.add(peer, 1)
        clock = _IdleClock(asyncio.get_running_loop(), self._idle)
        kept: Retained | None = None
        try:
            if req.request_id:
                step_id = req.step_id
                try:
                    kept, delivered = await self._retained.open(
                        req.request_id, step_id, pk, req.held, lambda: self._take_now(step_id, pk)
                    )
                except RendezvousError as e:
                    await _abort(context, e)
                self._delivered(step_id, pk, delivered)
            while True:
                if kept is not None:
                    # Kept to the bound: more only once the consumer acknowledged some.
                    while kept.nbytes >= self._retain:
                        kept.room.clear()  # before the yield: an ack may come meanwhile
                        if kept.asked < kept.sent:
                            yield self._ask(kept)
                            continue
                        await kept.room.wait()
                ask = kept is not None and kept.asked < kept.sent
                try:
                    received, waited = await self._take(req.step_id, pk, clock, ask, kept)
                except RendezvousError as e:
                    await _abort(context, e)
                if received is None:
                    if kept is not None and (not waited or kept.values):
                        # Waited _ASK_DELAY, or idle with values not acknowledged: ask
                        # (the series ends idle only once the consumer has them all).
                        if kept.values:
                            yield self._ask(kept)
                        continue
                    return  # idle: the consumer opens another series when it waits again
                # A value waited for came to an empty key: it goes at once, alone (no look
                # for a second one, which would find none but what was sent meanwhile,
                # and that goes in the next message).
                if waited:
                    batch = [received]
                else:  # at most a message's worth, and what the series may keep
                    room = self._chunk_bytes
                    if kept is not None:
                        room = min(room, self._retain - kept.nbytes)
                    batch = self._more(req.step_id, pk, received, room)
                if kept is not None:
                    kept.add(batch)
                # Closed here, not when collected: what it did not write goes back now.
                async with contextlib.aclosing(
                    self._write(context, req.step_id, pk, batch, kept)
                ) as chunks:
                    async for chunk in chunks:
                        yield chunk
                if kept is not None and kept.unasked >= self._ask_bytes:
                    yield self._ask(kept)
        finally:
            clock.close()
            self._open.add(peer, -1)
            if kept is not None and kept.late:
                kept.ending = True  # a value on its way goes back first (_settle)
            elif kept is not None:
                self._retained.end(kept)

    def _ask(self, kept: Retained) -> bytes:
        """The message that asks ``kept``'s consumer to acknowledge what it holds."""
        kept.asking()
        self._stats["series_asks"] += 1
        return series_wire.ASK

    async def _ack(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """``RecvTensorSeriesAck``: the consumer holds ``held`` values of its series."""
        try:
            req = messages.decode_request(request)
            pk = check_served_key(
                req.rendezvous_key, self._task, self._source.task, self._source.incarnation
            )
            delivered = self._retained.ack(req.request_id, req.step_id, pk, req.held)
        except RendezvousError as e:
            await _abort(context, e)
        self._delivered(req.step_id, pk, delivered)
        return b""

    def _delivered(self, step_id: int, pk: ParsedKey, values: list[Received]) -> None:
        """A resumable series' consumer holds ``values``: counted, and out of the window
        (counted first: sent minus delivered never reads more than the window holds)."""
        if values:
            self._stats["series_values"] += len(values)
            self._stats["series_bytes"] += sum(r.value.nbytes for r in values)
            self._source.done_with(step_id, pk, sum(counted_bytes(r.value.nbytes) for r in values))

    def _more(self, step_id: int, pk: ParsedKey, first: Received, room: int) -> list[Received]:
        """``first`` and the values of ``pk`` already there, up to about ``room`` bytes."""
        batch = [first]
        size = counted_bytes(first.value.nbytes)
        while size < room:
            received = self._take_now(step_id, pk)
            if received is None:
                break
            batch.append(received)
            size += counted_bytes(received.value.nbytes)
        return batch

    def _take_now(self, step_id: int, pk: ParsedKey) -> Received | None:
        """The next value of ``pk`` if it is there now; else (or on an error, which the
        next ``_take`` raises) None, and nothing waits for one."""
        got: list[_Outcome] = []
        taking = [True]
        loop = asyncio.get_running_loop()

        def done(error: BaseException | None, received: Received | None) -> None:
            if taking[0]:
                got.append((error, received))
                return
            # Sent just as the take gave up (another thread): back to the key's head.
            try:
                loop.call_soon_threadsafe(self._late, step_id, pk, received)
            except RuntimeError:
                pass

        try:
            cancel = self._source.serve_recv(step_id, pk, done)
        except RendezvousError:
            return None
        finally:
            taking[0] = False
        if not got:
            cancel()
            return None
        error, received = got[0]
        return None if error is not None else received

    def _late(self, step_id: int, pk: ParsedKey, received: Received | None) -> None:
        if received is not None:
            self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))
            self._requeue(step_id, pk, received)

    async def _write(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        step_id: int,
        pk: ParsedKey,
        batch: list[Received],
        kept: Retained | None,
    ) -> AsyncGenerator[bytes, None]:
        """``batch`` as series messages. A value whose last chunk gRPC took is
        delivered (the window counts it no more); the rest, if the writing stops (the
        consumer went away, the server stops), go back to their key's head, in order.
        A resumable series' values are ``kept``'s instead, until acknowledged."""
        try:
            messages_out = series_wire.encode_series(batch, self._chunk_bytes)
        except RendezvousError as e:  # not sendable: dropped, never requeued
            if kept is not None:
                kept.drop_last(len(batch))
            for received in batch:
                self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))
            await _abort(context, e)
        if kept is not None:  # counted when acknowledged
            for message, _ in messages_out:
                yield message
            return
        sent = 0
        try:
            for message, completed in messages_out:
                yield message  # returns once gRPC has taken it (flow control)
                if completed:
                    done = batch[sent : sent + completed]
                    # Counted before the window lets another send in: sent minus written
                    # never reads more than the window holds (what tests measure).
                    self._stats["series_values"] += completed
                    self._stats["series_bytes"] += sum(r.value.nbytes for r in done)
                    # Once per message.
                    self._source.done_with(
                        step_id, pk, sum(counted_bytes(r.value.nbytes) for r in done)
                    )
                sent += completed
        finally:
            for received in reversed(batch[sent:]):
                self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))
                self._requeue(step_id, pk, received)

    def _requeue(self, step_id: int, pk: ParsedKey, received: Received) -> None:
        try:
            self._source.requeue(step_id, pk, received)
        except Exception:
            _log.exception("TensorSource.requeue failed for key %r", pk.full_key)

    async def _take(
        self,
        step_id: int,
        pk: ParsedKey,
        clock: _IdleClock,
        ask: bool = False,
        kept: Retained | None = None,
    ) -> tuple[Received | None, bool]:
        """The next value of ``pk``: at once when it is there, else when it is sent;
        None after ``idle`` seconds without one (``clock``, the series'). Also whether
        it was waited for. With ``ask``: (None, False) after ``_ASK_DELAY`` without one.
        Raises the source's error."""
        if self._stopping:
            raise UnavailableError(f"shmrdv RPC server {self._address} {SERVER_STOPPING}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_Outcome] = loop.create_future()
        loop_thread = self._loop_thread
        landed = [False]  # _settle ran for the value (or error) this take got

        def done(error: BaseException | None, received: Received | None) -> None:
            # In the loop when the value is already there; else the producer's thread.
            if threading.get_ident() == loop_thread:
                self._settle(fut, step_id, pk, error, received, kept, landed)
                return
            try:
                loop.call_soon_threadsafe(
                    self._settle, fut, step_id, pk, error, received, kept, landed
                )
            except RuntimeError:  # the loop is gone: the server stopped
                if received is not None:
                    self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))

        try:
            cancel = self._source.serve_recv(step_id, pk, done)
        except RendezvousError:
            raise
        except Exception as e:  # a bug in the source must still end the call
            _log.exception("TensorSource.serve_recv failed for key %r", pk.full_key)
            raise InternalError(f"TensorSource of {self._source.task} failed: {e!r}") from e
        waited = not fut.done()
        if waited:
            self._waiting[fut] = cancel
            idle = [False]
            asked = [False]

            def expire() -> None:
                # cancel() False: the value is on its way, and settles ``fut``.
                if not fut.done() and cancel():
                    idle[0] = True
                    fut.set_result((None, None))

            def ask_now() -> None:
                if not fut.done() and cancel():
                    asked[0] = True
                    fut.set_result((None, None))

            # The future itself and the series' one timer: no timer made and cancelled
            # per value (nor ``asyncio.wait``'s waiter future, set and callbacks); one
            # more only to ask for an ack.
            clock.start(expire)
            asking = loop.call_later(_ASK_DELAY, ask_now) if ask else None
            try:
                await fut
                if idle[0]:
                    return None, True
                if asked[0]:
                    return None, False
            except asyncio.CancelledError:
                # The consumer went away: a value taken for it goes back to its key.
                removed = cancel()
                if not removed and not landed[0] and kept is not None:
                    # On its way from the sender's thread: it goes back to the key in
                    # _settle, before what the series kept (taken earlier) goes.
                    kept.late += 1
                if not fut.done():
                    fut.cancel()  # one still on its way goes back in _settle
                elif not fut.cancelled():  # (the task's cancel cancels what it awaits)
                    self._settle(fut, step_id, pk, *fut.result())
                raise
            finally:
                clock.stop()
                if asking is not None:
                    asking.cancel()
                self._waiting.pop(fut, None)
        error, received = fut.result()
        if error is not None:
            if isinstance(error, RendezvousError):
                raise error
            raise InternalError(f"TensorSource.serve_recv failed: {error!r}")
        if received is None:
            raise InternalError("TensorSource called done(None, None)")
        return received, waited

    def _settle(
        self,
        fut: asyncio.Future[_Outcome],
        step_id: int,
        pk: ParsedKey,
        error: BaseException | None,
        received: Received | None,
        kept: Retained | None = None,
        landed: list[bool] | None = None,
    ) -> None:
        if landed is not None:
            landed[0] = True
        if not fut.done():
            fut.set_result((error, received))
            return
        if received is not None:
            # Nobody takes it any more (the consumer went away, the server stopped).
            self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))
            self._requeue(step_id, pk, received)
        if kept is not None and fut.cancelled() and kept.late:
            # Back at the key's head: now what the series kept goes before it.
            kept.late -= 1
            if not kept.late and kept.ending:
                kept.ending = False
                self._retained.end(kept)


class _IdleClock:
    """The idle end of one series: one timer for all its takes, not one per take.

    A take that waits calls ``start`` with its ``expire``, and ``stop`` when it has
    its value (or ends); ``expire`` runs once the take has waited ``idle`` seconds. The
    timer set for an earlier wait, when it fires, sets itself again for the wait then in
    progress, if any; with none, the next ``start`` sets one. Loop thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float) -> None:
        self._loop = loop
        self._idle = idle
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0
        self._expire: Callable[[], None] | None = None

    def start(self, expire: Callable[[], None]) -> None:
        self._since = self._loop.time()
        self._expire = expire
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._idle, self._fire)

    def stop(self) -> None:
        self._expire = None

    def close(self) -> None:
        """The series ended: no timer left behind (it would hold the series for
        ``idle`` seconds)."""
        self._expire = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        expire = self._expire
        if expire is None:
            return
        due = self._since + self._idle
        if self._loop.time() >= due:
            self._expire = None
            expire()
        else:
            self._timer = self._loop.call_at(due, self._fire)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: RendezvousError) -> NoReturn:
    await context.abort(code_for_error(error), str(error))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
