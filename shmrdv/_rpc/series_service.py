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

The values come from ``series_take`` (``SeriesTakes``): one at a time, or as many as
are there; those not written go back to their key through it.

Thread model (docs/threads.md): the handler runs on the server's event loop, and all
the state here lives there (no lock); how a value sent later reaches the loop is
``series_take``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._errors import InvalidArgumentError, RendezvousError, ResourceExhaustedError, code_for_error
from .._keys import DeviceName, ParsedKey
from .._rendezvous import Received
from .._window import counted_bytes
from . import messages, series_wire
from .keycheck import check_served_key
from .methods import SHMRDV_SERVICE
from .parked import ParkedCalls
from .series_retained import Retained, RetainedTable
from .series_take import IdleClock, SeriesTakes, requeue
from .tensor_source import TensorSource

__all__ = ["SeriesLimits", "SeriesService"]

# A resumable series asks its consumer for an ack once it handed out this many bytes
# since the last ask (half the producer's window if that is less), and when it has
# waited ``series_take``'s ask delay for a value with some not acknowledged. An ack
# costs a unary call, ~0.6 ms of CPU on loopback (both ends): every 4 MiB, a 64 KiB
# pipeline spent ~10 us more per value; every 16 MiB, ~2 us.
_ASK_BYTES = 16 << 20


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
        self._retained = RetainedTable(source, functools.partial(requeue, source))
        self._takes = SeriesTakes(source, self._retained)
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
        self._takes.started(address)

    def stop_serving(self, error: RendezvousError) -> None:
        """End every series: a take waiting for a value fails with ``error``."""
        self._takes.stop(error)

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
            self._takes.check_serving()
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
        clock = IdleClock(asyncio.get_running_loop(), self._idle)
        kept: Retained | None = None
        try:
            if req.request_id:
                step_id = req.step_id
                try:
                    kept, delivered = await self._retained.open(
                        req.request_id,
                        step_id,
                        pk,
                        req.held,
                        lambda: self._takes.take_now(step_id, pk),
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
                    received, waited = await self._takes.take(req.step_id, pk, clock, ask, kept)
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
                    batch = self._takes.more(req.step_id, pk, received, room)
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
            if kept is not None:
                self._takes.end(kept)  # after a value on its way went back

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
                requeue(self._source, step_id, pk, received)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: RendezvousError) -> NoReturn:
    await context.abort(code_for_error(error), str(error))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
