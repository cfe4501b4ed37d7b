"""The gRPC methods' handlers: each answers a call from the values ``waits`` gives it.

A consumer on another host pulls a value: it calls ``RecvTensor`` (TensorFlow's unary
method, TF-compatible bytes) with a step id and a rendezvous key; the handler decodes the
request, takes the next value of that key from ``waits.Waits`` (which waits for it up to
the call's deadline, within the bounds on waiting calls) and answers it
(research/tf_rendezvous.md §3.2). A shmrdv client also says ``inline_max`` (extension
field 1002): a larger tensor is answered with empty bytes and kept cached under the
request_id, and the client then streams it with ``RecvTensorStream`` (shmrdv's chunked
stream, no 2 GiB ceiling). Acks ride on requests (extension field 1001) or come as
``MarkRecvFinished`` (which, with shmrdv's "released" flag, also says the client gave a
request_id up). ``GetStatus`` names the worker's device and incarnation.

Thread model (docs/threads.md): every handler runs on the server's event loop
(``server``): no lock. A large unary response is encoded in the thread pool given to
``started`` (a small one in the loop, cheaper than two thread switches); stream chunks
are cut in the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._errors import RendezvousError, code_for_error
from .._keys import DeviceName
from .._rendezvous import Received
from . import assembly, messages, status, tensors
from .mark_finished import decode_mark_recv_finished
from .methods import SHMRDV_SERVICE, TF_SERVICE
from .response_cache import Waiter
from .tensor_source import TensorSource
from .waits import WaitLimits, Waits

__all__ = ["RecvService"]

# A unary response of a tensor up to this size is encoded in the event loop: handing so
# small a copy to the encoding pool costs more (two thread switches) than the copy. Up
# to inline_max (1 MiB): measured, bench 1 MiB round trip 3.8-4.2 ms with the loop
# against 4.7-5.5 ms through the pool (issue 19, same session).
_ENCODE_IN_LOOP_BYTES = 1 << 20


class RecvService:
    """The handlers of one server, serving values of one ``TensorSource``.

    ``handlers()`` are registered on the gRPC server; ``started`` gives the bound address
    and the encoding pool before the first call; ``stop_serving`` fails every waiting
    call; ``drop_step`` forgets a step's cached responses. All but the constructor and
    ``handlers`` run on the server's event loop.
    """

    def __init__(
        self,
        source: TensorSource,
        task: DeviceName,
        *,
        chunk_bytes: int,
        limits: WaitLimits,
    ) -> None:
        self._source = source
        self._task = task
        self._chunk_bytes = chunk_bytes
        self._waits = Waits(source, task, limits)
        self._pool: concurrent.futures.Executor | None = None
        self._stats = {"calls": 0, "values_served": 0, "bytes_served": 0, "errors": 0}

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """The generic handlers of TensorFlow's WorkerService and shmrdv's Rendezvous."""
        shmrdv_methods = {
            "RecvTensorStream": grpc.unary_stream_rpc_method_handler(self._recv_tensor_stream),
        }
        tf_methods = {
            "RecvTensor": grpc.unary_unary_rpc_method_handler(self._recv_tensor),
            "GetStatus": grpc.unary_unary_rpc_method_handler(self._get_status),
            "MarkRecvFinished": grpc.unary_unary_rpc_method_handler(self._mark_recv_finished),
        }
        return [
            grpc.method_handlers_generic_handler(TF_SERVICE, tf_methods),
            grpc.method_handlers_generic_handler(SHMRDV_SERVICE, shmrdv_methods),
        ]

    def started(self, address: str, pool: concurrent.futures.Executor) -> None:
        """The server listens on ``address`` (called in the loop); large responses are
        encoded in ``pool``."""
        self._pool = pool
        self._waits.started(address)

    def stop_serving(self, error: RendezvousError) -> None:
        """Fail every waiting call with ``error`` and forget the cache (the server stops)."""
        self._waits.stop(error)

    def drop_step(self, step_id: int) -> None:
        """Forget cached responses of ``step_id`` (TensorFlow: on CleanupGraph)."""
        self._waits.drop_step(step_id)

    def caches_any(self) -> bool:
        """Whether any response is cached (any thread: a snapshot)."""
        return self._waits.caches_any()

    def stats(self) -> dict[str, int]:
        """Counters: calls, values and bytes served, errors, and ``Waits.stats``'."""
        return {**self._stats, **self._waits.stats()}

    # -- the handlers (event loop) ---------------------------------------------------------

    async def _recv_tensor(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """TensorFlow's unary RecvTensor: a TF-compatible RecvTensorResponse.

        shmrdv's extension fields of the request carry acks (request_ids whose responses
        arrived, as MarkRecvFinished would) and ``inline_max``: a tensor larger than that
        stays in the response cache under the request_id and the answer is empty bytes;
        the client fetches it with RecvTensorStream under the same request_id (a cache
        hit), in chunks. Without ``inline_max`` (TensorFlow) every tensor is answered.
        """
        self._stats["calls"] += 1
        try:
            req = messages.decode_request(request)
            for rid in req.finished:
                self._waits.finished(rid)
            waiter, received = await self._waits.take(req, context.time_remaining(), context.peer)
        except RendezvousError as e:
            await self._abort(context, e)
        if req.inline_max >= 0 and waiter.cache_key is not None:
            limit = min(req.inline_max, tensors.MAX_INLINE_BYTES)
            if received.value.nbytes > limit:
                waiter.deferred = True
                self._waits.done_serving(waiter)
                return b""  # still cached and not sent: the stream call takes it from there
        try:
            data = await self._encode(waiter, received)
            waiter.sent = True
            waiter.writing += 1
            context.add_done_callback(functools.partial(self._call_ended, waiter))
        except RendezvousError as e:
            await self._abort(context, e)
        finally:
            self._waits.done_serving(waiter)
        self._count_served(received)
        return data

    def _call_ended(self, waiter: Waiter, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        # The unary call that sent the value has ended (``Waits.call_ended``).
        self._waits.call_ended(waiter, context.cancelled())

    async def _encode(self, waiter: Waiter, received: Received) -> bytes:
        """The RecvTensorResponse bytes of ``received``: small ones here, large in the pool."""
        encode = functools.partial(
            messages.encode_response,
            received.value,
            is_dead=received.is_dead,
            send_start_micros=waiter.send_start_micros,
            # TensorFlow asks for MarkRecvFinished when its cache holds the response.
            require_ack=waiter.cache_key is not None,
        )
        if received.value.nbytes <= _ENCODE_IN_LOOP_BYTES:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode)

    async def _recv_tensor_stream(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """shmrdv's RecvTensorStream: a header, then raw chunks of at most ``chunk_bytes``."""
        self._stats["calls"] += 1
        try:
            req = messages.decode_request(request)
            waiter, received = await self._waits.take(req, context.time_remaining(), context.peer)
        except RendezvousError as e:
            await self._abort(context, e)
        waiter.deferred = False
        try:
            try:
                chunks = assembly.encode_stream(
                    received.value,
                    is_dead=received.is_dead,
                    chunk_bytes=self._chunk_bytes,
                    send_start_micros=waiter.send_start_micros,
                )
            except RendezvousError as e:
                await self._abort(context, e)
            for chunk in chunks:
                yield chunk  # returns once gRPC has written it (flow control)
            waiter.sent = True
        finally:
            # Also when the client went away mid-stream (asyncio.CancelledError here).
            self._waits.done_serving(waiter)
        self._count_served(received)
        self._waits.report_done(waiter)

    async def _get_status(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """TensorFlow's GetStatus: the worker's one CPU device and its incarnation."""
        del request, context  # GetStatusRequest has no fields
        device = status.DeviceAttributes(
            name=f"{self._task.task_part}/device:CPU:0",
            device_type="CPU",
            incarnation=self._source.incarnation,
        )
        return status.encode_status_response([device])

    async def _mark_recv_finished(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """TensorFlow's MarkRecvFinished: the client has the response; drop it from the cache.

        With shmrdv's "released" flag: the client cancelled this request_id and will not
        retry; a value taken for it and not delivered goes back to its key now instead of
        waiting in the cache until it expires.
        """
        try:
            rid, released = decode_mark_recv_finished(request)
        except RendezvousError as e:
            await self._abort(context, e)
        if released:
            self._waits.release(rid)
        else:
            self._waits.finished(rid)
        return b""

    async def _abort(
        self, context: grpc.aio.ServicerContext[Any, Any], error: RendezvousError
    ) -> NoReturn:
        self._stats["errors"] += 1
        await context.abort(code_for_error(error), str(error))
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def _count_served(self, received: Received) -> None:
        self._stats["values_served"] += 1
        self._stats["bytes_served"] += received.value.nbytes
