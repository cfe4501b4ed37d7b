"""RequestGate: a call must send its request message soon after it opens, or it is dropped.

grpc.aio reads a unary call's request message before anything of ours runs, and waits
for it with no deadline of its own. A client that opens calls and never sends their
message holds each one (its task and its core call, some 18 KB) for as long as its
connection lives, token or no token: the token check is a handler, and no handler runs
before the message (issue 19 §4: 55,000 such calls took a server from 50 MB to 1.06 GB,
and 1,100 connections carrying them held it at its descriptor limit).

The gate is a server interceptor that gives every (async) handler the request-streaming
shape, so that it runs as soon as the call's headers arrive, and reads the first message
itself:

* a call whose first message has not arrived ``timeout`` seconds after its headers is
  refused with ``UNAVAILABLE`` (a client that was merely slow may call again);
* at most ``max_waiting`` calls may wait longer than ``_GRACE`` (a second) for their
  first message: beyond them, the oldest are dropped (``UNAVAILABLE`` too) as soon as
  they pass it. A real call's message arrives with its headers and is read once the
  calls that arrived with it have started, well within the grace even in a burst of
  thousands, so only silent calls are ever dropped; they hold at most ``max_waiting``
  call slots, plus those that arrived in the last second.

Then the original handler runs with that message, as gRPC would have run it. Only
coroutine and async-generator handlers can be gated (every handler of
``service.RecvService`` is one); any other handler is passed through unchanged.

Thread model (``docs/threads.md``): everything here runs on the server's event loop; one
timer, at the oldest waiting call's next limit, is all the gate schedules.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

__all__ = ["RequestGate"]

# A gated handler's shape is a function of its original's; the service has a handful of
# methods, so wrappers are made once per method, never per call.
_MAX_CACHED_HANDLERS = 64
# How long a call may wait for its first message before it counts as silent when too
# many wait. A burst of calls is started one by one by the server's event loop before
# their (already arrived) messages are read: 2,000 at once take ~0.2 s on loopback.
_GRACE = 1.0


class _Waiting:
    """One call waiting for its first request message."""

    __slots__ = ("crowded_at", "deadline", "task", "why")

    def __init__(self, task: asyncio.Task[Any], now: float, timeout: float) -> None:
        self.task = task
        self.deadline = now + timeout  # dropped as silent from then on
        self.crowded_at = now + min(_GRACE, timeout)  # dropped from then on if too many wait
        self.why: str | None = None  # set when the gate drops the call


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


async def _then(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first``, then the rest of a request stream."""
    yield first
    async for message in rest:
        yield message


class RequestGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Drop calls that send no request message within ``timeout`` s, and the oldest of
    those waiting longer than a second beyond ``max_waiting`` (see the module docstring)."""

    def __init__(self, timeout: float, max_waiting: int) -> None:
        self._timeout = timeout
        self._max_waiting = max_waiting
        self._where = "(starting)"
        self._waiting: OrderedDict[_Waiting, None] = OrderedDict()  # oldest first
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gated: dict[Any, grpc.RpcMethodHandler] = {}
        self._silent = 0  # calls dropped at their deadline
        self._crowded = 0  # calls dropped as the oldest of too many waiting over a second

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        gated = self._gated.get(handler)
        if gated is None:
            gated = self._gate(handler)
            if len(self._gated) < _MAX_CACHED_HANDLERS:
                self._gated[handler] = gated
        return gated

    def started(self, address: str) -> None:
        """The server listens on ``address`` (named in the refusals); called in the loop."""
        self._where = address
        self._loop = asyncio.get_running_loop()

    def stats(self) -> dict[str, int]:
        """``awaiting_request`` (calls waiting for their first message now), and the calls
        dropped so far: ``silent_calls_dropped`` (deadline), ``crowded_calls_dropped``
        (the oldest beyond ``max_waiting``, once waiting over a second)."""
        return {
            "awaiting_request": len(self._waiting),
            "silent_calls_dropped": self._silent,
            "crowded_calls_dropped": self._crowded,
        }

    def close(self) -> None:
        """Stop the timer (the server stops; its calls end with it). Loop thread only."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the handler shapes --------------------------------------------------------------

    def _gate(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize, serialize = handler.request_deserializer, handler.response_serializer
        first = self._first_message
        if handler.request_streaming:
            behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not _is_async(behavior):
            return handler
        streams_in = handler.request_streaming

        def request_of(message: Any, requests: AsyncIterator[Any]) -> Any:
            if not streams_in:
                return message
            if message is grpc.aio.EOF:
                return requests  # ended at once: the handler sees an empty stream
            return _then(message, requests)

        if not handler.response_streaming:

            async def unary_out(requests: AsyncIterator[Any], context: Any) -> Any:
                message = await first(context, streams_in)
                return await behavior(request_of(message, requests), context)

            return grpc.stream_unary_rpc_method_handler(unary_out, deserialize, serialize)

        if inspect.isasyncgenfunction(behavior):

            async def stream_out(requests: AsyncIterator[Any], context: Any) -> Any:
                message = await first(context, streams_in)
                async with contextlib.aclosing(
                    behavior(request_of(message, requests), context)
                ) as responses:
                    async for response in responses:
                        yield response

            return grpc.stream_stream_rpc_method_handler(stream_out, deserialize, serialize)

        async def writer_out(requests: AsyncIterator[Any], context: Any) -> None:
            message = await first(context, streams_in)
            await behavior(request_of(message, requests), context)

        return grpc.stream_stream_rpc_method_handler(writer_out, deserialize, serialize)

    # -- the deadline ----------------------------------------------------------------------

    async def _first_message(
        self, context: grpc.aio.ServicerContext[Any, Any], eof_ok: bool
    ) -> Any:
        """The call's first request message (``EOF`` only when ``eof_ok``), read under the
        gate's deadline; a dropped call is answered ``UNAVAILABLE`` here (abort raises)."""
        # The loop is the one ``started`` ran in: asking asyncio for it costs a getpid.
        loop = self._loop
        assert loop is not None
        task = asyncio.current_task(loop)
        assert task is not None  # a handler always runs in its call's task
        entry = _Waiting(task, loop.time(), self._timeout)
        self._waiting[entry] = None
        if self._timer is None:
            self._arm(loop)
        elif len(self._waiting) > self._max_waiting:
            self._sweep(loop)  # too many wait: drop the old silent ones now, re-arm
        try:
            message = await context.read()
        except asyncio.CancelledError:
            if entry.why is None:
                raise  # the client went away, or the server stops
            if hasattr(task, "uncancel"):  # Python >= 3.11 counts cancellations
                task.uncancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, entry.why)
            raise  # pragma: no cover - abort raises
        finally:
            self._waiting.pop(entry, None)
        if message is grpc.aio.EOF and not eof_ok:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shmrdv RPC server {self._where}: the call ended without a request message",
            )
        return message

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Set the one timer at the oldest waiting call's next limit (none if none wait)."""
        if not self._waiting:
            return
        oldest = next(iter(self._waiting))
        when = oldest.deadline
        if len(self._waiting) > self._max_waiting:
            when = min(when, oldest.crowded_at)
        timer = self._timer
        if timer is not None:
            if timer.when() <= when:
                return  # it fires first; its sweep re-arms
            timer.cancel()
        self._timer = loop.call_at(when, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._sweep(loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drop the calls past their deadline, and the oldest past the grace while more
        than ``max_waiting`` wait; then re-arm. Calls wait in arrival order, so both are
        at the front."""
        now = loop.time()
        while self._waiting:
            oldest = next(iter(self._waiting))
            if oldest.deadline <= now:
                self._silent += 1
                why = (
                    f"shmrdv RPC server {self._where}: no request message within "
                    f"{self._timeout:g}s of the call's start (first_message_timeout); dropped"
                )
            elif len(self._waiting) > self._max_waiting and oldest.crowded_at <= now:
                self._crowded += 1
                why = (
                    f"shmrdv RPC server {self._where}: more than {self._max_waiting} calls "
                    f"were waiting for their request message, this one for over "
                    f"{min(_GRACE, self._timeout):g}s; dropped"
                )
            else:
                break
            del self._waiting[oldest]
            self._drop(oldest, why)
        self._arm(loop)

    @staticmethod
    def _drop(entry: _Waiting, why: str) -> None:
        entry.why = why
        entry.task.cancel()
