"""RpcServer: the server consumers on other hosts pull a worker's values from.

A grpc.aio server on its own loop thread, answering from an ``outbox.Outbox``:
``RecvTensor`` (the key's next value, or the call parks within ``guard.Limits``; a large
value's first chunk, then by offset), ``GetStatus``, ``MarkRecvFinished``,
``RecvTensorSeries``. The response cache (TensorFlow's ``GrpcResponseCache``) keeps an
answer for a retry of its request_id until acknowledged, released or ``cache_ttl`` (never
delivered: back to its key); a request_id no longer cached is ``ABORTED``.

Thread model (docs/threads.md): handlers, cache and series live on the loop
("shmrdv-rpc-server"; no lock); ``start``, ``stop`` and ``stats`` from any thread.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._cluster import split_host_port
from .._errors import (
    AbortedError,
    DeadlineExceededError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import DeviceName, ParsedKey
from . import messages
from .guard import Gate, Limits, Parked, TLSConfig, out_of_time, refuse
from .messages import decode_request, whole_message
from .outbox import SERVER_STOPPING, Outbox, Sent, Taker, served_key
from .series import SeriesService

__all__ = ["RpcServer"]

_log = logging.getLogger("shmrdv.rpc.server")
# TensorFlow: SetMaxMessageSize(INT32_MAX) for what it sends; requests are tiny.
_MAX_SEND_BYTES = 2**31 - 1
_MAX_RECEIVE_BYTES = 1 << 20
_STARTUP_TIMEOUT = 30.0
# TensorFlow: RecentRequestIds remembers the last 100,000 request ids.
_ANSWERED_IDS = 100_000


# -- the calls ------------------------------------------------------------------------------

_WAITING, _HELD, _DELIVERED, _GONE = range(4)


class _Entry(Taker):
    """One request (its request_id's cache entry when not 0): parked, holding its value,
    or delivered (kept for a retry until acknowledged or expired)."""

    __slots__ = (
        "calls", "error", "expires", "k", "key", "orphan", "outbox", "released", "rid", "sent",
        "serving", "state",
    )  # fmt: skip

    def __init__(self, outbox: Outbox, rid: int, k: tuple[int, str], key: ParsedKey) -> None:
        self.outbox = outbox
        self.orphan = False  # unparked too late: a value coming now goes back
        self.released = False  # its client gave it up: what it was sent goes back
        self.rid = rid
        self.k = k
        self.key = key
        self.sent: Sent | None = None
        self.error: BaseException | None = None
        self.state = _WAITING
        self.calls: list[asyncio.Future[bool]] = []  # the calls parked on it
        self.serving = 0  # calls answering with its value now
        self.expires = 0.0

    def settle(self, sent: Sent | None, error: BaseException | None) -> None:
        if self.orphan:
            self.state = _GONE
            if sent is not None:
                self.outbox.requeue(sent)
            return
        self.sent, self.error = sent, error
        self.state = _HELD if sent is not None else _GONE
        for call in self.calls:
            if not call.done():
                call.set_result(True)


class RpcServer:
    """A grpc.aio server on its own loop thread answering consumers from an ``Outbox``.

    ``bind`` as given (``127.0.0.1:0`` loopback, ``[::]:port`` every interface; port 0: a
    free one, see ``address``); ``tls``, ``token``, ``limits``: ``guard``. ``start()``
    blocks until it listens; ``stop()`` fails parked calls (``UNAVAILABLE``) and joins.
    """

    def __init__(
        self, bind: str, outbox: Outbox, *, tls: TLSConfig | None = None,
        token: str | None = None, limits: Limits | None = None,
    ) -> None:  # fmt: skip
        try:
            split_host_port(bind)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"bind must be 'host:port' (e.g. '127.0.0.1:0', '[::]:2222'): {e}"
            ) from e
        if tls is not None and not isinstance(tls, TLSConfig):
            raise InvalidArgumentError(f"tls must be a TLSConfig or None, not {type(tls).__name__}")
        if limits is not None and not isinstance(limits, Limits):
            raise InvalidArgumentError(
                f"limits must be a Limits or None, not {type(limits).__name__}"
            )
        self._bind = bind
        self.outbox = outbox
        self._task = DeviceName.parse(outbox.task)
        self._tls = tls
        self._limits = limits = limits or Limits()
        self._gate = Gate(token, limits.first_message_timeout, limits.max_awaiting_request)
        self._lock = threading.Lock()  # the lifecycle fields
        self._state = "new"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._pid = os.getpid()
        self.address: str | None = None
        # The loop's state.
        self._parked = Parked(
            (limits.max_waiting, limits.max_waiting_per_peer, limits.max_waiting_per_connection),
            "calls waiting for values",
            "max_waiting",
        )
        self._cache: dict[int, _Entry] = {}  # by request_id
        self._kept: OrderedDict[int, None] = OrderedDict()  # those with a value, oldest first
        self._cached_bytes = 0
        self._answered: OrderedDict[int, None] = OrderedDict()
        self._released: OrderedDict[int, None] = OrderedDict()
        self._expiry: asyncio.TimerHandle | None = None
        self._stopping: UnavailableError | None = None
        self._stats = dict.fromkeys(
            ("calls", "values_served", "bytes_served", "errors", "cache_hits", "requeued"), 0
        )
        self._series = SeriesService(self.outbox, self.key_of, self._release, limits)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> RpcServer:
        """Bind and serve; block until listening. ``UnavailableError`` when the address
        cannot be bound, ``InvalidArgumentError`` after ``stop()``."""
        with self._lock:
            if self._state == "running":
                return self
            if self._state == "stopped":
                raise InvalidArgumentError(
                    "RpcServer cannot be restarted after stop(); make a new one"
                )
            loop = self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=loop.run_forever, name=f"shmrdv-rpc-server {self._bind}", daemon=True
            )
            self._thread.start()
            try:
                port = asyncio.run_coroutine_threadsafe(self._astart(), loop).result(
                    _STARTUP_TIMEOUT
                )
            except BaseException:
                self._state = "stopped"
                self._join()
                raise
            self.address = f"{self._bind.rpartition(':')[0]}:{port}"
            self._state = "running"
            _RUNNING.add(self)
        _log.info("shmrdv RPC server for %s listening on %s", self.outbox.task, self.address)
        return self

    async def _astart(self) -> int:
        limits = self._limits
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", _MAX_SEND_BYTES),
            ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail to bind
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            # Shed what hostile or broken clients leave open: connections stuck before the
            # handshake, idle ones, half-open ones, and any beyond the cap.
            ("grpc.server_handshake_timeout_ms", int(limits.handshake_timeout * 1000)),
            ("grpc.max_connection_idle_ms", 60_000),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.max_allowed_incoming_connections", limits.connections()),
            # Calls that arrived and the loop has not started yet: gRPC cancels those beyond
            # (the client calls again). Each costs memory, a flood too: 4,096 (gRPC's
            # 1,000 makes a burst of 10,000 parked receives retry a third of its calls).
            ("grpc.server.max_pending_requests", 4096),
            ("grpc.server.max_pending_requests_hard_limit", 8192),
        ]
        server = grpc.aio.server(
            options=options, maximum_concurrent_rpcs=limits.max_concurrent_rpcs
        )
        # Every handler takes a request stream: it runs when the call's headers arrive,
        # and the gate reads the request (``guard.Gate``).
        unary = grpc.stream_unary_rpc_method_handler
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    messages.TF_SERVICE,
                    {
                        "RecvTensor": unary(self._recv_tensor),
                        "GetStatus": unary(self._get_status),
                        "MarkRecvFinished": unary(self._mark_recv_finished),
                    },
                ),
                grpc.method_handlers_generic_handler(
                    messages.SHMRDV_SERVICE,
                    {"RecvTensorSeries": grpc.stream_stream_rpc_method_handler(self._serve_series)},
                ),
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
        where = f"{self._bind.rpartition(':')[0]}:{port}"
        self.outbox.serve_from(asyncio.get_running_loop())
        self._gate.started(where)
        await server.start()
        self._server = server
        return int(port)

    def stop(self, grace: float | None = 0.0) -> None:
        """Stop serving and join the thread (idempotent): parked calls fail at once with
        ``UNAVAILABLE``; calls sending a value get ``grace`` seconds."""
        with self._lock:
            if self._state != "running":
                self._state = "stopped"
                return
            self._state = "stopped"
            _RUNNING.discard(self)
            if os.getpid() != self._pid:  # a forked child: the server is the parent's
                self._loop = self._thread = self._server = None
                return
            assert self._loop is not None
            try:
                asyncio.run_coroutine_threadsafe(self._astop(grace), self._loop).result(
                    (grace or 0.0) + _STARTUP_TIMEOUT
                )
            except Exception:
                _log.exception("stopping the shmrdv RPC server on %s", self.address)
            self._join()
        _log.info("shmrdv RPC server on %s stopped", self.address)

    async def _astop(self, grace: float | None) -> None:
        self._stopping = UnavailableError(
            f"shmrdv RPC server {self.address} ({self.outbox.task}) {SERVER_STOPPING}"
        )
        for entry in list(self._cache.values()):
            if entry.state == _WAITING:
                self.outbox.cancel(entry.k[0], entry.key, entry)
                entry.settle(None, self._stopping)
        self._series.stop(self._stopping)
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        self._gate.close()

    def _join(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()
        if loop is not None and not loop.is_closed():
            loop.close()
        self._loop = self._thread = None

    def close(self) -> None:
        self.stop(0.0)

    def __enter__(self) -> RpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<shmrdv RpcServer {self._state} {self.address or self._bind} task={self.outbox.task}>"
        )

    def stats(self) -> dict[str, int]:
        """Counters (a snapshot, from any thread)."""
        out = {**self._stats, "parked": self._parked.total, "cached": len(self._kept)}
        out["cached_bytes"] = self._cached_bytes
        out.update(self._series.stats())
        out.update(self._gate.stats())
        return out

    # -- RecvTensor (the loop) -------------------------------------------------------------

    def key_of(self, key: str) -> ParsedKey:
        return served_key(key, self._task, self.outbox.task, self.outbox.incarnation)

    async def _recv_tensor(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """TensorFlow's unary RecvTensor (the module docstring)."""
        request = await self._gate.admit(context)
        self._stats["calls"] += 1
        try:
            req = decode_request(request)
            for rid in req.finished:
                self.finished(rid)
            for rid in req.released:
                self._release(rid)
            if self._stopping is not None:
                raise self._stopping
            entry = self._entry(req.request_id, req.step_id, req.rendezvous_key)
        except RendezvousError as e:
            await self._abort(context, e)
        if entry.state == _WAITING:
            await self._park(entry, context)
        sent = entry.sent
        if sent is None:
            error = entry.error
            if isinstance(error, RendezvousError):
                await self._abort(context, error)
            await self._abort(context, ResourceExhaustedError(f"RecvTensor: {error!r}"))
        self._keep(entry)
        chunks = sent.encoded.chunks
        try:
            if req.offset:
                answer = sent.encoded.chunk_at(req.offset)
                if answer is None:
                    raise InvalidArgumentError(
                        f"no chunk at offset {req.offset} of {entry.key.full_key!r}"
                    )
            else:
                answer = chunks[0] if req.chunks and entry.rid else whole_message(sent.encoded)
        except RendezvousError as e:
            await self._abort(context, e)
        whole = not req.offset and (len(chunks) == 1 or not (req.chunks and entry.rid))
        entry.serving += 1
        context.add_done_callback(lambda ctx: self._call_ended(entry, ctx, whole))
        self._stats["values_served"] += not req.offset
        self._stats["bytes_served"] += len(answer)
        return answer

    def _entry(self, rid: int, step_id: int, key: str) -> _Entry:
        """The request's entry: its cached one, or a new one holding the key's next value
        if it is there, else parked in the outbox."""
        if rid:
            entry = self._cache.get(rid)
            if entry is not None:
                self._stats["cache_hits"] += entry.state != _WAITING
                return entry
            if rid in self._released:
                raise AbortedError(f"RecvTensor request_id {rid} was released by its client")
            if rid in self._answered:
                raise AbortedError(
                    f"RecvTensor request_id {rid} for key {key!r} (step {step_id}) was already "
                    f"answered on {self.outbox.task} and its response is no longer cached; the "
                    "value cannot be sent again"
                )
        pk = self.key_of(key)
        entry = _Entry(self.outbox, rid, (step_id, pk.full_key), pk)
        sent = self.outbox.take(step_id, pk, entry)
        if sent is not None:
            entry.settle(sent, None)
        if rid:
            self._cache[rid] = entry
        return entry

    def _keep(self, entry: _Entry) -> None:
        """``entry`` has (or is about to get) its value: kept for retries until acknowledged,
        released, evicted (the cache's bounds) or ``cache_ttl`` passes."""
        rid = entry.rid
        if rid and rid not in self._kept and self._cache.get(rid) is entry:
            self._kept[rid] = None
            entry.expires = time.monotonic() + self._limits.cache_ttl
            self._expire_later()
            self._evict()

    async def _park(self, entry: _Entry, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Wait for ``entry``'s value within the bounds on parked calls, up to the call's
        deadline or ``max_wait``; a call leaving last unparks the entry."""
        peer = context.peer()
        why = self._parked.refusal(peer)
        if why is not None:
            self._leave(entry)
            await self._abort(
                context,
                ResourceExhaustedError(
                    f"RecvTensor on {self.outbox.task}: {why}; key {entry.key.full_key!r} refused"
                ),
            )
        remaining = context.time_remaining()
        timeout = (
            self._limits.max_wait if remaining is None else min(remaining, self._limits.max_wait)
        )
        loop = asyncio.get_running_loop()
        call: asyncio.Future[bool] = loop.create_future()
        entry.calls.append(call)
        timer = loop.call_later(timeout, out_of_time, call)
        self._parked.add(peer, 1)
        try:
            settled = await call
        finally:
            timer.cancel()
            self._parked.add(peer, -1)
            entry.calls.remove(call)
            if entry.state == _WAITING and not entry.calls:
                self._leave(entry)
        if not settled:
            await self._abort(
                context,
                DeadlineExceededError(
                    f"RecvTensor on {self.outbox.task}: no value for key {entry.key.full_key!r} "
                    f"(step {entry.k[0]}) before the call's deadline; the waiter was removed"
                ),
            )

    def _leave(self, entry: _Entry) -> None:
        """The last call parked on ``entry`` left: unpark it (a value on its way stays
        cached for a retry, or goes back at once without a request_id)."""
        if self.outbox.cancel(entry.k[0], entry.key, entry):
            entry.state = _GONE
            self._cache.pop(entry.rid, None)
        elif not entry.rid:
            entry.orphan = True
        else:
            self._keep(entry)  # the value on its way is kept for a retry, or expires

    def _call_ended(self, entry: _Entry, context: Any, whole: bool) -> None:
        """A call that answered with ``entry``'s value ended: delivered if it ended well
        (a chunked value: once acknowledged), else kept for a retry (or back to its key)."""
        entry.serving -= 1
        if not context.cancelled() and not entry.released:
            if whole:
                self._delivered(entry)
        elif not entry.rid or entry.rid not in self._cache:  # no retry can claim it
            self._give_back(entry)

    def _delivered(self, entry: _Entry) -> None:
        if entry.state != _HELD:
            return
        entry.state = _DELIVERED
        assert entry.sent is not None
        self.outbox.release(entry.sent)
        if entry.rid:
            self._answered[entry.rid] = None
            if len(self._answered) > _ANSWERED_IDS:
                self._answered.popitem(last=False)
            if entry.rid in self._cache:
                self._cached_bytes += entry.sent.encoded.nbytes
                self._evict()

    def _give_back(self, entry: _Entry) -> None:
        """A value no call delivered goes back to its key's head."""
        if entry.state in (_HELD, _DELIVERED) and not entry.serving:
            entry.state = _GONE
            assert entry.sent is not None
            self.outbox.requeue(entry.sent)
            self._stats["requeued"] += 1

    def finished(self, rid: int) -> None:
        """An ack: the client has ``rid``'s value (TensorFlow's MarkRecvFinished)."""
        entry = self._cache.get(rid)
        if entry is not None:
            self._delivered(entry)
            self._uncache(rid)

    def _release(self, rid: int) -> None:
        """The client gave ``rid`` up: a value taken for it goes back now."""
        self._released[rid] = None
        if len(self._released) > _ANSWERED_IDS:
            self._released.popitem(last=False)
        entry = self._cache.get(rid)
        if entry is not None:
            entry.released = True
            self._uncache(rid)

    def _uncache(self, rid: int, *, give_back: bool = True) -> None:
        """Drop ``rid``'s entry: a value it holds that no call delivered (or that its
        client released) goes back to its key, unless its step is gone (``give_back``)."""
        entry = self._cache.pop(rid, None)
        self._kept.pop(rid, None)
        if entry is None:
            return
        if entry.state == _DELIVERED:
            assert entry.sent is not None
            self._cached_bytes -= entry.sent.encoded.nbytes
            if not (entry.released and give_back):
                entry.state = _GONE
                return
        if entry.state == _WAITING:
            if self.outbox.cancel(entry.k[0], entry.key, entry):
                entry.settle(None, AbortedError(f"request_id {rid} was released"))
            else:
                entry.orphan = give_back
        elif give_back:
            self._give_back(entry)
        else:
            entry.state = _GONE

    def _evict(self) -> None:
        """The oldest kept values no call is answering go, beyond the cache's bounds."""
        limits = self._limits
        if len(self._kept) <= limits.cache_entries and self._cached_bytes <= limits.cache_bytes:
            return
        for rid in list(self._kept):
            if len(self._kept) <= limits.cache_entries and self._cached_bytes <= limits.cache_bytes:
                return
            entry = self._cache[rid]
            if entry.state != _WAITING and not entry.serving and not entry.calls:
                self._uncache(rid)

    def _expire_later(self) -> None:
        loop = self._loop
        if self._expiry is None and loop is not None:
            self._expiry = loop.call_later(self._limits.cache_ttl / 2, self._expire)

    def _expire(self) -> None:
        """Kept values older than ``cache_ttl`` go, oldest first (one never delivered back
        to its key); then again while any is kept."""
        self._expiry = None
        now = time.monotonic()
        for rid in list(self._kept):
            entry = self._cache[rid]
            if entry.expires > now:
                break
            if entry.state != _WAITING and not entry.serving:
                self._uncache(rid)
        if self._kept:
            self._expire_later()

    # -- the other methods -----------------------------------------------------------------

    async def _get_status(self, _: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """TensorFlow's GetStatus: the worker's one CPU device and its incarnation."""
        await self._gate.admit(context)
        device = messages.DeviceAttributes(
            f"{self._task.task_part}/device:CPU:0", "CPU", incarnation=self.outbox.incarnation
        )
        return messages.encode_status([device])

    async def _mark_recv_finished(
        self, _: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """TensorFlow's MarkRecvFinished: the client has the response (drop it), or, with
        shmrdv's fields, gave it up, or holds a series' first ``held`` values."""
        request = await self._gate.admit(context)
        try:
            rid, released, held = messages.decode_finished(request)
            if not self._series.finished(rid, released, held):
                if released:
                    self._release(rid)
                else:
                    self.finished(rid)
        except RendezvousError as e:
            await self._abort(context, e)
        return b""

    async def _serve_series(
        self, _: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        request = await self._gate.admit(context)
        async for message in self._series.serve(request, context):
            yield message

    async def _abort(
        self, context: grpc.aio.ServicerContext[Any, Any], error: BaseException
    ) -> NoReturn:
        self._stats["errors"] += 1
        await refuse(context, error)


# Servers running at interpreter exit are stopped first, so that gRPC's threads do not die
# under a running loop.
_RUNNING: weakref.WeakSet[RpcServer] = weakref.WeakSet()


@atexit.register
def _stop_running_servers() -> None:
    for server in list(_RUNNING):
        server.stop(0.0)
