"""RpcServer: the server lifecycle of the gRPC transport (TensorFlow's worker service).

It owns the ``grpc.aio`` server, its event-loop thread and the encoding pool: the
options (message limits, keepalive, connection shedding), the bounds it validates, and
``start``/``stop``. What the calls do is ``service.RecvService`` (the handlers, with
``waits.Waits``: calls matched with values, and ``response_cache.ResponseCache``); ``methods`` names the methods.

Hostile or broken clients cannot exhaust it (issues 12 and 19 §4), with or without the
token: ``waits`` bounds waiting calls; ``limits.ServerLimits`` caps connections well
below the descriptor limit and calls in flight; ``request_gate.RequestGate`` drops a call
that sends no request message soon after opening; gRPC sheds connections that never
finish their handshake, idle ones and half-open ones.

Thread model (docs/threads.md): a ``grpc.aio`` server runs on its own event loop in one thread
("shmrdv-rpc-server"); every handler and all of the service's bookkeeping live in that
loop. ``start``, ``stop``, ``drop_step`` and ``stats`` may be called from any thread;
the lifecycle fields are guarded by a lock, and ``drop_step`` is handed to the loop.
Large unary responses are encoded in a bounded thread pool (``max_workers``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
import weakref
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from .._cluster import split_host_port
from .._errors import InvalidArgumentError, UnavailableError
from .._keys import DeviceName
from .limits import ServerLimits
from .methods import DEFAULT_CHUNK_BYTES, SERVER_STOPPING
from .request_gate import RequestGate
from .security import TLSConfig, TokenInterceptor, check_token
from .series_service import SeriesLimits, SeriesService
from .service import RecvService
from .tensor_source import TensorSource
from .waits import WaitLimits

__all__ = ["RpcServer", "TensorSource"]

_log = logging.getLogger("shmrdv.rpc.server")

# TensorFlow: the server calls SetMaxMessageSize(INT32_MAX) (research §3.4). Requests are
# tiny, so the receive limit stays small: a peer must not make us allocate 2 GiB.
_MAX_SEND_BYTES = 2**31 - 1
_MAX_RECEIVE_BYTES = 1 << 20

_STARTUP_TIMEOUT = 30.0


# Servers still running at interpreter exit are stopped first, so that gRPC's threads do
# not die under a running event loop (their daemon thread would be killed mid-call).
_RUNNING: weakref.WeakSet[RpcServer] = weakref.WeakSet()


@atexit.register
def _stop_running_servers() -> None:
    for server in list(_RUNNING):
        server.stop(0.0)


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
        limits: connections and calls in flight (beyond: refused), and how long a call
            may take to send its request message (``ServerLimits``).
        max_waiting, max_waiting_per_peer, max_waiting_per_connection: most calls waiting
            for a value, in all, from one peer host and on one connection; beyond:
            ``RESOURCE_EXHAUSTED`` (never for a value that is already there).
        max_wait: longest wait for a value of a call without a deadline (or a later one);
            then ``DEADLINE_EXCEEDED`` (shmrdv clients ask again).
        series: ``RecvTensorSeries``' idle end and bounds (``SeriesLimits``).
        handshake_timeout: a connection that has not finished its HTTP/2 (and TLS)
            handshake within this many seconds is closed.

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
        limits: ServerLimits | None = None,
        max_waiting: int = 65_536,
        max_waiting_per_peer: int = 32_768,
        max_waiting_per_connection: int = 16_384,
        max_wait: float = 300.0,
        handshake_timeout: float = 10.0,
        series: SeriesLimits | None = None,
    ) -> None:
        self._host, self._port = _split_bind(bind)
        self._bind = bind
        self._source = source
        try:
            task = DeviceName.parse(source.task)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"TensorSource.task {source.task!r} is not a task name: {e}"
            ) from e
        if not task.has_task:
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
        if limits is not None and not isinstance(limits, ServerLimits):
            raise InvalidArgumentError(
                f"limits must be a ServerLimits or None, not {type(limits).__name__}"
            )
        self._limits = ServerLimits() if limits is None else limits
        for name, value in (
            ("max_waiting", max_waiting),
            ("max_waiting_per_peer", max_waiting_per_peer),
            ("max_waiting_per_connection", max_waiting_per_connection),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")
        for name, seconds in (("max_wait", max_wait), ("handshake_timeout", handshake_timeout)):
            if not isinstance(seconds, (int, float)) or not 0 < seconds < 1e6:
                raise InvalidArgumentError(f"{name} must be seconds > 0, not {seconds!r}")
        self._handshake_timeout = float(handshake_timeout)
        self._gate: RequestGate | None = None

        self._lock = threading.Lock()  # guards the lifecycle fields below (not the loop state)
        self._state = "new"  # new -> running -> stopped
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None
        self._pid = os.getpid()

        # The handlers and their state: touched only from the server's event loop.
        waits = WaitLimits(
            cache_ttl,
            cache_entries,
            cache_bytes,
            max_waiting,
            max_waiting_per_peer,
            max_waiting_per_connection,
            max_wait,
        )
        self._service = RecvService(source, task, chunk_bytes=chunk_bytes, limits=waits)
        if series is not None and not isinstance(series, SeriesLimits):
            raise InvalidArgumentError(f"series must be a SeriesLimits, not {series!r}")
        self._series = SeriesService(
            source, task, chunk_bytes=chunk_bytes, limits=series or SeriesLimits()
        )

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
            # Connections beyond the cap are closed at accept: they can never take the
            # descriptors the rest of the process needs (issue 19 §4).
            ("grpc.max_allowed_incoming_connections", self._limits.connections()),
        ]
        # The token is checked first, as soon as a call's headers arrive; the gate then
        # reads the request message under its deadline.
        self._gate = RequestGate(
            self._limits.first_message_timeout, self._limits.max_awaiting_request
        )
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self._token is not None:
            interceptors.append(TokenInterceptor(self._token))
        interceptors.append(self._gate)
        server = grpc.aio.server(
            options=options,
            interceptors=interceptors,
            maximum_concurrent_rpcs=self._limits.max_concurrent_rpcs,
        )
        server.add_generic_rpc_handlers([*self._service.handlers(), self._series.handler()])
        try:
            if self._tls is not None:
                port = server.add_secure_port(self._bind, self._tls.server_credentials())
            else:
                port = server.add_insecure_port(self._bind)
        except RuntimeError as e:
            raise UnavailableError(f"shmrdv RPC server cannot listen on {self._bind}: {e}") from e
        if not port:
            raise UnavailableError(f"shmrdv RPC server cannot listen on {self._bind}")
        assert self._pool is not None
        self._service.started(f"{self._host}:{port}", self._pool)
        self._series.started(f"{self._host}:{port}")
        self._gate.started(f"{self._host}:{port}")
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
        stopping = UnavailableError(
            f"shmrdv RPC server {self._address} ({self._source.task}) {SERVER_STOPPING}"
        )
        self._service.stop_serving(stopping)
        self._series.stop_serving(stopping)
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        if self._gate is not None:
            self._gate.close()

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
        """Counters: calls, values and bytes served, cache hits, errors, waiting, cached;
        calls awaiting their request message and those dropped for keeping silent
        (``RequestGate.stats``). Read from any thread: a snapshot, not a transaction."""
        out = self._service.stats()
        out.update(self._series.stats())
        gate = self._gate
        if gate is not None:
            out.update(gate.stats())
        return out

    def __repr__(self) -> str:
        where = self._address or self._bind
        return f"<shmrdv RpcServer {self._state} {where} task={self._source.task}>"

    # -- cache control (called by the Worker, any thread) --------------------------------

    def drop_step(self, step_id: int) -> None:
        """Forget cached responses of ``step_id`` (TensorFlow: on CleanupGraph). Never blocks.

        With nothing cached (a consumer's cleanup, say) the loop is not woken: a wake-up
        costs the cleaning thread a GIL hand-off. A response cached meanwhile goes with
        its ack or its ttl."""
        if self._service.caches_any():
            self._call_in_loop(self._service.drop_step, step_id)

    def _call_in_loop(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed under us: nothing left to drop
            pass
