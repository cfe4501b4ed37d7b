"""The service handlers: RecvTensor and its kin, answered from a ``TensorSource``.

A consumer on another host pulls a value: it calls ``RecvTensor`` (TensorFlow's unary
method, TF-compatible bytes), ``RecvTensorInline`` (shmrdv's: the same answer for a small
tensor, else "stream it") or ``RecvTensorStream`` (shmrdv's chunked stream, no 2 GiB
ceiling) with a step id and a rendezvous key; the handler validates the key, asks its
``TensorSource`` (the Worker) for the next value of that key, waits for it up to the
call's deadline and answers it (research/tf_rendezvous.md §3.2). A shmrdv consumer
keeps one ``Exchange`` stream open instead and posts its wants on it; each is served
the same way and answered by one stream message (``methods.EXCHANGE_METHOD``).
Duplicates, retries and acks go through the ``ResponseCache``.

Hostile or broken clients cannot exhaust it (issue 12 §4): waiting calls are bounded in
all and per peer host (``RESOURCE_EXHAUSTED``) and a call without a deadline waits at
most ``max_wait``.

A value is not lost to calls that go away before it is sent: one that arrives after
every call for it left, or whose every call went away before it was fully sent and that
no retry can claim (``ReleaseRecv`` or an Exchange cancel from a client that gave it up,
or cache expiry), goes back to the head of its key (``TensorSource.requeue``).

Thread model: every handler runs on the server's event loop (``server``), and all the
state here (waiters, counters, the cache) is touched only from there: no lock. A call
waiting for a value is an ``await`` on an asyncio future; the source's ``done`` callback
(called in the producer's thread) settles it with ``loop.call_soon_threadsafe``. A large
unary response is encoded in the thread pool given to ``started`` (a small one in the
loop, cheaper than two thread switches); stream chunks are cut in the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, Protocol

import grpc
import grpc.aio

from .._callbacks import DoneCallback
from .._devices import DeviceName
from .._errors import (
    AbortedError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import ParsedKey, parse_key
from .._received import Received
from .._rendezvous import Canceller
from .._status import code_for_error
from . import assembly, messages, tensors
from .methods import DEFAULT_INLINE_MAX, LINK_INLINE_MAX, SHMRDV_SERVICE, TF_SERVICE
from .response_cache import ResponseCache, Waiter

__all__ = ["RecvService", "TensorSource"]

_log = logging.getLogger("shmrdv.rpc.server")

# A unary response of a tensor up to this size is encoded in the event loop: handing so
# small a copy to the encoding pool costs more (two thread switches) than the copy.
_ENCODE_IN_LOOP_BYTES = 256 << 10


class TensorSource(Protocol):
    """What the server pulls values from (implemented by the Worker).

    ``task`` is the canonical task name (``/job:w/replica:0/task:0``), ``incarnation`` the
    worker's incarnation. ``serve_recv`` raises ``AbortedError`` at once for a step that
    was cleaned up; otherwise it calls ``done(error, Received)`` exactly once, in any
    thread, unless the canceller it returned answered ``True``.

    Optional: ``requeue(step_id, key, received)``. When present, a value that was taken
    for a call but never delivered (the call went away mid-stream, or was cancelled as
    the value arrived, and no retry can claim it: no request_id, or its cache entry
    expired) is handed back to go to the head of its key (``LocalRendezvous.requeue``).
    Without it such a value is dropped with a warning, as TensorFlow drops it.
    """

    task: str
    incarnation: int

    def serve_recv(self, step_id: int, key: ParsedKey, done: DoneCallback) -> Canceller: ...


def _retrieve(fut: asyncio.Future[Received]) -> None:
    # Mark an exception as retrieved so asyncio does not log "never retrieved" when every
    # call that waited for this value has gone.
    if not fut.cancelled():
        fut.exception()


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    """An Exchange reply ready to write; ``waiter`` is served by it (None: an error)."""

    data: bytes
    waiter: Waiter | None = None
    received: Received | None = None


def _forget_want(wants: dict[int, asyncio.Task[None]], rid: int, task: asyncio.Task[None]) -> None:
    if wants.get(rid) is task:
        del wants[rid]


def _as_rendezvous_error(error: BaseException) -> RendezvousError:
    if isinstance(error, RendezvousError):
        return error
    return InternalError(f"Exchange failed: {error!r}")


def _peer_host(peer: str) -> str:
    """A call's peer without its port ("ipv4:10.0.0.1:5123" -> "ipv4:10.0.0.1"): the
    unit the per-peer bound counts (one host opening many connections is one peer)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


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
        cache_ttl: float,
        cache_entries: int,
        cache_bytes: int,
        max_waiting: int,
        max_waiting_per_peer: int,
        max_wait: float,
    ) -> None:
        self._source = source
        self._task = task
        self._chunk_bytes = chunk_bytes
        self._max_waiting = max_waiting
        self._max_waiting_per_peer = max_waiting_per_peer
        self._max_wait = float(max_wait)
        self._cache = ResponseCache(
            ttl=cache_ttl,
            entries=cache_entries,
            max_bytes=cache_bytes,
            give_back=self._maybe_give_back,
            where=source.task,
        )
        self._pool: concurrent.futures.Executor | None = None
        self._address = "(not started)"
        self._stopping = False
        self._waiters: set[Waiter] = set()  # not yet settled
        self._parked = 0  # calls waiting for a value
        self._parked_by_peer: dict[str, int] = {}
        self._stats = {
            "calls": 0,
            "values_served": 0,
            "bytes_served": 0,
            "cache_hits": 0,
            "errors": 0,
            "requeued": 0,
        }

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """The generic handlers of TensorFlow's WorkerService and shmrdv's Rendezvous."""
        shmrdv_methods = {
            "RecvTensorStream": grpc.unary_stream_rpc_method_handler(self._recv_tensor_stream),
            "ReleaseRecv": grpc.unary_unary_rpc_method_handler(self._release_recv),
            "RecvTensorInline": grpc.unary_unary_rpc_method_handler(self._recv_tensor_inline),
            "Exchange": grpc.stream_stream_rpc_method_handler(self._exchange),
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
        """The server listens on ``address``; large responses are encoded in ``pool``."""
        self._address, self._pool = address, pool

    def stop_serving(self, error: RendezvousError) -> None:
        """Fail every waiting call with ``error`` and forget the cache (the server stops)."""
        self._stopping = True
        for waiter in list(self._waiters):
            if waiter.canceller is not None:
                waiter.canceller()
            self._settle(waiter, error, None)
        self._cache.clear()

    def drop_step(self, step_id: int) -> None:
        """Forget cached responses of ``step_id`` (TensorFlow: on CleanupGraph)."""
        self._cache.drop_step(step_id)

    def stats(self) -> dict[str, int]:
        """Counters: calls, values and bytes served, cache hits, errors, waiting, cached."""
        out = dict(self._stats)
        out["waiting"] = len(self._waiters)
        out["cached"] = len(self._cache)
        out["cached_bytes"] = self._cache.cached_bytes
        out["parked"] = self._parked
        return out

    # -- the handlers (event loop) ---------------------------------------------------------

    async def _recv_tensor(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """TensorFlow's unary RecvTensor: a TF-compatible RecvTensorResponse."""
        self._stats["calls"] += 1
        try:
            req = messages.decode_request(request)
            waiter, received = await self._wait_value(req, context.time_remaining(), context)
        except RendezvousError as e:
            await self._abort(context, e)
        return await self._send_unary(waiter, received, context)

    async def _send_unary(
        self, waiter: Waiter, received: Received, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """The unary answer of a call that took ``received`` (it is done serving after)."""
        try:
            data = await self._encode(waiter, received)
            waiter.sent = True
        except RendezvousError as e:
            await self._abort(context, e)
        finally:
            self._done_serving(waiter)
        self._count_served(received)
        return data

    async def _encode(self, waiter: Waiter, received: Received, *, request_id: int = 0) -> bytes:
        """The RecvTensorResponse bytes of ``received``: small ones here, large in the pool.

        With ``request_id``: an Exchange reply for it (``messages.encode_link_value``)."""
        encode: Callable[[], bytes]
        if request_id:
            encode = functools.partial(
                messages.encode_link_value,
                request_id,
                received.value,
                is_dead=received.is_dead,
                send_start_micros=waiter.send_start_micros,
            )
        else:
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

    async def _recv_tensor_inline(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """shmrdv's RecvTensorInline: one unary call answers a small tensor.

        The request is a RecvTensorRequest whose extension fields carry acks (request_ids
        whose responses arrived, as MarkRecvFinished would) and ``inline_max``. A tensor
        of at most ``inline_max`` bytes (or any, for request_id 0) is answered in a TF
        RecvTensorResponse; a larger one stays in the response cache under the
        request_id and the answer is empty bytes: the client fetches it with
        RecvTensorStream under the same request_id (a cache hit), in chunks.
        """
        self._stats["calls"] += 1
        try:
            req = messages.decode_request(request)
            for rid in req.finished:
                self._cache.finished(rid)
            waiter, received = await self._wait_value(req, context.time_remaining(), context)
        except RendezvousError as e:
            await self._abort(context, e)
        limit = DEFAULT_INLINE_MAX if req.inline_max < 0 else req.inline_max
        limit = min(limit, tensors.MAX_INLINE_BYTES)  # beyond it: only a stream can carry it
        if waiter.cache_key is not None and received.value.nbytes > limit:
            waiter.deferred = True
            self._done_serving(waiter)
            return b""  # still cached and not sent: the stream call takes it from there
        return await self._send_unary(waiter, received, context)

    async def _recv_tensor_stream(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """shmrdv's RecvTensorStream: a header, then raw chunks of at most ``chunk_bytes``."""
        self._stats["calls"] += 1
        try:
            req = messages.decode_request(request)
            waiter, received = await self._wait_value(req, context.time_remaining(), context)
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
                yield chunk
            waiter.sent = True
        finally:
            # Also when the client went away mid-stream (asyncio.CancelledError here).
            self._done_serving(waiter)
        self._count_served(received)

    def _done_serving(self, waiter: Waiter) -> None:
        waiter.serving -= 1
        self._maybe_give_back(waiter)

    async def _exchange(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """shmrdv's Exchange: the consumer's wants in, one reply per want out, as the
        values are sent (``EXCHANGE_METHOD``). When the stream ends, every want still
        waiting is removed (a value already taken stays cached for a retry under its
        request_id, or goes back to its key)."""
        self._stats["calls"] += 1
        out: asyncio.Queue[_Reply | None] = asyncio.Queue()
        wants: dict[int, asyncio.Task[None]] = {}
        reader = asyncio.ensure_future(self._read_wants(requests, out, wants, context))
        reader.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while True:
                reply = await out.get()
                if reply is None:
                    break
                try:
                    yield reply.data
                    if reply.waiter is not None:
                        reply.waiter.sent = True
                finally:
                    if reply.waiter is not None:
                        self._done_serving(reply.waiter)
                if reply.received is not None:
                    self._count_served(reply.received)
            if not reader.cancelled() and reader.exception() is not None:
                error = reader.exception()
                assert error is not None
                await self._abort(context, _as_rendezvous_error(error))
        finally:
            reader.cancel()
            for task in list(wants.values()):
                task.cancel()
            while not out.empty():
                left = out.get_nowait()
                if left is not None and left.waiter is not None:
                    self._done_serving(left.waiter)

    async def _read_wants(
        self,
        requests: AsyncIterator[bytes],
        out: asyncio.Queue[_Reply | None],
        wants: dict[int, asyncio.Task[None]],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        async for raw in requests:
            req = messages.decode_request(raw)  # a stream that does not parse is aborted
            for rid in req.finished:
                self._cache.finished(rid)
            if req.cancel:
                task = wants.pop(req.request_id, None)
                self._cache.release(req.request_id)
                if task is not None:
                    task.cancel()
                continue
            if not req.rendezvous_key:
                continue  # acks only
            if req.request_id == 0 or req.request_id in wants:
                raise InvalidArgumentError(
                    f"Exchange: a want needs a fresh non-zero request_id, not {req.request_id}"
                )
            task = asyncio.ensure_future(self._serve_want(req, out, context))
            wants[req.request_id] = task
            task.add_done_callback(functools.partial(_forget_want, wants, req.request_id))

    async def _serve_want(
        self,
        req: messages.RecvRequest,
        out: asyncio.Queue[_Reply | None],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        rid = req.request_id
        timeout = None if req.wait_ms < 0 else req.wait_ms / 1000
        try:
            waiter, received = await self._wait_value(req, timeout, context)
        except RendezvousError as e:
            self._stats["errors"] += 1
            out.put_nowait(
                _Reply(messages.encode_link_error(rid, code_for_error(e).value[0], str(e)))
            )
            return
        try:
            limit = LINK_INLINE_MAX if req.inline_max < 0 else min(req.inline_max, LINK_INLINE_MAX)
            if received.value.nbytes > limit and waiter.cache_key is not None:
                waiter.deferred = True  # cached, not sent: the client fetches it
                data = messages.encode_link_fetch(rid)
                self._done_serving(waiter)
                out.put_nowait(_Reply(data))
                return
            data = await self._encode(waiter, received, request_id=rid)
        except RendezvousError as e:
            self._done_serving(waiter)
            self._stats["errors"] += 1
            out.put_nowait(
                _Reply(messages.encode_link_error(rid, code_for_error(e).value[0], str(e)))
            )
            return
        except BaseException:
            self._done_serving(waiter)
            raise
        out.put_nowait(_Reply(data, waiter, received))

    async def _get_status(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """TensorFlow's GetStatus: the worker's one CPU device and its incarnation."""
        del request, context  # GetStatusRequest has no fields
        device = messages.DeviceAttributes(
            name=f"{self._task.task_part}/device:CPU:0",
            device_type="CPU",
            incarnation=self._source.incarnation,
        )
        return messages.encode_status_response([device])

    async def _mark_recv_finished(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """TensorFlow's MarkRecvFinished: the client has the response; drop it from the cache."""
        self._cache.finished(await self._request_id_of(request, context))
        return b""

    async def _release_recv(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """shmrdv's ReleaseRecv: the client cancelled this request_id and will not retry.

        A value already taken for it and not delivered goes back to its key now instead of
        waiting in the cache until it expires. Same message as MarkRecvFinished.
        """
        self._cache.release(await self._request_id_of(request, context))
        return b""

    async def _request_id_of(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> int:
        """The request_id of a MarkRecvFinishedRequest; the call fails if it does not parse."""
        try:
            return messages.decode_mark_recv_finished(request)
        except RendezvousError as e:
            await self._abort(context, e)

    async def _abort(
        self, context: grpc.aio.ServicerContext[Any, Any], error: RendezvousError
    ) -> NoReturn:
        self._stats["errors"] += 1
        await context.abort(code_for_error(error), str(error))
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def _count_served(self, received: Received) -> None:
        self._stats["values_served"] += 1
        self._stats["bytes_served"] += received.value.nbytes

    # -- waiting for a value (event loop) ------------------------------------------------

    def _validate(self, req: messages.RecvRequest) -> ParsedKey:
        """Parse and check the key as TensorFlow's GrpcWorker does; raise the TF error."""
        pk = parse_key(req.rendezvous_key)
        if not pk.src.same_task(self._task):
            # TensorFlow (BaseRendezvousMgr::RecvLocalAsync / ValidateDevices):
            raise InvalidArgumentError(
                f"Invalid rendezvous key (src): {pk.full_key} @ {self._source.task}"
            )
        incarnation = self._source.incarnation
        if pk.src_incarnation != 0 and pk.src_incarnation != incarnation:
            # TensorFlow: GrpcWorker::PrepareRecvTensor, word for word.
            raise AbortedError(
                f"RecvTensor expects a different device incarnation: {pk.src_incarnation:016x} "
                f'vs. {incarnation:016x}. Your worker job ("{self._source.task}") was probably '
                "restarted. Check your worker job for the reason why it was restarted."
            )
        return pk

    async def _wait_value(
        self,
        req: messages.RecvRequest,
        timeout: float | None,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> tuple[Waiter, Received]:
        """The value for ``req``: from the cache, by joining a waiter, or a new waiter.

        Waits up to the call's deadline (``DeadlineExceededError``); a call cancelled by
        its client (``asyncio.CancelledError``) leaves, and the last call to leave an
        unsettled waiter removes it from the source.
        """
        if self._stopping:
            raise UnavailableError(f"shmrdv RPC server {self._address} is stopping")
        pk = self._validate(req)
        # A client that never sets a deadline (or a far one) must not park a call forever.
        timeout = self._max_wait if timeout is None else min(timeout, self._max_wait)
        peer = _peer_host(context.peer())
        if self._parked >= self._max_waiting:
            raise ResourceExhaustedError(
                f"RecvTensor on {self._source.task}: {self._parked} calls already wait for "
                f"values (max_waiting={self._max_waiting}); key {pk.full_key!r} refused"
            )
        if self._parked_by_peer.get(peer, 0) >= self._max_waiting_per_peer:
            raise ResourceExhaustedError(
                f"RecvTensor on {self._source.task}: {peer} already has "
                f"{self._parked_by_peer[peer]} calls waiting for values "
                f"(max_waiting_per_peer={self._max_waiting_per_peer}); key {pk.full_key!r} refused"
            )
        waiter = self._find_or_start(req, pk)
        waiter.joiners += 1
        taken = False
        self._parked += 1
        self._parked_by_peer[peer] = self._parked_by_peer.get(peer, 0) + 1
        try:
            try:
                received = await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
            except asyncio.TimeoutError:
                raise DeadlineExceededError(
                    f"RecvTensor on {self._source.task}: no value for key {pk.full_key!r} "
                    f"(step {req.step_id}) before the call's deadline; the waiter was removed"
                ) from None
            # The caller sends the value now and calls _done_serving when it is through.
            waiter.serving += 1
            taken = True
        finally:
            self._parked -= 1
            left = self._parked_by_peer[peer] - 1
            if left:
                self._parked_by_peer[peer] = left
            else:
                del self._parked_by_peer[peer]
            waiter.joiners -= 1
            if waiter.joiners == 0 and not waiter.future.done():
                self._abandon(waiter, pk)
            elif not taken:
                # Cancelled just as the value came: it stays cached for a retry under its
                # request_id, or (released, uncached) goes back to its key now.
                self._maybe_give_back(waiter)
        return waiter, received

    def _find_or_start(self, req: messages.RecvRequest, pk: ParsedKey) -> Waiter:
        found = self._cache.find(req.request_id, req.step_id, pk)
        if isinstance(found, Waiter):
            if found.future.done():
                self._stats["cache_hits"] += 1
            return found
        cache_key = found
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Received] = loop.create_future()
        fut.add_done_callback(_retrieve)
        waiter = Waiter(cache_key, fut, req.step_id, pk)

        def done(error: BaseException | None, received: Received | None) -> None:
            # Any thread (the producer's send, an abort). The loop may be gone if the server
            # stopped meanwhile; the value then has no one left to go to.
            try:
                loop.call_soon_threadsafe(self._settle, waiter, error, received)
            except RuntimeError:
                _log.warning(
                    "value for key %r (step %d) arrived after the RPC server stopped; dropped",
                    pk.full_key,
                    req.step_id,
                )

        # serve_recv raises AbortedError for a cleaned-up step: the call fails at once.
        try:
            waiter.canceller = self._source.serve_recv(req.step_id, pk, done)
        except RendezvousError:
            raise
        except Exception as e:  # a bug in the source must still answer the call
            _log.exception("TensorSource.serve_recv failed for key %r", pk.full_key)
            raise InternalError(
                f"TensorSource of {self._source.task} failed on key {pk.full_key!r}: {e!r}"
            ) from e
        if not fut.done():
            self._waiters.add(waiter)
        if cache_key is not None:
            self._cache.add(waiter)
        return waiter

    def _settle(
        self, waiter: Waiter, error: BaseException | None, received: Received | None
    ) -> None:
        """The source's answer, now in the loop: wake the calls, keep a value for retries."""
        self._waiters.discard(waiter)
        if waiter.future.done():
            return  # failed by stop(); a value arriving now has no one to go to
        if error is not None:
            if not isinstance(error, RendezvousError):
                error = InternalError(f"TensorSource.serve_recv failed: {error!r}")
            waiter.future.set_exception(error)
            if waiter.cache_key is not None:
                self._cache.uncache(waiter.cache_key)
            return
        if received is None:
            waiter.future.set_exception(InternalError("TensorSource called done(None, None)"))
            return
        waiter.send_start_micros = time.time_ns() // 1000
        waiter.future.set_result(received)
        if waiter.joiners == 0:
            # Every call left while the value was on its way (cancelled, or the connection
            # broke). Give it back to the head of its key rather than park it in the
            # cache: a retry with the same request_id starts a new waiter and gets it
            # first, and a client that cancelled never comes back for it.
            if waiter.cache_key is not None:
                self._cache.pop(waiter.cache_key)
            self._maybe_give_back(waiter)
            return
        if self._cache.delivered(waiter, received.value.nbytes, time.monotonic()):
            # Expiry also runs on every lookup; this timer covers a server that gets none.
            asyncio.get_running_loop().call_later(self._cache.ttl + 0.01, self._cache.expire)

    def _abandon(self, waiter: Waiter, pk: ParsedKey) -> None:
        """The last call waiting on ``waiter`` left before the value came: remove the waiter."""
        canceller = waiter.canceller
        if canceller is not None and canceller():
            self._waiters.discard(waiter)
            waiter.future.cancel()
            if waiter.cache_key is not None:
                self._cache.uncache(waiter.cache_key)
        # Otherwise the value is already on its way (a race with the cancel): _settle
        # keeps it for a retry (request_id) or gives it back to the source.

    def _maybe_give_back(self, waiter: Waiter) -> None:
        """Give the value back if no call delivered it, none is using it, no retry can claim it."""
        if (
            (waiter.sent and not waiter.released)
            or waiter.given_back
            or waiter.joiners
            or waiter.serving
            or not waiter.future.done()
            or (waiter.cache_key is not None and waiter.cache_key in self._cache)
        ):
            return
        self._give_back(waiter)

    def _give_back(self, waiter: Waiter) -> None:
        """A value taken from the source that no call delivered goes back to its key's head.

        Only when the source offers ``requeue`` (the Worker does); otherwise the value is
        lost, as in TensorFlow, and we say so.
        """
        fut = waiter.future
        if fut.cancelled() or fut.exception() is not None:
            return
        waiter.given_back = True
        requeue = getattr(self._source, "requeue", None)
        if requeue is None:
            _log.warning(
                "value of key %r (step %d) was taken for a RecvTensor call that went away; "
                "it is dropped",
                waiter.key.full_key,
                waiter.step_id,
            )
            return
        try:
            requeue(waiter.step_id, waiter.key, fut.result())
        except Exception:
            _log.exception("TensorSource.requeue failed for key %r", waiter.key.full_key)
        else:
            self._stats["requeued"] += 1
