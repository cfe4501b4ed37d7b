"""RpcClient: the consumer side of the gRPC transport (TensorFlow's RpcRecvTensorCall).

``start_recv`` pulls the next value of a key from the producer's worker with a fresh
random non-zero ``request_id``. To a shmrdv peer it posts a *want* on the long-lived
``Exchange`` stream to that peer (``link.Link``, one per peer): the producer answers with
one stream message as soon as the value is sent, so a small tensor costs one message and
no new call. A tensor larger than 1 MiB is set aside by the server, which says "fetch
it"; it is then streamed with ``RecvTensorStream`` under the same request_id on a thread
of its own and assembled into one array (one copy). A peer without ``Exchange``
(TensorFlow, an older shmrdv) gets a unary ``RecvTensorInline`` (answered inline up to
``inline_max``), and one without that is streamed from directly. The call is
TensorFlow's ``RecvFromRemoteAsync`` (research/tf_rendezvous.md §3.1) with these additions:

* a transient ``UNAVAILABLE`` (peer not up yet, connection refused or reset before any
  data came) is retried with backoff (50 ms doubling to 1 s) and the *same*
  ``request_id``, until the caller cancels or its ``timeout`` expires (on the link: the
  stream is reopened and every pending want posted again). The server's response cache
  makes that safe: a retry joins the first attempt's waiter or gets its delivered value,
  so a response lost on the wire is not a lost tensor;
* a server's longest wait (``RpcServer(max_wait=)``) ending a receive without a timeout
  of its own is asked again, transparently;
* once data is flowing the call can no longer be cancelled (the producer has given the
  value away); a connection lost mid-stream is retried twice (the server still caches
  the value), then fails with ``UnavailableError``. No partial array is ever delivered;
* a cancelled call tells the server (a cancel on the link, ordered before the next want;
  else ``ReleaseRecv``): a value the server took for it goes back to its key's head;
* acks (TensorFlow's ``MarkRecvFinished``) ride on the next want or request to the same
  peer; one that none takes within 50 ms goes on its own (on the link if open).
* a peer's bytes that do not parse, or describe an impossible tensor (the element-count
  rule of ``_values.shape_problem``), fail the receive with ``InternalError`` naming the
  peer, before anything is allocated.

Thread model: the sync gRPC API. A link has a reader thread ("shmrdv-rpc-link") that
decodes each reply and calls ``done`` itself when the caller said ``direct`` (a blocking
receive's own slot), else hands it to a reused callback thread. A unary call is a gRPC
future: its outcome arrives in gRPC's channel thread, handled the same way. A streamed
(large) value has a thread of its own ("shmrdv-rpc-recv"). (An asyncio channel would need
none of this, but grpc.aio does not survive ``fork`` — measured: a forked child's aio
calls time out — while a fresh sync channel in the child works; research/pitfalls.md
§6.) ``done`` never runs under a lock, and exactly once unless the canceller returned
``True``.

Fork: channels and links are per process. A client used in a parent and then in a
forked child notices the new pid and opens fresh ones in the child; the parent's are
left alone. Before a fork the idle links end and their threads are joined (a thread
inside gRPC at fork time breaks the child).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from .._callbacks import DoneCallback, invoke_done
from .._errors import (
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._hostaddr import split_host_port
from .._keys import ParsedKey
from .._received import Received
from .._rendezvous import Canceller, as_parsed_key, check_timeout
from .._status import error_for_code
from . import assembly, messages
from .link import Link
from .methods import (
    DEFAULT_INLINE_MAX,
    GET_STATUS_METHOD,
    LINK_INLINE_MAX,
    MARK_RECV_FINISHED_METHOD,
    RECV_TENSOR_INLINE_METHOD,
    RECV_TENSOR_METHOD,
    RECV_TENSOR_STREAM_METHOD,
    RELEASE_RECV_METHOD,
)
from .security import TLSConfig, bearer_metadata, check_token

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
# An ack not piggybacked on a request to the same peer within this time goes on its own
# (MarkRecvFinished), so that the server's cache does not hold the value until it expires.
# Closing waits this long (s) at most for the acks it sends.
_CLOSE_ACK_WAIT = 1.0
_ACK_DELAY = 0.05
# An inline answer larger than this is decoded and copied on a callback thread, not in
# gRPC's channel thread (a copy of a few hundred KiB costs less than the thread switch).
_COPY_IN_CHANNEL_THREAD = 1 << 20
# A callback thread with nothing to run for this long ends.
_IDLE_EXIT = 10.0

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


class _Runner:
    """Runs ``done`` callbacks off gRPC's thread, on reused threads.

    gRPC calls a future's callbacks in its channel thread, which must not block: a
    callback that waits there (say, for another receive on that channel) would stop the
    channel. So a caller's ``done`` runs here: on an idle thread if there is one, else on
    a new one (so a ``done`` that blocks never holds up another), which ends after
    ``_IDLE_EXIT`` seconds without work or at ``shutdown``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._tasks: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._idle = 0
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        task = (fn, args)
        with self._cond:
            if not self._closed:
                self._tasks.append(task)
                if self._idle >= len(self._tasks):
                    self._cond.notify()
                    return
                thread = threading.Thread(target=self._work, name="shmrdv-rpc-done", daemon=True)
                self._threads.add(thread)
            else:
                thread = None
        if thread is None:
            fn(*args)
            return
        try:
            thread.start()
        except RuntimeError:  # "can't start new thread": run it here rather than never
            with self._cond:
                self._threads.discard(thread)
                try:
                    self._tasks.remove(task)
                except ValueError:
                    return  # an idle thread took it meanwhile
            fn(*args)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                self._idle += 1
                while not self._tasks and not self._closed:
                    if not self._cond.wait(_IDLE_EXIT) and not self._tasks:
                        break
                self._idle -= 1
                if not self._tasks:
                    self._threads.discard(me)
                    return
                fn, args = self._tasks.popleft()
            fn(*args)

    def shutdown(self, timeout: float) -> None:
        """Let the threads finish what they run and end; join them (not the caller's)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)


class _Recv:
    """One ``start_recv``: its calls, its state and its canceller.

    First a unary ``RecvTensorInline`` (no thread: its outcome arrives in a gRPC future's
    callback), which answers a small tensor at once; a larger one stays in the server's
    response cache and a thread then streams it with ``RecvTensorStream`` under the same
    request_id. A peer without ``RecvTensorInline`` (``UNIMPLEMENTED``) is streamed from
    at once, and that peer is remembered.
    """

    def __init__(
        self,
        client: RpcClient,
        channel: grpc.Channel,
        address: str,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        timeout: float | None,
        direct: bool,
    ) -> None:
        self._client = client
        self._channel = channel
        self._address = address
        self._step_id = step_id
        self._key = key
        self._done = done
        self._direct = direct
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._request_id = _new_request_id()
        self.request_id = self._request_id  # link.Want
        self._lock = threading.Lock()
        self._state = _PENDING
        self._streaming = False  # the RecvTensorStream phase (in self.thread)
        self._issued = False  # some call went out: the server may hold a value for it
        self._call: Any = None  # the call in flight (a unary future or a stream)
        self._timer: threading.Timer | None = None
        self._backoff = _RETRY_INITIAL
        self._last_unavailable: grpc.RpcError | None = None
        self._link_down = ""  # why the link is down, while it is
        self._wake = threading.Event()
        self.thread: threading.Thread | None = None
        self._link: Link | None = None  # posted on this Exchange link (not yet answered)

    @property
    def receiving(self) -> bool:
        """Data is flowing: the receive can no longer be cancelled."""
        return self._state == _RECEIVING

    def _where(self) -> str:
        return f"key {self._key.full_key!r} (step {self._step_id}) from {self._address}"

    # -- called by other threads -------------------------------------------------------

    def cancel(self) -> bool:
        """Stop, and ``done`` is never called (``True``); ``False`` once delivered or failed.

        ``False`` also once the unary call has completed (its outcome is on its way to
        ``done``). Mid-stream the partial value is dropped here, so a receive whose
        deadline expires while a large tensor is (slowly) arriving does not wait past it.
        Whenever a call went out, ``ReleaseRecv`` has the server give back a value it took
        for it (to its key's head) instead of parking it for a retry that never comes.
        """
        with self._lock:
            link = self._link
            if link is not None:
                if self._state != _PENDING:
                    return False  # its value is being handed over
                self._state = _CANCELLED
        if link is not None:
            # The server gives back a value it took for this request_id (also one already
            # on the wire: the link drops that reply).
            link.withdraw(self, self._cancel_request())
            self._client._forget(self)
            return True
        with self._lock:
            if self._state not in (_PENDING, _RECEIVING):
                return False
            call = self._call
            # A unary call that completed delivers through its callback only a value
            # answered inline; an error (retried, or turned into an error) or an empty
            # answer ("stream it") would start more work, which this cancel stops instead
            # (``_on_unary`` and what it starts see the state).
            if (
                not self._streaming
                and call is not None
                and not call.cancel()
                and call.exception() is None
                and call.result()
            ):
                return False
            self._state = _CANCELLED
            timer, self._timer = self._timer, None
            issued = self._issued
        self._wake.set()
        if timer is not None:
            timer.cancel()
        if call is not None and self._streaming:
            call.cancel()
        if issued:
            self._give_up()
        self._client._forget(self)
        return True

    def close(self, error: BaseException) -> None:
        """The client closes: fail this receive with ``error`` unless it already finished."""
        with self._lock:
            if self._state in (_DONE, _CANCELLED):
                return
            self._state = _DONE
            call = self._call
            timer, self._timer = self._timer, None
        self._wake.set()
        if timer is not None:
            timer.cancel()
        if call is not None:
            call.cancel()
        invoke_done(self._done, error, None)

    # -- delivering --------------------------------------------------------------------

    def _deliver(
        self, error: BaseException | None, received: Received | None, *, here: bool = False
    ) -> None:
        """Answer ``done`` once: in this thread when ``here`` (a thread of ours), when the
        caller said ``direct`` or from the stream thread, else on a callback thread."""
        with self._lock:
            if self._state in (_DONE, _CANCELLED):
                return
            self._state = _DONE
        self._client._forget(self)
        if here or self._direct or threading.current_thread() is self.thread:
            invoke_done(self._done, error, received)
        else:
            self._client._runner.submit(invoke_done, self._done, error, received)

    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _timed_out(self) -> None:
        """The caller's timeout expired between attempts (the peer kept being unavailable)."""
        last = self._last_unavailable
        why = _details(last) if last is not None else self._link_down
        self._deliver(
            DeadlineExceededError(
                f"Timed out after {self._timeout:g}s receiving {self._where()}"
                + (f"; the peer was unavailable: {why}" if why else "")
            ),
            None,
        )

    def _out_of_files(self, e: grpc.RpcError) -> bool:
        """UNAVAILABLE for lack of descriptors is not transient the way a restarting peer
        is: say what ran out, and drop the channel so that the next receive, once
        descriptors are back, connects afresh instead of inheriting its reconnect backoff."""
        if _code(e) != grpc.StatusCode.UNAVAILABLE or "Too many open files" not in _details(e):
            return False
        self._client._drop_channel(self._address, self._channel)
        self._deliver(
            ResourceExhaustedError(
                f"cannot connect for {self._where()}: too many open files "
                f"(ulimit -n): {_details(e)}"
            ),
            None,
        )
        return True

    # -- the unary phase (no thread of ours) ------------------------------------------

    def start(self) -> None:
        if self._client._streams_only(self._address):
            self._start_stream()
            return
        try:
            self._cancel_request()  # a step id or key the wire cannot carry fails here
        except RendezvousError as e:
            self._deliver(e, None)
            return
        for _ in range(2):
            link = self._client._link_for(self._address, self._channel)
            if link is None:
                break
            with self._lock:
                self._link = link
            if link.post(self):
                return
            with self._lock:
                self._link = None
        self._attempt()

    # -- the Exchange link (link.Want; called in the link's reader thread) ---------------

    def _cancel_request(self) -> bytes:
        return messages.encode_request(
            self._step_id, self._key.full_key, self._request_id, cancel=True
        )

    def link_request(self, acks: Sequence[int]) -> bytes | None:
        with self._lock:
            if self._state != _PENDING or self._link is None:
                return None
            remaining = self._remaining()
            self._issued = True
        wait_ms = -1 if remaining is None else max(0, int(remaining * 1000))
        return messages.encode_request(
            self._step_id,
            self._key.full_key,
            self._request_id,
            finished=acks,
            inline_max=min(self._client._inline_max, LINK_INLINE_MAX),
            wait_ms=wait_ms,
        )

    def link_value(self, data: bytes) -> None:
        with self._lock:
            if self._state != _PENDING:
                return  # cancelled as it arrived: the server gives the value back
            self._state = _RECEIVING
            self._link = None
        try:
            decoded = messages.decode_response(data)
        except RendezvousError as e:
            self._deliver(
                InternalError(f"bad Exchange reply from {self._address} for {self._where()}: {e}"),
                None,
            )
            return
        self._client._ack(self._address, self._request_id)
        # A private, writable array (the reply bytes are read-only); it is small.
        self._deliver(None, Received(np.array(decoded.value, copy=True), decoded.is_dead))

    def link_fetch(self) -> None:
        with self._lock:
            if self._state != _PENDING:
                return  # cancelled: the server gives the value back
            self._link = None
        # Streamed in chunks on a thread of its own, under the same request_id (a cache
        # hit). Measured on loopback, a 256 MiB tensor streams in 4 MiB chunks in half the
        # time it takes as one message (1.5 s against 2.6-3.8 s), 16 MiB in about the same.
        self._start_stream()

    def _give_up(self) -> None:
        """Tell the server we will not take this request_id's value: on the link when it is
        open (ordered before our next want there, so the value is back at its key's head
        before that want is served), else with ReleaseRecv."""
        if not self._client._send_on_link(self._address, self._cancel_request()):
            self._client._notify(self._channel, RELEASE_RECV_METHOD, self._request_id)

    def link_failed(self, error: RendezvousError, code: grpc.StatusCode) -> None:
        with self._lock:
            if self._state != _PENDING:
                return
            self._link = None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if self._deadline is None or (self._remaining() or 0.0) > 0:
                self.start()  # the server's longest wait, not ours: ask again
            else:
                self._timed_out()
            return
        self._deliver(type(error)(f"RecvTensor of {self._where()} failed: {error}"), None)

    def link_expired(self, why: str) -> bool:
        remaining = self._remaining()
        if remaining is None or remaining > 0:
            return False
        self._link_down = why
        with self._lock:
            self._link = None
        self._timed_out()
        return True

    def link_unsupported(self) -> None:
        self._client._remember_no_link(self._address)
        with self._lock:
            if self._state != _PENDING:
                return
            self._link = None
        self._attempt()

    def _attempt(self) -> None:
        acks: list[int] = []
        with self._lock:
            self._timer = None
            if self._state != _PENDING:
                return
            remaining = self._remaining()
            if remaining is not None and remaining <= 0:
                expired = True
            else:
                expired = False
                acks = self._client._take_acks(self._address)
                failure: RendezvousError | None = None
                try:
                    request = messages.encode_request(
                        self._step_id,
                        self._key.full_key,
                        self._request_id,
                        finished=acks,
                        inline_max=self._client._inline_max,
                    )
                    call = self._channel.unary_unary(RECV_TENSOR_INLINE_METHOD).future(
                        request, timeout=remaining, metadata=self._client._metadata
                    )
                    self._issued = True
                except RendezvousError as e:  # a step id or key the wire cannot carry
                    call = None
                    failure = e
                except ValueError as e:  # the channel was closed under us
                    call = None
                    failure = CancelledError(f"receiving {self._where()}: {e}")
                self._call = call
        if expired:
            self._timed_out()
            return
        if call is None:
            self._client._give_back_acks(self._address, acks)
            assert failure is not None
            self._deliver(failure, None)
            return
        call.add_done_callback(functools.partial(self._on_unary, acks))

    def _on_unary(self, acks: list[int], call: Any) -> None:
        """The unary call's outcome, in gRPC's channel thread (never block here).

        Whatever goes wrong here fails this receive: its caller must not wait forever.
        """
        try:
            self._on_unary_outcome(acks, call)
        except Exception as e:
            _log.exception("RecvTensorInline callback for %s failed", self._where())
            self._deliver(InternalError(f"receiving {self._where()}: {e!r}"), None)

    def _on_unary_outcome(self, acks: list[int], call: Any) -> None:
        with self._lock:
            if self._state != _PENDING or self._call is not call:
                if not call.cancelled() and call.exception() is not None:
                    # Cancelled or closed meanwhile: a failed request may not have
                    # reached the server, so its acks go out again with the next one.
                    self._client._give_back_acks(self._address, acks)
                return  # answered there
            if call.cancelled():  # pragma: no cover - only our cancel/close cancel it
                return
            error = call.exception()
            if error is not None:
                self._call = None
        if error is None:
            self._answered(call.result())
            return
        self._client._give_back_acks(self._address, acks)
        code = _code(error)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            # Not a shmrdv server that knows RecvTensorInline: stream from it, as before.
            self._client._remember_streams_only(self._address)
            self._start_stream()
        elif self._out_of_files(error):
            pass
        elif code == grpc.StatusCode.UNAVAILABLE:
            self._retry_later(error)
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and self._deadline is None:
            self._attempt()  # the server's longest wait (max_wait), not ours: ask again
        else:
            self._release_if_late(code)
            self._deliver(self._error(code, error), None)

    def _answered(self, data: bytes) -> None:
        if not data:
            self._start_stream()  # too large to answer inline: it waits in the cache
            return
        if len(data) > _COPY_IN_CHANNEL_THREAD:
            # Copying a large tensor would stall gRPC's channel thread (every call on the
            # channel): decode and copy it on a callback thread instead.
            self._client._runner.submit(self._take_off_channel, data)
        else:
            self._take(data, self._direct)

    def _take_off_channel(self, data: bytes) -> None:
        try:
            self._take(data, True)
        except Exception as e:  # the caller must not wait forever
            _log.exception("decoding the RecvTensorInline answer for %s failed", self._where())
            self._deliver(InternalError(f"receiving {self._where()}: {e!r}"), None, here=True)

    def _take(self, data: bytes, off_channel: bool) -> None:
        try:
            decoded = messages.decode_response(data)
        except RendezvousError as e:
            self._deliver(
                InternalError(
                    f"bad RecvTensorInline from {self._address} for {self._where()}: {e}"
                ),
                None,
            )
            return
        self._client._ack(self._address, self._request_id)
        # A private, writable array (the response bytes are read-only).
        value = np.array(decoded.value, copy=True)
        self._deliver(None, Received(value, decoded.is_dead), here=off_channel)

    def _release_if_late(self, code: grpc.StatusCode) -> None:
        """The deadline passed with a call out: the server may have taken a value for it
        (being streamed, or answered too late). ``ReleaseRecv`` gives it back to the head
        of its key at once: the next receive gets it, in order, rather than a later value
        while this one waits in the server's cache until it expires."""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._issued:
            self._give_up()

    def _retry_later(self, error: grpc.RpcError) -> None:
        """Transient UNAVAILABLE (peer not up yet, connection refused or reset): the same
        request_id again after the backoff, so a response lost on the wire is not lost."""
        self._last_unavailable = error
        pause = self._backoff
        remaining = self._remaining()
        if remaining is not None:
            pause = max(0.0, min(pause, remaining))
        self._backoff = min(self._backoff * 2, _RETRY_MAX)
        timer = threading.Timer(pause, self._attempt)
        timer.daemon = True
        timer.name = "shmrdv-rpc-retry"
        with self._lock:
            if self._state != _PENDING:
                return
            self._timer = timer
        try:
            timer.start()
        except RuntimeError as e:  # "can't start new thread"
            self._deliver(
                ResourceExhaustedError(f"cannot retry receiving {self._where()}: {e}"), None
            )

    # -- the stream phase (a thread of its own: large values) ----------------------------

    def _start_stream(self) -> None:
        thread = threading.Thread(target=self._run, name="shmrdv-rpc-recv", daemon=True)
        with self._lock:
            if self._state != _PENDING:
                return
            self._streaming = True
            self._call = None
            self.thread = thread
        try:
            thread.start()
        except RuntimeError as e:  # "can't start new thread"
            self._deliver(
                ResourceExhaustedError(f"cannot start a receive thread for {self._where()}: {e}"),
                None,
            )

    def _run(self) -> None:
        try:
            self._stream_attempts()
        except BaseException as e:  # a bug here must not leave the caller waiting forever
            _log.exception("RecvTensorStream of %s failed unexpectedly", self._where())
            self._deliver(UnavailableError(f"receiving {self._where()} failed: {e!r}"), None)

    def _stream_attempts(self) -> None:
        request = messages.encode_request(self._step_id, self._key.full_key, self._request_id)
        method = self._channel.unary_stream(RECV_TENSOR_STREAM_METHOD)
        metadata = self._client._metadata
        mid_stream_failures = 0
        while True:
            with self._lock:
                if self._state in (_DONE, _CANCELLED):
                    return
                remaining = self._remaining()
                if remaining is not None and remaining <= 0:
                    break
                call = method(request, timeout=remaining, metadata=metadata)
                self._call = call
                self._issued = True
            assembler = assembly.StreamAssembler()
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
                if self._out_of_files(e):
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
                    self._last_unavailable = e
                    pause = self._backoff
                    remaining = self._remaining()
                    if remaining is not None:
                        pause = max(0.0, min(pause, remaining))
                    self._wake.wait(pause)
                    self._backoff = min(self._backoff * 2, _RETRY_MAX)
                    continue
                self._release_if_late(code)
                self._deliver(self._error(code, e), None)
                return
            except RendezvousError as e:  # the assembler refused what arrived
                call.cancel()
                self._deliver(
                    InternalError(
                        f"bad RecvTensorStream from {self._address} for {self._where()}: {e}"
                    ),
                    None,
                )
                return
            if not delivered:
                self._deliver(None, received)
            # A large value: release the server's cached copy now, not at the next request.
            self._client._notify(self._channel, MARK_RECV_FINISHED_METHOD, self._request_id)
            return
        self._timed_out()

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

    def __init__(
        self,
        *,
        tls: TLSConfig | None = None,
        token: str | None = None,
        inline_max: int = DEFAULT_INLINE_MAX,
    ) -> None:
        if tls is not None and not isinstance(tls, TLSConfig):
            raise InvalidArgumentError(f"tls must be a TLSConfig or None, not {type(tls).__name__}")
        if not isinstance(inline_max, int) or isinstance(inline_max, bool) or inline_max < 0:
            raise InvalidArgumentError(f"inline_max must be an int >= 0, not {inline_max!r}")
        self._tls = tls
        self._metadata: Sequence[tuple[str, str]] = bearer_metadata(check_token(token))
        self._inline_max = inline_max
        self._reset()
        _CLIENTS.add(self)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._inflight: set[_Recv] = set()
        self._closed = False
        self._streams_only_peers: set[str] = set()
        self._links: dict[str, Link] = {}  # address -> its Exchange link
        self._no_link: set[str] = set()  # peers without Exchange (TensorFlow, older shmrdv)
        self._used: dict[str, float] = {}  # address -> last start_recv (monotonic)
        self._runner = _Runner()
        # Acks (request_ids whose inline responses arrived), per peer, oldest first.
        self._acks_cond = threading.Condition(threading.Lock())
        self._acks: dict[str, deque[tuple[int, float]]] = {}
        self._acker: threading.Thread | None = None
        self._acker_idle = False

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            # A forked child: the parent's channels and threads are not ours (gRPC's state
            # in them is invalid here), and a lock held at fork time would never be
            # released. Drop them without closing: closing would act on the parent's
            # connections. (A child is single-threaded when it starts, so no race here.)
            _log.debug("RpcClient: pid changed (fork); opening fresh channels")
            _FORKED_LEFTOVERS.append((self._channels, self._links))
            self._reset()

    def _channel(self, address: str) -> grpc.Channel:
        split_host_port(address)  # InvalidArgumentError naming a bad address
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
        direct: bool = False,
    ) -> Canceller:
        """Start pulling the next value of ``key`` from the worker at ``address``.

        Returns at once. ``done(error, Received)`` is called exactly once, in a client
        thread, unless the returned canceller answers ``True`` (it does while no data has
        arrived; the call is then stopped and its server-side waiter removed). ``direct``:
        ``done`` is quick and never blocks, so it may run in gRPC's own channel thread
        (one thread switch less). ``timeout``
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
        self._used[address] = time.monotonic()
        recv = _Recv(self, channel, address, int(step_id), pk, done, t, direct)
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._inflight.add(recv)
        if closed:
            invoke_done(done, CancelledError("RpcClient is closed"), None)
            return _too_late
        recv.start()
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

        cancel = self.start_recv(address, step_id, key, done, timeout=timeout, direct=True)
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
        request = messages.encode_request(int(step_id), key.full_key, int(request_id))
        where = f"key {key.full_key!r} (step {step_id}) from {address}"
        try:
            data = channel.unary_unary(RECV_TENSOR_METHOD)(
                request, timeout=t, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise error_for_code(_code(e))(f"RecvTensor of {where} failed: {_details(e)}") from e
        try:
            decoded = messages.decode_response(data)
        except RendezvousError as e:
            raise type(e)(f"bad RecvTensorResponse for {where}: {e}") from e
        return Received(decoded.value, decoded.is_dead)

    def get_status(
        self, address: str, *, timeout: float = 5.0
    ) -> tuple[messages.DeviceAttributes, ...]:
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
            return messages.decode_status_response(data)
        except RendezvousError as e:
            raise type(e)(f"bad GetStatusResponse from {address}: {e}") from e

    def _notify(self, channel: grpc.Channel, method: str, request_id: int) -> Any:
        """Tell the server, without waiting, that ``request_id`` is done with; return the
        call's future (None if the channel is closed), for a caller that wants to wait.

        ``MarkRecvFinished`` (TensorFlow): the value arrived, drop the cached response.
        ``ReleaseRecv`` (shmrdv): the call was cancelled, give back a value taken for it.
        """
        request = messages.encode_mark_recv_finished(request_id)
        try:
            fut = channel.unary_unary(method).future(
                request, timeout=_ACK_TIMEOUT, metadata=self._metadata
            )
        except (ValueError, grpc.RpcError):  # the channel was closed meanwhile
            return None
        # The answer does not matter: the cache entry also expires on its own.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut

    def _forget(self, recv: _Recv) -> None:
        with self._lock:
            self._inflight.discard(recv)

    # -- Exchange links: one per peer --------------------------------------------------

    def _link_for(self, address: str, channel: grpc.Channel) -> Link | None:
        """The live link to ``address`` (opened now if need be); None for a peer without
        Exchange, or once closed."""
        with self._lock:
            if self._closed or address in self._no_link:
                return None
            if self._channels.get(address) is not channel:
                return None  # the channel was dropped meanwhile: the unary way, this once
            link = self._links.get(address)
            if link is None:
                link = Link(
                    address,
                    channel,
                    self._metadata,
                    functools.partial(self._take_acks, address),
                    self._link_ended,
                )
                self._links[address] = link
            return link

    def _link_ended(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]

    def _send_on_link(self, address: str, request: bytes) -> bool:
        with self._lock:
            link = self._links.get(address)
        return link is not None and link.send(request)

    def _remember_no_link(self, address: str) -> None:
        with self._lock:
            self._no_link.add(address)

    def _close_idle_links(self) -> None:
        """Before a fork: end the links no receive waits on, and join their threads.

        A fork while a thread of ours is inside gRPC leaves the child's gRPC broken; an
        idle client must fork as cleanly as one without links. The next receive opens a
        new link. (Links with receives pending stay: forking now is the caller's risk.)
        """
        if os.getpid() != self._pid:
            return
        with self._lock:
            idle = [link for link in self._links.values() if not link.pending]
        for link in idle:
            link.close()

    def _streams_only(self, address: str) -> bool:
        return address in self._streams_only_peers

    def _remember_streams_only(self, address: str) -> None:
        with self._lock:
            self._streams_only_peers.add(address)

    # -- acks: piggybacked on the next request to the peer, else sent after _ACK_DELAY --

    def _ack(self, address: str, request_id: int) -> None:
        """The inline response of ``request_id`` arrived: tell the server, cheaply."""
        with self._acks_cond:
            if self._closed:
                return
            self._acks.setdefault(address, deque()).append((request_id, time.monotonic()))
            if self._acker is None:
                self._acker = threading.Thread(
                    target=self._send_late_acks, name="shmrdv-rpc-acks", daemon=True
                )
                try:
                    self._acker.start()
                except RuntimeError:  # no thread: the server's cache expires them instead
                    self._acker = None
            elif self._acker_idle:
                # Only an idle acker needs waking; a busy one looks every _ACK_DELAY (a
                # wake-up per receive would cost a receive a thread switch).
                self._acker_idle = False
                self._acks_cond.notify()

    def _take_acks(self, address: str) -> list[int]:
        """The acks to piggyback on a request to ``address`` (they leave the queue)."""
        with self._acks_cond:
            pending = self._acks.get(address)
            if not pending:
                return []
            n = min(len(pending), messages.MAX_ACKS)  # what a server takes from one request
            taken = [pending.popleft()[0] for _ in range(n)]
            if not pending:
                del self._acks[address]
        return taken

    def _give_back_acks(self, address: str, acks: list[int]) -> None:
        """A request that carried ``acks`` failed: they go with a later one."""
        if acks:
            now = time.monotonic()
            with self._acks_cond:
                if not self._closed:
                    self._acks.setdefault(address, deque()).extendleft(
                        (rid, now) for rid in reversed(acks)
                    )
                    self._acks_cond.notify()

    def _send_late_acks(self) -> None:
        """The acker thread: sends acks no request took within ``_ACK_DELAY``.

        It looks every ``_ACK_DELAY`` while acks come, and sleeps until woken after a
        period that had none.
        """
        quiet = False
        while True:
            due: list[tuple[str, int]] = []
            with self._acks_cond:
                while not due:
                    if self._closed:
                        return
                    now = time.monotonic()
                    oldest = min((q[0][1] for q in self._acks.values() if q), default=None)
                    if oldest is None and quiet:
                        self._acker_idle = True
                        self._acks_cond.wait()
                        self._acker_idle = quiet = False
                    elif oldest is None:
                        quiet = True
                        self._acks_cond.wait(_ACK_DELAY)
                    elif oldest + _ACK_DELAY > now:
                        quiet = False
                        self._acks_cond.wait(oldest + _ACK_DELAY - now)
                    else:
                        for address, q in list(self._acks.items()):
                            while q and q[0][1] + _ACK_DELAY <= now:
                                due.append((address, q.popleft()[0]))
                            if not q:
                                del self._acks[address]
            by_address: dict[str, list[int]] = {}
            for address, rid in due:
                by_address.setdefault(address, []).append(rid)
            for address, rids in by_address.items():
                with self._lock:
                    channel = self._channels.get(address)
                    link = self._links.get(address)
                for start in range(0, len(rids), messages.MAX_ACKS):
                    chunk = rids[start : start + messages.MAX_ACKS]
                    if link is not None and link.send_acks(chunk):
                        continue  # on the stream: no call of its own
                    if channel is not None:
                        for rid in chunk:
                            self._notify(channel, MARK_RECV_FINISHED_METHOD, rid)

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
            by_address, self._channels = dict(self._channels), {}
            links, self._links = list(self._links.values()), {}
        with self._acks_cond:
            unsent = [(a, rid) for a, q in self._acks.items() for rid, _ in q]
            self._acks.clear()
            self._acks_cond.notify_all()
            acker = self._acker
        for recv in inflight:
            recv.close(CancelledError("RpcClient closed"))
        for link in links:
            link.close()
        for recv in inflight:
            if recv.thread is not None and recv.thread is not threading.current_thread():
                recv.thread.join(_JOIN_TIMEOUT)
        if acker is not None and acker is not threading.current_thread():
            acker.join(_JOIN_TIMEOUT)
        self._runner.shutdown(_JOIN_TIMEOUT)
        self._flush_acks(unsent, by_address)
        for channel in by_address.values():
            channel.close()

    def _flush_acks(self, unsent: list[tuple[str, int]], channels: dict[str, grpc.Channel]) -> None:
        """Closing: send the acks no request took yet, waiting at most ``_CLOSE_ACK_WAIT``,
        so that servers drop the delivered values now rather than when their cache expires."""
        calls = [
            call
            for address, rid in unsent
            if (channel := channels.get(address)) is not None
            and (call := self._notify(channel, MARK_RECV_FINISHED_METHOD, rid)) is not None
        ]
        deadline = time.monotonic() + _CLOSE_ACK_WAIT
        for call in calls:
            try:
                call.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # timed out or cancelled: the server's cache expires it
                call.cancel()

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
                "links": len(self._links),
                "inflight": len(self._inflight),
                "receiving": sum(1 for r in self._inflight if r.receiving),
            }

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else "open"
        return f"<shmrdv RpcClient {state} channels={s['channels']} inflight={s['inflight']}>"


# Live clients, for the fork hook (their idle links end before a fork).
_CLIENTS: weakref.WeakSet[RpcClient] = weakref.WeakSet()


def _before_fork() -> None:
    for client in list(_CLIENTS):
        try:
            client._close_idle_links()
        except Exception:  # pragma: no cover - never fail a fork
            _log.debug("closing idle links before fork failed", exc_info=True)


os.register_at_fork(before=_before_fork)


# Channels inherited by forked children, kept referenced so that their finalizers never
# run in the child (they would act on the parent's gRPC state).
_FORKED_LEFTOVERS: list[Any] = []


def _too_late() -> bool:
    return False
