"""The service handlers: RecvTensor and its stream, answered from a ``TensorSource``.

A consumer on another host pulls a value: it calls ``RecvTensor`` (TensorFlow's unary
method, TF-compatible bytes) with a step id and a rendezvous key; the handler validates
the key, asks its ``TensorSource`` (the producer's outbox) for the next value of that
key, waits for it up to the call's deadline and answers it (research/tf_rendezvous.md
§3.2). A shmrdv client also says ``inline_max`` (extension field 1002): a larger tensor
is answered with empty bytes and kept cached under the request_id, and the client then
streams it with ``RecvTensorStream`` (shmrdv's chunked stream, no 2 GiB ceiling).
Duplicates, retries and acks go through the ``ResponseCache``; acks ride on requests
(extension field 1001) or come as ``MarkRecvFinished`` (which, with shmrdv's "released"
flag, also says the client gave a request_id up).

Hostile or broken clients cannot exhaust it (issues 12 §4, 19 §4): waiting calls are
bounded in all, per peer host and per connection (``RESOURCE_EXHAUSTED``), a call
without a deadline waits at most ``max_wait``, and a request whose value is already
there is never refused. A value taken counts in the producer's ``max_inflight_bytes``
until the call that carries it has ended (``TensorSource.done_with``), not when it is
taken: a client that asks and never reads holds the window, not the producer's memory.

A value is not lost to calls that go away before it is sent: one that arrives after
every call for it left, or whose every call went away before it was fully sent and that
no retry can claim (a release from a client that gave it up, or cache expiry), goes back
to the head of its key (``TensorSource.requeue``).

Thread model (docs/threads.md): every handler runs on the server's event loop
(``server``), and all the state here (waiters, counters, the cache) is touched only from
there: no lock. A value already there is answered in the loop without a thread hop (the
source calls ``done`` in the loop's own thread). A call waiting for a value is an
``await`` on an asyncio future, which the source's ``done`` (called in the producer's
thread) settles with ``loop.call_soon_threadsafe``. A large unary response is encoded in
the thread pool given to ``started`` (a small one in the loop, cheaper than two thread
switches); stream chunks are cut in the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, Protocol

import grpc
import grpc.aio

from .._callbacks import DoneCallback
from .._devices import DeviceName
from .._errors import (
    DeadlineExceededError,
    InternalError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import ParsedKey
from .._received import Received
from .._status import code_for_error
from . import assembly, messages, tensors
from .keycheck import check_served_key
from .methods import SERVER_STOPPING, SHMRDV_SERVICE, TF_SERVICE
from .parked import ParkedCalls
from .response_cache import ResponseCache, Waiter

__all__ = ["RecvService", "TensorSource"]

_log = logging.getLogger("shmrdv.rpc.server")

# A unary response of a tensor up to this size is encoded in the event loop: handing so
# small a copy to the encoding pool costs more (two thread switches) than the copy. Up
# to inline_max (1 MiB): measured, bench 1 MiB round trip 3.8-4.2 ms with the loop
# against 4.7-5.5 ms through the pool (issue 19, same session).
_ENCODE_IN_LOOP_BYTES = 1 << 20


class TensorSource(Protocol):
    """What the server pulls values from (the producer's outbox).

    ``task`` is the canonical task name (``/job:w/replica:0/task:0``), ``incarnation`` the
    worker's incarnation. ``serve_recv`` raises ``AbortedError`` at once for a step that
    was cleaned up; otherwise it calls ``done(error, Received)`` exactly once, in any
    thread (in the caller's when the value is already there), unless the canceller it
    returned answered ``True``.

    A value it gave is the service's until the service calls ``done_with`` for it, exactly
    once: the call that carried it has ended, or the service dropped it, or is about to
    hand it back with ``requeue`` (to the head of its key: it was taken for a call that
    went away before it was delivered, and no retry can claim it).
    """

    task: str
    incarnation: int

    def serve_recv(
        self, step_id: int, key: ParsedKey, done: DoneCallback
    ) -> Callable[[], bool]: ...

    def done_with(self, step_id: int, key: ParsedKey, nbytes: int) -> None: ...

    def requeue(self, step_id: int, key: ParsedKey, received: Received) -> None: ...


def _retrieve(fut: asyncio.Future[Received]) -> None:
    # Mark an exception as retrieved so asyncio does not log "never retrieved" when every
    # call that waited for this value has gone.
    if not fut.cancelled():
        fut.exception()


async def _woken(waiter: Waiter, timeout: float) -> bool:
    """Wait until ``waiter`` is settled (True) or ``timeout`` passes (False).

    Each call waiting on a waiter has a future of its own, which ``_settle`` completes
    directly (``_wake``): a call that leaves never cancels the shared one, and the wake-up
    takes one turn of the loop (``wait_for(shield(...))`` took four).
    """
    loop = asyncio.get_running_loop()
    call: asyncio.Future[bool] = loop.create_future()
    waiter.calls.add(call)
    timer = loop.call_later(timeout, _resolve, call, False)
    try:
        return await call
    finally:
        timer.cancel()
        waiter.calls.discard(call)


def _resolve(call: asyncio.Future[bool], settled: bool) -> None:
    if not call.done():
        call.set_result(settled)


def _wake(waiter: Waiter) -> None:
    """``waiter`` is settled: wake every call waiting on it."""
    for call in waiter.calls:
        _resolve(call, True)


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
        max_waiting_per_connection: int,
        max_wait: float,
    ) -> None:
        self._source = source
        self._task = task
        self._chunk_bytes = chunk_bytes
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
        self._loop_thread = -1
        self._stopping = False
        self._waiters: set[Waiter] = set()  # not yet settled
        self._parked = ParkedCalls(max_waiting, max_waiting_per_peer, max_waiting_per_connection)
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
        self._address, self._pool = address, pool
        self._loop_thread = threading.get_ident()

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
        out["parked"] = self._parked.total
        return out

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
                self._cache.finished(rid)
            waiter, received = await self._wait_value(req, context.time_remaining(), context)
        except RendezvousError as e:
            await self._abort(context, e)
        if req.inline_max >= 0 and waiter.cache_key is not None:
            limit = min(req.inline_max, tensors.MAX_INLINE_BYTES)
            if received.value.nbytes > limit:
                waiter.deferred = True
                self._done_serving(waiter)
                return b""  # still cached and not sent: the stream call takes it from there
        try:
            data = await self._encode(waiter, received)
            waiter.sent = True
            waiter.writing += 1
            context.add_done_callback(functools.partial(self._call_ended, waiter))
        except RendezvousError as e:
            await self._abort(context, e)
        finally:
            self._done_serving(waiter)
        self._count_served(received)
        return data

    def _call_ended(self, waiter: Waiter, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """The unary call that sent ``waiter``'s value has ended: written to the client
        (delivered: the window counts it no more), or cancelled before (the value stays
        cached for a retry, or leaves: ``_maybe_give_back``).

        A call can end well here and still have been cancelled by its client: the answer
        was written before the client's cancel arrived. A client that then released the
        request_id (it cancelled before any data reached its caller) did not take the
        value, so it goes back to its key (bug 3c of issue 19: it was dropped, and the
        next receive waited for nothing)."""
        waiter.writing -= 1
        if context.cancelled() or waiter.released:
            self._maybe_give_back(waiter)
        else:
            self._report_done(waiter)

    def _report_done(self, waiter: Waiter) -> None:
        """Tell the source, once per value, that the service is done with it."""
        fut = waiter.future
        if waiter.reported or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return
        waiter.reported = True
        self._source.done_with(waiter.step_id, waiter.key, fut.result().value.nbytes)

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
                yield chunk  # returns once gRPC has written it (flow control)
            waiter.sent = True
        finally:
            # Also when the client went away mid-stream (asyncio.CancelledError here).
            self._done_serving(waiter)
        self._count_served(received)
        self._report_done(waiter)

    def _done_serving(self, waiter: Waiter) -> None:
        waiter.serving -= 1
        self._maybe_give_back(waiter)

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
        """TensorFlow's MarkRecvFinished: the client has the response; drop it from the cache.

        With shmrdv's "released" flag: the client cancelled this request_id and will not
        retry; a value taken for it and not delivered goes back to its key now instead of
        waiting in the cache until it expires.
        """
        try:
            rid, released = messages.decode_mark_recv_finished(request)
        except RendezvousError as e:
            await self._abort(context, e)
        if released:
            self._cache.release(rid)
        else:
            self._cache.finished(rid)
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

    # -- waiting for a value (event loop) ------------------------------------------------

    def _validate(self, req: messages.RecvRequest) -> ParsedKey:
        """Parse and check the key as TensorFlow's GrpcWorker does; raise the TF error."""
        return check_served_key(
            req.rendezvous_key, self._task, self._source.task, self._source.incarnation
        )

    async def _wait_value(
        self,
        req: messages.RecvRequest,
        timeout: float | None,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> tuple[Waiter, Received]:
        """The value for ``req``: from the cache, by joining a waiter, or a new waiter.

        A value already there is taken at once, whatever the bounds. Otherwise the call
        waits, if the bounds on waiting calls let it, up to its deadline
        (``DeadlineExceededError``); a call cancelled by its client
        (``asyncio.CancelledError``) leaves, and the last call to leave an unsettled
        waiter removes it from the source.
        """
        if self._stopping:
            raise UnavailableError(f"shmrdv RPC server {self._address} {SERVER_STOPPING}")
        pk = self._validate(req)
        waiter = self._find_or_start(req, pk)  # joined: waiter.joiners counts this call
        taken = False
        peer = ""
        try:
            if not waiter.future.done():
                peer = context.peer()
                why = self._parked.refusal(peer)
                if why is not None:
                    peer = ""
                    raise ResourceExhaustedError(
                        f"RecvTensor on {self._source.task}: {why}; key {pk.full_key!r} refused"
                    )
                self._parked.add(peer, 1)
                # A client that never sets a deadline (or a far one) must not park forever.
                timeout = self._max_wait if timeout is None else min(timeout, self._max_wait)
                if not await _woken(waiter, timeout):
                    raise DeadlineExceededError(
                        f"RecvTensor on {self._source.task}: no value for key {pk.full_key!r} "
                        f"(step {req.step_id}) before the call's deadline; the waiter was removed"
                    ) from None
            received = waiter.future.result()
            # The caller sends the value now and calls _done_serving when it is through.
            waiter.serving += 1
            taken = True
        finally:
            if peer:
                self._parked.add(peer, -1)
            waiter.joiners -= 1
            if waiter.joiners == 0 and not waiter.future.done():
                self._abandon(waiter)
            elif not taken:
                # Cancelled just as the value came: it stays cached for a retry under its
                # request_id, or (released, uncached) goes back to its key now.
                self._maybe_give_back(waiter)
        return waiter, received

    def _find_or_start(self, req: messages.RecvRequest, pk: ParsedKey) -> Waiter:
        """The waiter this call joins (counted in its ``joiners``): a cached one, or a new
        one whose value, if already there, it holds at once."""
        found = self._cache.find(req.request_id, req.step_id, pk)
        if isinstance(found, Waiter):
            if found.future.done():
                self._stats["cache_hits"] += 1
            found.joiners += 1
            return found
        cache_key = found
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Received] = loop.create_future()
        fut.add_done_callback(_retrieve)
        waiter = Waiter(cache_key, fut, req.step_id, pk)
        # A request_id its client already gave up (the release overtook the call): the
        # client will not take this value, so one sent to it goes back (bug 3c of i19).
        waiter.released = cache_key is None and req.request_id != 0
        at_once: list[tuple[BaseException | None, Received | None]] = []
        starting = True

        def done(error: BaseException | None, received: Received | None) -> None:
            # Any thread (the producer's send, an abort); in this one, while serve_recv
            # runs, when the value is already there: settled below, with no hop.
            if starting and threading.get_ident() == self._loop_thread:
                at_once.append((error, received))
                return
            # The loop may be gone if the server stopped meanwhile; the value then has no
            # one left to go to.
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
        finally:
            starting = False
        self._waiters.add(waiter)
        if cache_key is not None:
            self._cache.add(waiter)
        waiter.joiners = 1  # before settling: a joined value is neither evicted nor given back
        if at_once:
            self._settle(waiter, *at_once[0])
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
            _wake(waiter)
            if waiter.cache_key is not None:
                self._cache.uncache(waiter.cache_key)
            return
        if received is None:
            waiter.future.set_exception(InternalError("TensorSource called done(None, None)"))
            _wake(waiter)
            return
        waiter.send_start_micros = time.time_ns() // 1000
        waiter.future.set_result(received)
        _wake(waiter)
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

    def _abandon(self, waiter: Waiter) -> None:
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
        """A value no call uses and no retry can claim leaves the service: given back if
        no call delivered it, else (delivered, or sent to a call that went away) dropped."""
        if (
            waiter.given_back
            or waiter.joiners
            or waiter.serving
            or waiter.writing
            or not waiter.future.done()
            or (waiter.cache_key is not None and waiter.cache_key in self._cache)
        ):
            return
        if waiter.sent and not waiter.released:
            self._report_done(waiter)
            return
        self._give_back(waiter)

    def _give_back(self, waiter: Waiter) -> None:
        """A value taken from the source that no call delivered goes back to its key's head."""
        fut = waiter.future
        if fut.cancelled() or fut.exception() is not None:
            return
        waiter.given_back = True
        self._report_done(waiter)
        try:
            self._source.requeue(waiter.step_id, waiter.key, fut.result())
        except Exception:
            _log.exception("TensorSource.requeue failed for key %r", waiter.key.full_key)
        else:
            self._stats["requeued"] += 1
