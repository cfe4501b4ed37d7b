"""RpcServer: the producer side of the gRPC transport (TensorFlow's worker RecvTensor service).

A consumer on another host pulls a value: it calls ``RecvTensor`` (TensorFlow's unary
method, TF-compatible bytes), ``RecvTensorInline`` (shmrdv's: the same answer for a small
tensor, else "stream it") or ``RecvTensorStream`` (shmrdv's chunked stream, no 2 GiB
ceiling) with a step id and a rendezvous key; the server validates the key, asks its
``TensorSource`` (the Worker) for the next value of that key, waits for it up to the
call's deadline and answers it (research/tf_rendezvous.md §3.2). A shmrdv consumer
keeps one ``Exchange`` stream open instead and posts its wants on it; each is served
the same way and answered by one stream message (``methods.EXCHANGE_METHOD``).

Hostile or broken clients cannot exhaust it (issue 12 §4): waiting calls are bounded in
all and per peer host (``RESOURCE_EXHAUSTED``), a call without a deadline waits at most
``max_wait``, an ack costs O(1) (request_id index; expiry walks delivered entries oldest
first), and gRPC sheds connections that never finish their handshake, idle ones,
half-open ones and any beyond ``max_connections``.

Thread model: a ``grpc.aio`` server runs on its own event loop in one thread
("shmrdv-rpc-server"). A call waiting for a value is an ``await`` on an asyncio future,
not a blocked thread, so any number of calls can wait; the source's ``done`` callback
(called in the producer's thread) settles that future with ``loop.call_soon_threadsafe``.
All the server's bookkeeping (the waiters, the response cache) lives in that loop and
needs no lock. Encoding a unary response (one copy of the tensor) runs in a bounded
thread pool (``max_workers``) when it is large (a small one is encoded in the loop,
cheaper than two thread switches) so that a large tensor does not stall the loop; stream
chunks are small (``chunk_bytes``) and are cut in the loop.

Response cache (TensorFlow: ``GrpcResponseCache``): a call with a non-zero
``request_id`` registers its waiter under that id. A duplicate that arrives while the
first is waiting joins it; one that arrives after the value was delivered gets the same
value again for ``cache_ttl`` seconds (bounded in count and bytes), so a response lost on
the wire is not a lost tensor. TensorFlow answers such a retry with ``ABORTED``
(``RecentRequestIds``), and pytorch/xla#4084 shows that kills jobs.
``MarkRecvFinished`` (sent by TensorFlow clients when a response has ``require_ack``,
and by ``RpcClient`` after every stream), the acks a ``RecvTensorInline`` request or an
``Exchange`` want carries (extension field 1001) and ``drop_step`` release entries early.

A value is not lost to calls that go away before it is sent: one that arrives after every call for it
left, or whose every call went away before it was fully sent and that no retry can
claim (``ReleaseRecv`` or an Exchange cancel from a client that gave it up, or cache
expiry), goes back to the
head of its key (``TensorSource.requeue``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from types import TracebackType
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
from .._hostaddr import split_host_port
from .._keys import ParsedKey, parse_key
from .._received import Received
from .._rendezvous import Canceller
from .._status import code_for_error
from . import assembly, messages, tensors
from .methods import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_INLINE_MAX,
    LINK_INLINE_MAX,
    SHMRDV_SERVICE,
    TF_SERVICE,
)
from .security import TLSConfig, TokenInterceptor, check_token

__all__ = ["RpcServer", "TensorSource"]

_log = logging.getLogger("shmrdv.rpc.server")

# TensorFlow: the server calls SetMaxMessageSize(INT32_MAX) (research §3.4). Requests are
# tiny, so the receive limit stays small: a peer must not make us allocate 2 GiB.
_MAX_SEND_BYTES = 2**31 - 1
_MAX_RECEIVE_BYTES = 1 << 20

_STARTUP_TIMEOUT = 30.0
# A unary response of a tensor up to this size is encoded in the event loop: handing so
# small a copy to the encoding pool costs more (two thread switches) than the copy.
_ENCODE_IN_LOOP_BYTES = 256 << 10
# TensorFlow: RecentRequestIds remembers the last 100,000 request ids.
_ANSWERED_IDS = 100_000


# Servers still running at interpreter exit are stopped first, so that gRPC's threads do
# not die under a running event loop (their daemon thread would be killed mid-call).
_RUNNING: weakref.WeakSet[RpcServer] = weakref.WeakSet()


@atexit.register
def _stop_running_servers() -> None:
    for server in list(_RUNNING):
        server.stop(0.0)


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


_CacheKey = tuple[int, int, str]  # (request_id, step_id, full key)


@dataclasses.dataclass(eq=False)
class _Waiter:
    """One ``serve_recv`` in progress or delivered, shared by calls with its request_id."""

    cache_key: _CacheKey | None  # None: request_id 0, never shared or cached
    future: asyncio.Future[Received]
    step_id: int
    key: ParsedKey
    canceller: Canceller | None = None
    joiners: int = 0
    send_start_micros: int = 0
    nbytes: int = 0
    expires: float = 0.0
    serving: int = 0  # calls sending this value now
    sent: bool = False  # a call handed the whole response to gRPC
    given_back: bool = False  # returned to the source with requeue
    # The client cancelled before taking any data (ReleaseRecv): whatever the stream
    # wrote went nowhere, so the value goes back even if every chunk was written.
    released: bool = False
    # RecvTensorInline found it too large and left it for the client's RecvTensorStream:
    # never evicted for room (only expiry or ReleaseRecv give it back).
    deferred: bool = False


def _retrieve(fut: asyncio.Future[Received]) -> None:
    # Mark an exception as retrieved so asyncio does not log "never retrieved" when every
    # call that waited for this value has gone.
    if not fut.cancelled():
        fut.exception()


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    """An Exchange reply ready to write; ``waiter`` is served by it (None: an error)."""

    data: bytes
    waiter: _Waiter | None = None
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


def _split_bind(bind: str) -> tuple[str, int]:
    """(host as given, brackets kept for the reported address; port) of ``bind``."""
    try:
        _, port = split_host_port(bind)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(
            f"bind must be 'host:port' (e.g. '127.0.0.1:0', '[::]:2222'): {e}"
        ) from e
    return bind.rpartition(":")[0], port


class RpcServer:
    """A gRPC server that answers RecvTensor for one ``TensorSource``.

    Args:
        bind: ``host:port`` to listen on, exactly as given: ``127.0.0.1:0`` or
            ``localhost:0`` for loopback only, ``[::]:port`` for every interface (only
            when asked). Port 0 picks a free port; ``address`` reports it.
        source: where the values come from (``TensorSource``).
        tls: serve TLS (``TLSConfig`` with the server's certificate and key).
        token: refuse calls without ``authorization: Bearer <token>`` (``UNAUTHENTICATED``).
        max_workers: threads that encode unary responses (waiting calls need none).
        chunk_bytes: largest data chunk of a ``RecvTensorStream`` message.
        cache_ttl, cache_entries, cache_bytes: bounds of the request_id response cache.
        max_concurrent_rpcs: refuse calls beyond this many in flight
            (``RESOURCE_EXHAUSTED``); ``None``: no limit.
        max_waiting, max_waiting_per_peer: most calls (and Exchange wants) waiting for a
            value, in all and from one peer host; beyond: ``RESOURCE_EXHAUSTED``.
        max_wait: longest wait for a value of a call without a deadline (or a later one);
            then ``DEADLINE_EXCEEDED`` (shmrdv clients ask again).
        handshake_timeout, max_connections: a connection that has not finished its
            HTTP/2 (and TLS) handshake within this many seconds is closed; connections
            beyond ``max_connections`` are refused: idle floods cannot use up descriptors.

    ``start()`` blocks until the server listens; ``stop()`` fails waiting calls with
    ``UNAVAILABLE``, stops the server and joins its threads. Use as a context manager.
    """

    def __init__(
        self,
        bind: str,
        source: TensorSource,
        *,
        tls: TLSConfig | None = None,
        token: str | None = None,
        max_workers: int = 16,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache_ttl: float = 30.0,
        cache_entries: int = 1024,
        cache_bytes: int = 256 << 20,
        max_concurrent_rpcs: int | None = None,
        max_waiting: int = 65_536,
        max_waiting_per_peer: int = 16_384,
        max_wait: float = 300.0,
        handshake_timeout: float = 10.0,
        max_connections: int = 1024,
    ) -> None:
        self._host, self._port = _split_bind(bind)
        self._bind = bind
        self._source = source
        try:
            self._task = DeviceName.parse(source.task)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"TensorSource.task {source.task!r} is not a task name: {e}"
            ) from e
        if not self._task.has_task:
            raise InvalidArgumentError(f"TensorSource.task {source.task!r} names no job and task")
        if tls is not None and not isinstance(tls, TLSConfig):
            raise InvalidArgumentError(f"tls must be a TLSConfig or None, not {type(tls).__name__}")
        self._tls = tls
        self._token = check_token(token)
        if not isinstance(max_workers, int) or max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be a positive int, not {max_workers!r}")
        if not isinstance(chunk_bytes, int) or not 1024 <= chunk_bytes <= 64 << 20:
            raise InvalidArgumentError(
                f"chunk_bytes must be an int in [1 KiB, 64 MiB], not {chunk_bytes!r}"
            )
        self._max_workers = max_workers
        self._chunk_bytes = chunk_bytes
        self._cache_ttl = float(cache_ttl)
        self._cache_entries = int(cache_entries)
        self._cache_bytes = int(cache_bytes)
        self._max_concurrent_rpcs = max_concurrent_rpcs
        for name, value in (
            ("max_waiting", max_waiting),
            ("max_waiting_per_peer", max_waiting_per_peer),
            ("max_connections", max_connections),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")
        for name, seconds in (("max_wait", max_wait), ("handshake_timeout", handshake_timeout)):
            if not isinstance(seconds, (int, float)) or not 0 < seconds < 1e6:
                raise InvalidArgumentError(f"{name} must be seconds > 0, not {seconds!r}")
        self._max_waiting = max_waiting
        self._max_waiting_per_peer = max_waiting_per_peer
        self._max_wait = float(max_wait)
        self._handshake_timeout = float(handshake_timeout)
        self._max_connections = max_connections

        self._lock = threading.Lock()  # guards the lifecycle fields below (not the loop state)
        self._state = "new"  # new -> running -> stopped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None
        self._pid = os.getpid()

        # Loop-thread state: touched only from the server's event loop.
        self._stopping = False
        self._waiters: set[_Waiter] = set()  # not yet settled
        self._cache: OrderedDict[_CacheKey, _Waiter] = OrderedDict()  # by request_id, oldest first
        self._by_rid: dict[int, list[_CacheKey]] = {}  # request_id -> its cache keys (O(1) acks)
        # Entries holding a delivered value, oldest first (= first to expire).
        self._delivered: OrderedDict[_CacheKey, None] = OrderedDict()
        self._parked = 0  # calls waiting for a value
        self._parked_by_peer: dict[str, int] = {}
        self._cached_bytes = 0
        self._answered: OrderedDict[int, None] = OrderedDict()  # request_ids given a value
        self._released: OrderedDict[int, None] = OrderedDict()  # request_ids given up
        self._stats = {
            "calls": 0,
            "values_served": 0,
            "bytes_served": 0,
            "cache_hits": 0,
            "errors": 0,
            "requeued": 0,
        }

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The bound ``host:port`` (the real port when bound to port 0); raise before start."""
        if self._address is None:
            raise InvalidArgumentError("RpcServer.address is known only after start()")
        return self._address

    def start(self) -> RpcServer:
        """Bind and start serving; block until listening (or raise). Idempotent while running.

        Raises ``UnavailableError`` when the address cannot be bound (in use, not local),
        ``InvalidArgumentError`` after ``stop()``.
        """
        with self._lock:
            if self._state == "running":
                return self
            if self._state == "stopped":
                raise InvalidArgumentError(
                    "RpcServer cannot be restarted after stop(); make a new one"
                )
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=self._run_loop,
                args=(loop,),
                name=f"shmrdv-rpc-server {self._bind}",
                daemon=True,
            )
            self._loop, self._thread = loop, thread
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._max_workers, thread_name_prefix="shmrdv-rpc-encode"
            )
            thread.start()
            try:
                port = asyncio.run_coroutine_threadsafe(self._astart(), loop).result(
                    _STARTUP_TIMEOUT
                )
            except BaseException:
                self._state = "stopped"
                self._shutdown_threads()
                raise
            self._address = f"{self._host}:{port}"
            self._state = "running"
            self._pid = os.getpid()
            _RUNNING.add(self)
        _log.info("shmrdv RPC server for %s listening on %s", self._source.task, self._address)
        return self

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _astart(self) -> int:
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", _MAX_SEND_BYTES),
            ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
            # gRPC sets SO_REUSEPORT by default: a second server on a taken port would
            # "bind" and silently share it. Binding must fail instead.
            ("grpc.so_reuseport", 0),
            # Let clients keep idle-call connections alive with pings (client.py).
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            # Shed what hostile or broken clients leave open (issue 12 §4): connections
            # stuck before the handshake, idle ones (no call for a minute), half-open ones
            # (a keepalive ping unanswered for 20 s), and any beyond the cap.
            ("grpc.server_handshake_timeout_ms", int(self._handshake_timeout * 1000)),
            ("grpc.max_connection_idle_ms", 60_000),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.max_allowed_incoming_connections", self._max_connections),
        ]
        interceptors = [TokenInterceptor(self._token)] if self._token is not None else []
        server = grpc.aio.server(
            options=options,
            interceptors=interceptors,
            maximum_concurrent_rpcs=self._max_concurrent_rpcs,
        )
        shmrdv_methods = {
            "RecvTensorStream": grpc.unary_stream_rpc_method_handler(self._recv_tensor_stream),
            "ReleaseRecv": grpc.unary_unary_rpc_method_handler(self._release_recv),
            "RecvTensorInline": grpc.unary_unary_rpc_method_handler(self._recv_tensor_inline),
            "Exchange": grpc.stream_stream_rpc_method_handler(self._exchange),
        }
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    TF_SERVICE,
                    {
                        "RecvTensor": grpc.unary_unary_rpc_method_handler(self._recv_tensor),
                        "GetStatus": grpc.unary_unary_rpc_method_handler(self._get_status),
                        "MarkRecvFinished": grpc.unary_unary_rpc_method_handler(
                            self._mark_recv_finished
                        ),
                    },
                ),
                grpc.method_handlers_generic_handler(SHMRDV_SERVICE, shmrdv_methods),
            ]
        )
        try:
            if self._tls is not None:
                port = server.add_secure_port(self._bind, self._tls.server_credentials())
            else:
                port = server.add_insecure_port(self._bind)
        except RuntimeError as e:
            raise UnavailableError(f"shmrdv RPC server cannot listen on {self._bind}: {e}") from e
        if not port:
            raise UnavailableError(f"shmrdv RPC server cannot listen on {self._bind}")
        await server.start()
        self._server = server
        return int(port)

    def stop(self, grace: float | None = 0.0) -> None:
        """Stop serving; block until the server's threads have ended. Idempotent.

        Calls waiting for a value fail at once with ``UNAVAILABLE`` (their waiters are
        removed from the source); calls already streaming a value get ``grace`` seconds
        to finish before they are cancelled.
        """
        with self._lock:
            if self._state != "running":
                self._state = "stopped"
                return
            self._state = "stopped"
            _RUNNING.discard(self)
            if os.getpid() != self._pid:
                # A forked child: the server's thread and gRPC state stayed in the parent.
                # Touching them here would hang; the parent's server is the parent's.
                self._loop = self._thread = self._pool = None
                self._server = None
                return
            loop = self._loop
            assert loop is not None
            try:
                asyncio.run_coroutine_threadsafe(self._astop(grace), loop).result(
                    (grace or 0.0) + _STARTUP_TIMEOUT
                )
            except Exception:
                _log.exception("stopping the shmrdv RPC server on %s", self._address)
            self._shutdown_threads()
        _log.info("shmrdv RPC server on %s stopped", self._address)

    async def _astop(self, grace: float | None) -> None:
        self._stopping = True
        error = UnavailableError(
            f"shmrdv RPC server {self._address} ({self._source.task}) is stopping"
        )
        for waiter in list(self._waiters):
            if waiter.canceller is not None:
                waiter.canceller()
            self._settle(waiter, error, None)
        self._cache.clear()
        self._by_rid.clear()
        self._delivered.clear()
        self._cached_bytes = 0
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    def _shutdown_threads(self) -> None:
        loop, thread, pool = self._loop, self._thread, self._pool
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()
        if pool is not None:
            pool.shutdown(wait=True)
        self._loop = self._thread = self._pool = None

    def close(self) -> None:
        """``stop(grace=0)``; idempotent."""
        self.stop(0.0)

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters: calls, values and bytes served, cache hits, errors, waiting, cached."""
        out = dict(self._stats)
        out["waiting"] = len(self._waiters)
        out["cached"] = len(self._cache)
        out["cached_bytes"] = self._cached_bytes
        out["parked"] = self._parked
        return out

    def __repr__(self) -> str:
        where = self._address or self._bind
        return f"<shmrdv RpcServer {self._state} {where} task={self._source.task}>"

    # -- cache control (called by the Worker, any thread) --------------------------------

    def drop_step(self, step_id: int) -> None:
        """Forget cached responses of ``step_id`` (TensorFlow: on CleanupGraph). Never blocks."""
        self._call_in_loop(self._drop_step, step_id)

    def _call_in_loop(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us: nothing left to drop
            pass

    def _drop_step(self, step_id: int) -> None:
        for ck in [ck for ck in self._cache if ck[1] == step_id]:
            self._uncache(ck, give_back=False)  # the step is gone: nothing to give back to

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
        try:
            data = await self._encode(waiter, received)
            waiter.sent = True
        except RendezvousError as e:
            await self._abort(context, e)
        finally:
            self._done_serving(waiter)
        self._count_served(received)
        return data

    async def _encode(self, waiter: _Waiter, received: Received, *, request_id: int = 0) -> bytes:
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
                self._finished(rid)
            waiter, received = await self._wait_value(req, context.time_remaining(), context)
        except RendezvousError as e:
            await self._abort(context, e)
        try:
            limit = DEFAULT_INLINE_MAX if req.inline_max < 0 else req.inline_max
            limit = min(limit, tensors.MAX_INLINE_BYTES)  # beyond it: only a stream can carry it
            if waiter.cache_key is not None and received.value.nbytes > limit:
                waiter.deferred = True
                return b""  # still cached and not sent: the stream call takes it from there
            data = await self._encode(waiter, received)
            waiter.sent = True
        except RendezvousError as e:
            await self._abort(context, e)
        finally:
            self._done_serving(waiter)
        self._count_served(received)
        return data

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

    def _done_serving(self, waiter: _Waiter) -> None:
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
                self._finished(rid)
            if req.cancel:
                task = wants.pop(req.request_id, None)
                self._release(req.request_id)
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
        try:
            rid = messages.decode_mark_recv_finished(request)
        except RendezvousError as e:
            await self._abort(context, e)
        self._finished(rid)
        return b""

    def _finished(self, rid: int) -> None:
        """The client has the response of request ``rid``: drop it from the cache."""
        if rid:
            for ck in self._cached_for(rid):
                self._cache[ck].sent = True
                self._uncache(ck)

    async def _release_recv(
        self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """shmrdv's ReleaseRecv: the client cancelled this request_id and will not retry.

        A value already taken for it and not delivered goes back to its key now instead of
        waiting in the cache until it expires. Same message as MarkRecvFinished.
        """
        try:
            rid = messages.decode_mark_recv_finished(request)
        except RendezvousError as e:
            await self._abort(context, e)
        self._release(rid)
        return b""

    def _release(self, rid: int) -> None:
        """The client gave request ``rid`` up: a value taken for it and not delivered goes
        back to its key (now, or when the call serving it ends)."""
        if rid:
            self._released[rid] = None
            if len(self._released) > _ANSWERED_IDS:
                self._released.popitem(last=False)
            for ck in self._cached_for(rid):
                self._cache[ck].released = True
                self._uncache(ck)

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
    ) -> tuple[_Waiter, Received]:
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

    def _find_or_start(self, req: messages.RecvRequest, pk: ParsedKey) -> _Waiter:
        cache_key: _CacheKey | None = None
        if req.request_id != 0:
            cache_key = (req.request_id, req.step_id, pk.full_key)
            self._expire()
            found = self._cache.get(cache_key)
            if found is not None:
                if found.future.done():
                    self._stats["cache_hits"] += 1
                return found
            if req.request_id in self._released:
                cache_key = None  # the client gave this id up: never cache under it
            elif req.request_id in self._answered:
                # TensorFlow (RecentRequestIds) answers every repeated id so: without it a
                # retry would wait for, and steal, the key's next value.
                raise AbortedError(
                    f"RecvTensor request_id {req.request_id} for key {pk.full_key!r} (step "
                    f"{req.step_id}) was already answered on {self._source.task} and its "
                    "response is no longer cached; the value cannot be sent again"
                )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Received] = loop.create_future()
        fut.add_done_callback(_retrieve)
        waiter = _Waiter(cache_key, fut, req.step_id, pk)

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
            self._cache[cache_key] = waiter
            self._by_rid.setdefault(cache_key[0], []).append(cache_key)
        return waiter

    def _settle(
        self, waiter: _Waiter, error: BaseException | None, received: Received | None
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
                self._uncache(waiter.cache_key)
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
                self._cache_pop(waiter.cache_key)
            self._maybe_give_back(waiter)
            return
        if waiter.cache_key is not None:
            self._answered[waiter.cache_key[0]] = None
            if len(self._answered) > _ANSWERED_IDS:
                self._answered.popitem(last=False)
        if waiter.cache_key is not None and waiter.cache_key in self._cache:
            waiter.nbytes = received.value.nbytes
            waiter.expires = time.monotonic() + self._cache_ttl
            self._cache.move_to_end(waiter.cache_key)
            self._delivered[waiter.cache_key] = None
            self._cached_bytes += waiter.nbytes
            self._evict()
            # Expiry also runs on every lookup; this timer covers a server that gets none.
            asyncio.get_running_loop().call_later(self._cache_ttl + 0.01, self._expire)

    def _abandon(self, waiter: _Waiter, pk: ParsedKey) -> None:
        """The last call waiting on ``waiter`` left before the value came: remove the waiter."""
        canceller = waiter.canceller
        if canceller is not None and canceller():
            self._waiters.discard(waiter)
            waiter.future.cancel()
            if waiter.cache_key is not None:
                self._uncache(waiter.cache_key)
        # Otherwise the value is already on its way (a race with the cancel): _settle
        # keeps it for a retry (request_id) or gives it back to the source.

    def _uncache(self, cache_key: _CacheKey, *, give_back: bool = True) -> None:
        waiter = self._cache_pop(cache_key)
        if waiter is not None and waiter.future.done():
            self._cached_bytes -= waiter.nbytes
            waiter.nbytes = 0
            if give_back:
                self._maybe_give_back(waiter)

    def _cache_pop(self, cache_key: _CacheKey) -> _Waiter | None:
        waiter = self._cache.pop(cache_key, None)
        self._delivered.pop(cache_key, None)
        if waiter is not None:
            keys = self._by_rid.get(cache_key[0])
            if keys is not None:
                keys.remove(cache_key)
                if not keys:
                    del self._by_rid[cache_key[0]]
        return waiter

    def _cached_for(self, rid: int) -> list[_CacheKey]:
        """The cache keys of request ``rid`` (a copy; O(1), not a scan of the cache)."""
        return list(self._by_rid.get(rid, ()))

    def _maybe_give_back(self, waiter: _Waiter) -> None:
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

    def _give_back(self, waiter: _Waiter) -> None:
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

    def _expire(self) -> None:
        """Drop delivered entries whose time is up: the oldest first, stopping at the first
        that is not (they expire in the order they were delivered): O(1) per call."""
        now = time.monotonic()
        while self._delivered:
            ck = next(iter(self._delivered))
            waiter = self._cache.get(ck)
            if waiter is None:
                del self._delivered[ck]
            elif waiter.expires > now:
                return
            else:
                self._uncache(ck)

    def _evict(self) -> None:
        """Drop the oldest delivered entries beyond the count or byte budget (waiting calls
        are bounded on their own: ``max_waiting``)."""
        self._expire()
        if len(self._delivered) <= self._cache_entries and self._cached_bytes <= self._cache_bytes:
            return
        # Not one a call is still answering, nor one left for the client's stream.
        for ck in list(self._delivered):
            if (
                len(self._delivered) <= self._cache_entries
                and self._cached_bytes <= self._cache_bytes
            ):
                break
            w = self._cache.get(ck)
            if w is not None and not (w.deferred or w.joiners or w.serving):
                self._uncache(ck)
