"""One receive's RPCs: the Exchange want, the unary RecvTensorInline, or the stream.

``Recv`` is one ``RpcClient.start_recv``. To a shmrdv peer it posts a *want* on the
long-lived ``Exchange`` stream to that peer (``link.Link``): the producer answers with
one stream message as soon as the value is sent, so a small tensor costs one message and
no new call. A tensor larger than 1 MiB is set aside by the server, which says "fetch
it"; it is then streamed with ``RecvTensorStream`` under the same request_id on a thread
of its own and assembled into one array (one copy). A peer without ``Exchange``
(TensorFlow, an older shmrdv) gets a unary ``RecvTensorInline`` (answered inline up to
``inline_max``), and one without that is streamed from directly. Retries, deadlines,
cancels and the errors a receive can end with are described on ``RpcClient``.

What a receive uses of its client is declared in ``CallContext``: the peer's channel and
link (``channels.ChannelCache``), the acks (``acks.AckQueue``), the callback threads
(``runner.Runner``), the call metadata and inline limit, and ``forget``.

Thread model: a unary call is a gRPC future: its outcome arrives in gRPC's channel
thread, which never blocks here (a large answer is decoded on a ``Runner`` thread). A
link calls the ``link_*`` methods in its reader thread. A streamed (large) value has a
thread of its own ("shmrdv-rpc-recv"); a retry waits on a timer thread. One lock guards
the state; ``done`` never runs under it, and runs exactly once unless ``cancel``
returned ``True``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from .._callbacks import DoneCallback, invoke_done
from .._errors import (
    CancelledError,
    DeadlineExceededError,
    InternalError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import ParsedKey
from .._received import Received
from .._status import error_for_code
from . import assembly, messages
from .acks import AckQueue, notify
from .channels import ChannelCache
from .link import Link
from .methods import (
    LINK_INLINE_MAX,
    MARK_RECV_FINISHED_METHOD,
    RECV_TENSOR_INLINE_METHOD,
    RECV_TENSOR_STREAM_METHOD,
    RELEASE_RECV_METHOD,
)
from .rpc_errors import error_code, error_details
from .runner import Runner

__all__ = ["CallContext", "Recv"]

_log = logging.getLogger("shmrdv.rpc.client")

_RETRY_INITIAL = 0.05
_RETRY_MAX = 1.0
_MID_STREAM_RETRIES = 2
# An inline answer larger than this is decoded and copied on a callback thread, not in
# gRPC's channel thread (a copy of a few hundred KiB costs less than the thread switch).
_COPY_IN_CHANNEL_THREAD = 1 << 20

_PENDING, _RECEIVING, _DONE, _CANCELLED = range(4)


@dataclasses.dataclass(frozen=True, slots=True)
class CallContext:
    """What a receive uses of the client that started it."""

    channels: ChannelCache
    acks: AckQueue
    runner: Runner
    metadata: Sequence[tuple[str, str]]
    inline_max: int
    forget: Callable[[Recv], None]  # the receive has ended (delivered, failed, cancelled)


def _new_request_id() -> int:
    # TensorFlow: GetUniqueRequestId, a random non-zero int64.
    while True:
        rid = secrets.randbits(63)
        if rid:
            return rid


class Recv:
    """One ``start_recv``: its calls, its state and its canceller.

    First a unary ``RecvTensorInline`` (no thread: its outcome arrives in a gRPC future's
    callback), which answers a small tensor at once; a larger one stays in the server's
    response cache and a thread then streams it with ``RecvTensorStream`` under the same
    request_id. A peer without ``RecvTensorInline`` (``UNIMPLEMENTED``) is streamed from
    at once, and that peer is remembered.
    """

    def __init__(
        self,
        ctx: CallContext,
        channel: grpc.Channel,
        address: str,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        timeout: float | None,
        direct: bool,
    ) -> None:
        self._ctx = ctx
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
            self._ctx.forget(self)
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
        self._ctx.forget(self)
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
        self._ctx.forget(self)
        if here or self._direct or threading.current_thread() is self.thread:
            invoke_done(self._done, error, received)
        else:
            self._ctx.runner.submit(invoke_done, self._done, error, received)

    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _timed_out(self) -> None:
        """The caller's timeout expired between attempts (the peer kept being unavailable)."""
        last = self._last_unavailable
        why = error_details(last) if last is not None else self._link_down
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
        if error_code(
            e
        ) != grpc.StatusCode.UNAVAILABLE or "Too many open files" not in error_details(e):
            return False
        self._ctx.channels.drop_channel(self._address, self._channel)
        self._deliver(
            ResourceExhaustedError(
                f"cannot connect for {self._where()}: too many open files "
                f"(ulimit -n): {error_details(e)}"
            ),
            None,
        )
        return True

    # -- the unary phase (no thread of ours) ------------------------------------------

    def start(self) -> None:
        if self._ctx.channels.streams_only(self._address):
            self._start_stream()
            return
        try:
            self._cancel_request()  # a step id or key the wire cannot carry fails here
        except RendezvousError as e:
            self._deliver(e, None)
            return
        for _ in range(2):
            link = self._ctx.channels.link_for(self._address, self._channel)
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
            inline_max=min(self._ctx.inline_max, LINK_INLINE_MAX),
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
        self._ctx.acks.ack(self._address, self._request_id)
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
        if not self._ctx.channels.send_on_link(self._address, self._cancel_request()):
            notify(self._channel, RELEASE_RECV_METHOD, self._request_id, self._ctx.metadata)

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
        self._ctx.channels.remember_no_link(self._address)
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
                acks = self._ctx.acks.take(self._address)
                failure: RendezvousError | None = None
                try:
                    request = messages.encode_request(
                        self._step_id,
                        self._key.full_key,
                        self._request_id,
                        finished=acks,
                        inline_max=self._ctx.inline_max,
                    )
                    call = self._channel.unary_unary(RECV_TENSOR_INLINE_METHOD).future(
                        request, timeout=remaining, metadata=self._ctx.metadata
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
            self._ctx.acks.give_back(self._address, acks)
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
                    self._ctx.acks.give_back(self._address, acks)
                return  # answered there
            if call.cancelled():  # pragma: no cover - only our cancel/close cancel it
                return
            error = call.exception()
            if error is not None:
                self._call = None
        if error is None:
            self._answered(call.result())
            return
        self._ctx.acks.give_back(self._address, acks)
        code = error_code(error)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            # Not a shmrdv server that knows RecvTensorInline: stream from it, as before.
            self._ctx.channels.remember_streams_only(self._address)
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
            self._ctx.runner.submit(self._take_off_channel, data)
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
        self._ctx.acks.ack(self._address, self._request_id)
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
        metadata = self._ctx.metadata
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
                code = error_code(e)
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
                                    f"retried {_MID_STREAM_RETRIES} times: {error_details(e)}"
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
            notify(self._channel, MARK_RECV_FINISHED_METHOD, self._request_id, self._ctx.metadata)
            return
        self._timed_out()

    def _error(self, code: grpc.StatusCode, e: grpc.RpcError) -> RendezvousError:
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            after = "" if self._timeout is None else f" after {self._timeout:g}s"
            return DeadlineExceededError(
                f"Timed out{after} receiving {self._where()}: {error_details(e)}"
            )
        if self._state == _RECEIVING and code == grpc.StatusCode.ABORTED:
            # A mid-stream retry found the value gone from the server's cache.
            return UnavailableError(
                f"lost the connection while receiving {self._where()} and could not get the "
                f"value again: {error_details(e)}"
            )
        cls = error_for_code(code)
        error = cls(f"RecvTensor of {self._where()} failed: {error_details(e)}")
        error.__cause__ = e
        return error
