"""RpcClient: the consumer side of the gRPC transport (TensorFlow's RpcRecvTensorCall).

``start_recv`` pulls the next value of a key from the producer's worker: it calls
``RecvTensorStream`` on the peer with a fresh random non-zero ``request_id`` and
assembles the chunks into one array (one copy). The call is TensorFlow's
``RecvFromRemoteAsync`` (research/tf_rendezvous.md §3.1) with two additions:

* a transient ``UNAVAILABLE`` (peer not up yet, connection refused or reset before any
  data came) is retried with backoff (50 ms doubling to 1 s) and the *same*
  ``request_id``, until the caller cancels or its ``timeout`` expires. The server's
  response cache makes that safe: a retry joins the first attempt's waiter or gets its
  delivered value, so a response lost on the wire is not a lost tensor;
* once data is flowing the call can no longer be cancelled (the producer has given the
  value away); a connection lost mid-stream is retried twice (the server still caches
  the value), then fails with ``UnavailableError``. No partial array is ever delivered.

Thread model: the sync gRPC API, one daemon thread ("shmrdv-rpc-recv") per receive in
flight, which ends with the call. (An asyncio channel would need no thread per call,
but grpc.aio does not survive ``fork`` — measured: a forked child's aio calls time out —
while a fresh sync channel in the child works; research/pitfalls.md §6.) ``done`` runs
in that thread, never under a lock, exactly once unless the canceller returned ``True``.

Fork: channels are per process. A client used in a parent and then in a forked child
notices the new pid and opens fresh channels in the child; the parent's are left alone.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc
import grpc._channel

from .._callbacks import DoneCallback, invoke_done
from .._errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import ParsedKey
from .._received import Received
from .._rendezvous import Canceller, as_parsed_key, check_timeout
from .._status import error_for_code
from . import coding
from .security import TLSConfig, bearer_metadata, check_token
from .server import (
    GET_STATUS_METHOD,
    MARK_RECV_FINISHED_METHOD,
    RECV_TENSOR_METHOD,
    RECV_TENSOR_STREAM_METHOD,
    RELEASE_RECV_METHOD,
)

__all__ = ["RpcClient"]

_log = logging.getLogger("shmrdv.rpc.client")

# TensorFlow's channel: GRPC_ARG_MAX_MESSAGE_LENGTH = INT32_MAX and
# GRPC_ARG_MAX_RECONNECT_BACKOFF_MS = 1000 (research §3.4).
_MAX_RECEIVE_BYTES = 2**31 - 1
_MAX_SEND_BYTES = 1 << 20  # requests are tiny
_BASE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", _MAX_SEND_BYTES),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.initial_reconnect_backoff_ms", 50),
    # Notice a peer that vanished without closing the connection (host down, partition)
    # while a call waits; the server permits pings every 5 s (server.py).
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
# HTTP/2 window options were measured and left at gRPC's defaults: a 256 MiB stream over
# loopback in 4 MiB chunks ran at 0.6-1.0 GB/s (best of 6, 2 busy cores) with the defaults
# and within that noise with grpc.http2.lookahead_bytes 16/32/64 MiB, bdp_probe off,
# max_frame_size 16 MiB or write_buffer_size 8 MiB on both ends.
_RETRY_INITIAL = 0.05
_RETRY_MAX = 1.0
_MID_STREAM_RETRIES = 2
_JOIN_TIMEOUT = 5.0
_ACK_TIMEOUT = 5.0

_PENDING, _RECEIVING, _DONE, _CANCELLED = range(4)


def _new_request_id() -> int:
    # TensorFlow: GetUniqueRequestId, a random non-zero int64.
    while True:
        rid = secrets.randbits(63)
        if rid:
            return rid


def _details(e: grpc.RpcError) -> str:
    details = e.details() if hasattr(e, "details") else None
    return details or str(e)


def _code(e: grpc.RpcError) -> grpc.StatusCode:
    code = e.code() if hasattr(e, "code") else None
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


class _StreamRecv:
    """One ``start_recv``: its thread, its state and its canceller."""

    def __init__(
        self,
        client: RpcClient,
        channel: grpc.Channel,
        address: str,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        timeout: float | None,
    ) -> None:
        self._client = client
        self._channel = channel
        self._address = address
        self._step_id = step_id
        self._key = key
        self._done = done
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._request_id = _new_request_id()
        self._lock = threading.Lock()
        self._state = _PENDING
        self._call: Any = None
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shmrdv-rpc-recv", daemon=True)

    @property
    def receiving(self) -> bool:
        """Data is flowing: the receive can no longer be cancelled."""
        return self._state == _RECEIVING

    def _where(self) -> str:
        return f"key {self._key.full_key!r} (step {self._step_id}) from {self._address}"

    # -- called by other threads -------------------------------------------------------

    def cancel(self) -> bool:
        """Stop, and ``done`` is never called (``True``); ``False`` once delivered or failed.

        Also mid-stream: the partial value is dropped here and ``ReleaseRecv`` has the
        server give it back to its key, so a receive whose deadline expires while a
        large tensor is (slowly) arriving does not wait past its deadline.
        """
        with self._lock:
            if self._state not in (_PENDING, _RECEIVING):
                return False
            self._state = _CANCELLED
            call = self._call
        self._wake.set()
        if call is not None:
            call.cancel()
            # The server may have taken the value just now: have it given back to the
            # key's head instead of parked for a retry that will never come.
            self._client._notify(self._channel, RELEASE_RECV_METHOD, self._request_id)
        return True

    def close(self, error: BaseException) -> None:
        """The client closes: fail this receive with ``error`` unless it already finished."""
        with self._lock:
            if self._state in (_DONE, _CANCELLED):
                return
            self._state = _DONE
            call = self._call
        self._wake.set()
        if call is not None:
            call.cancel()
        invoke_done(self._done, error, None)

    # -- the receive thread ---------------------------------------------------------------

    def _deliver(self, error: BaseException | None, received: Received | None) -> None:
        with self._lock:
            if self._state in (_DONE, _CANCELLED):
                return
            self._state = _DONE
        invoke_done(self._done, error, received)

    def _run(self) -> None:
        try:
            self._attempts()
        except BaseException as e:  # a bug here must not leave the caller waiting forever
            _log.exception("RecvTensorStream of %s failed unexpectedly", self._where())
            self._deliver(UnavailableError(f"receiving {self._where()} failed: {e!r}"), None)
        finally:
            self._client._forget(self)

    def _attempts(self) -> None:
        request = coding.encode_request(self._step_id, self._key.full_key, self._request_id)
        method = self._channel.unary_stream(RECV_TENSOR_STREAM_METHOD)
        metadata = self._client._metadata
        backoff = _RETRY_INITIAL
        mid_stream_failures = 0
        last_unavailable: grpc.RpcError | None = None
        while True:
            with self._lock:
                if self._state in (_DONE, _CANCELLED):
                    return
                remaining = None
                if self._deadline is not None:
                    remaining = self._deadline - time.monotonic()
                    if remaining <= 0:
                        break
                call = method(request, timeout=remaining, metadata=metadata)
                self._call = call
            assembler = coding.StreamAssembler()
            delivered = False
            try:
                for message in call:
                    if self._state == _PENDING:
                        with self._lock:
                            if self._state == _CANCELLED:
                                call.cancel()
                                return
                            self._state = _RECEIVING
                    assembler.feed(message)
                    if assembler.complete and not delivered:
                        # Every byte is here: hand it over now rather than after the
                        # call's closing status (one more loopback round); the stream is
                        # then drained, never cancelled (the server would take a cancel
                        # after its last chunk for a value not delivered).
                        delivered = True
                        self._deliver(None, Received(assembler.result(), assembler.is_dead))
                received = Received(assembler.result(), assembler.is_dead)
            except grpc.RpcError as e:
                if delivered:
                    return
                code = _code(e)
                if self._state in (_DONE, _CANCELLED):
                    return
                if code == grpc.StatusCode.UNAVAILABLE and "Too many open files" in _details(e):
                    # Not transient the way a restarting peer is: say what ran out, and
                    # drop the channel so that the next receive, once descriptors are back,
                    # connects afresh instead of inheriting this channel's reconnect backoff.
                    self._client._drop_channel(self._address, self._channel)
                    self._deliver(
                        ResourceExhaustedError(
                            f"cannot connect for {self._where()}: too many open files "
                            f"(ulimit -n): {_details(e)}"
                        ),
                        None,
                    )
                    return
                if code == grpc.StatusCode.UNAVAILABLE:
                    if self._state == _RECEIVING:
                        mid_stream_failures += 1
                        if mid_stream_failures > _MID_STREAM_RETRIES:
                            self._deliver(
                                UnavailableError(
                                    f"lost the connection while receiving {self._where()}; "
                                    f"retried {_MID_STREAM_RETRIES} times: {_details(e)}"
                                ),
                                None,
                            )
                            return
                    last_unavailable = e
                    pause = backoff
                    if self._deadline is not None:
                        pause = max(0.0, min(pause, self._deadline - time.monotonic()))
                    self._wake.wait(pause)
                    backoff = min(backoff * 2, _RETRY_MAX)
                    continue
                self._deliver(self._error(code, e), None)
                return
            except RendezvousError as e:  # the assembler refused what arrived
                call.cancel()
                self._deliver(
                    type(e)(f"bad RecvTensorStream from {self._address} for {self._where()}: {e}"),
                    None,
                )
                return
            if not delivered:
                self._deliver(None, received)
            self._client._notify(self._channel, MARK_RECV_FINISHED_METHOD, self._request_id)
            return
        # The caller's timeout expired between attempts (the peer kept being unavailable).
        error = DeadlineExceededError(
            f"Timed out after {self._timeout:g}s receiving {self._where()}"
            + (
                f"; the peer was unavailable: {_details(last_unavailable)}"
                if last_unavailable
                else ""
            )
        )
        self._deliver(error, None)

    def _error(self, code: grpc.StatusCode, e: grpc.RpcError) -> RendezvousError:
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            after = "" if self._timeout is None else f" after {self._timeout:g}s"
            return DeadlineExceededError(
                f"Timed out{after} receiving {self._where()}: {_details(e)}"
            )
        if self._state == _RECEIVING and code == grpc.StatusCode.ABORTED:
            # A mid-stream retry found the value gone from the server's cache.
            return UnavailableError(
                f"lost the connection while receiving {self._where()} and could not get the "
                f"value again: {_details(e)}"
            )
        cls = error_for_code(code)
        error = cls(f"RecvTensor of {self._where()} failed: {_details(e)}")
        error.__cause__ = e
        return error


class RpcClient:
    """Pulls values from shmrdv (and TensorFlow) workers over gRPC.

    Args:
        tls: use TLS (``TLSConfig`` with the CA of the servers, and a client
            certificate for servers that require one). ``None``: plaintext.
        token: send ``authorization: Bearer <token>`` with every call.

    One channel per peer address, opened on first use, reopened in a forked child.
    Thread-safe. ``close()`` fails receives in flight with ``CancelledError``.
    """

    def __init__(self, *, tls: TLSConfig | None = None, token: str | None = None) -> None:
        if tls is not None and not isinstance(tls, TLSConfig):
            raise InvalidArgumentError(f"tls must be a TLSConfig or None, not {type(tls).__name__}")
        self._tls = tls
        self._metadata: Sequence[tuple[str, str]] = bearer_metadata(check_token(token))
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._inflight: set[_StreamRecv] = set()
        self._closed = False

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            # A forked child: the parent's channels and threads are not ours (gRPC's state
            # in them is invalid here), and a lock held at fork time would never be
            # released. Drop them without closing: closing would act on the parent's
            # connections. (A child is single-threaded when it starts, so no race here.)
            _log.debug("RpcClient: pid changed (fork); opening fresh channels")
            _FORKED_LEFTOVERS.append(self._channels)
            self._reset()

    def _channel(self, address: str) -> grpc.Channel:
        if not isinstance(address, str) or ":" not in address:
            raise InvalidArgumentError(f"peer address must be 'host:port', not {address!r}")
        self._check_fork()
        with self._lock:
            if self._closed:
                raise CancelledError("RpcClient is closed")
            channel = self._channels.get(address)
            if channel is None:
                options = list(_BASE_OPTIONS)
                try:
                    if self._tls is not None:
                        options += self._tls.channel_options()
                        channel = grpc.secure_channel(
                            address, self._tls.channel_credentials(), options
                        )
                    else:
                        channel = grpc.insecure_channel(address, options)
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE):
                        raise ResourceExhaustedError(
                            f"cannot open a gRPC channel to {address}: too many open files "
                            f"({e.strerror}); raise the limit (ulimit -n)"
                        ) from e
                    raise UnavailableError(f"cannot open a gRPC channel to {address}: {e}") from e
                self._channels[address] = channel
            return channel

    def _drop_channel(self, address: str, channel: Any) -> None:
        with self._lock:
            current = self._channels.get(address)
            if current is None or current is not channel:
                return
            del self._channels[address]
        try:
            current.close()
        except Exception:  # pragma: no cover - closing a broken channel
            _log.debug("closing the channel to %s failed", address, exc_info=True)

    # -- receiving -------------------------------------------------------------------------

    def start_recv(
        self,
        address: str,
        step_id: int,
        key: ParsedKey | str,
        done: DoneCallback,
        *,
        timeout: float | None = None,
    ) -> Canceller:
        """Start pulling the next value of ``key`` from the worker at ``address``.

        Returns at once. ``done(error, Received)`` is called exactly once, in a client
        thread, unless the returned canceller answers ``True`` (it does while no data has
        arrived; the call is then stopped and its server-side waiter removed). ``timeout``
        bounds the whole receive, retries included (``DeadlineExceededError``); without
        it an unreachable peer is retried until the caller cancels. Errors name the key
        and the peer: the server's error class (``AbortedError``, ``InvalidArgumentError``,
        ...), ``UnavailableError`` for a connection lost mid-stream,
        ``UnauthenticatedError`` for a refused token.
        """
        t = check_timeout(timeout)
        try:
            pk = as_parsed_key(key)
            channel = self._channel(address)
        except RendezvousError as e:
            invoke_done(done, e, None)
            return _too_late
        recv = _StreamRecv(self, channel, address, int(step_id), pk, done, t)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._inflight.add(recv)
        if closed:
            invoke_done(done, CancelledError("RpcClient is closed"), None)
            return _too_late
        try:
            recv.thread.start()
        except RuntimeError as e:  # "can't start new thread"
            self._forget(recv)
            invoke_done(
                done,
                ResourceExhaustedError(f"cannot start a receive thread for {recv._where()}: {e}"),
                None,
            )
            return _too_late
        return recv.cancel

    def recv(
        self, address: str, step_id: int, key: ParsedKey | str, *, timeout: float | None = None
    ) -> Received:
        """Block until the next value of ``key`` arrives from ``address`` (``start_recv``)."""
        event = threading.Event()
        box: list[Any] = [None, None]

        def done(error: BaseException | None, received: Received | None) -> None:
            box[0], box[1] = error, received
            event.set()

        cancel = self.start_recv(address, step_id, key, done, timeout=timeout)
        try:
            event.wait()
        except BaseException:
            if not cancel():
                event.wait()
            else:
                raise
        if box[0] is not None:
            raise box[0]
        result: Received = box[1]
        return result

    def recv_unary(
        self,
        address: str,
        step_id: int,
        key: ParsedKey | str,
        *,
        timeout: float | None = None,
        request_id: int = 0,
    ) -> Received:
        """One TensorFlow-style unary ``RecvTensor`` call; block until answered.

        The value is a read-only array over the response bytes (no copy). No retries.
        Raises the mapped error naming the key and peer.
        """
        t = check_timeout(timeout)
        key = as_parsed_key(key)
        channel = self._channel(address)
        request = coding.encode_request(int(step_id), key.full_key, int(request_id))
        where = f"key {key.full_key!r} (step {step_id}) from {address}"
        try:
            data = channel.unary_unary(RECV_TENSOR_METHOD)(
                request, timeout=t, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise error_for_code(_code(e))(f"RecvTensor of {where} failed: {_details(e)}") from e
        try:
            decoded = coding.decode_response(data)
        except RendezvousError as e:
            raise type(e)(f"bad RecvTensorResponse for {where}: {e}") from e
        return Received(decoded.value, decoded.is_dead)

    def get_status(
        self, address: str, *, timeout: float = 5.0
    ) -> tuple[coding.DeviceAttributes, ...]:
        """TensorFlow's ``GetStatus`` of the worker at ``address`` (its devices); blocks.

        A cheap "is this peer up and whose incarnation is it" probe. Raises the mapped
        error (``UnavailableError`` when the peer cannot be reached).
        """
        t = check_timeout(timeout)
        channel = self._channel(address)
        try:
            data = channel.unary_unary(GET_STATUS_METHOD)(b"", timeout=t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_for_code(_code(e))(f"GetStatus of {address} failed: {_details(e)}") from e
        try:
            return coding.decode_status_response(data)
        except RendezvousError as e:
            raise type(e)(f"bad GetStatusResponse from {address}: {e}") from e

    def _notify(self, channel: grpc.Channel, method: str, request_id: int) -> None:
        """Tell the server, without waiting, that ``request_id`` is done with.

        ``MarkRecvFinished`` (TensorFlow): the value arrived, drop the cached response.
        ``ReleaseRecv`` (shmrdv): the call was cancelled, give back a value taken for it.
        """
        request = coding.encode_mark_recv_finished(request_id)
        try:
            fut = channel.unary_unary(method).future(
                request, timeout=_ACK_TIMEOUT, metadata=self._metadata
            )
        except (ValueError, grpc.RpcError):  # the channel was closed meanwhile
            return
        # The answer does not matter: the cache entry also expires on its own.
        fut.add_done_callback(lambda f: f.exception())

    def _forget(self, recv: _StreamRecv) -> None:
        with self._lock:
            self._inflight.discard(recv)

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Fail receives in flight with ``CancelledError``, join their threads, close channels.

        Idempotent; blocks up to a few seconds per receive thread.
        """
        self._check_fork()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inflight, self._inflight = list(self._inflight), set()
            channels, self._channels = list(self._channels.values()), {}
        for recv in inflight:
            recv.close(CancelledError("RpcClient closed"))
        for recv in inflight:
            if recv.thread is not threading.current_thread():
                recv.thread.join(_JOIN_TIMEOUT)
        for channel in channels:
            channel.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters: channels open, receives in flight, and of those the ones receiving data."""
        with self._lock:
            return {
                "channels": len(self._channels),
                "inflight": len(self._inflight),
                "receiving": sum(1 for r in self._inflight if r.receiving),
            }

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else "open"
        return f"<shmrdv RpcClient {state} channels={s['channels']} inflight={s['inflight']}>"


# Channels inherited by forked children, kept referenced so that their finalizers never
# run in the child (they would act on the parent's gRPC state).
_FORKED_LEFTOVERS: list[Any] = []


def _too_late() -> bool:
    return False
