"""One receive's RPCs: a unary ``RecvTensor``, then for a large value ``RecvTensorStream``.

``Recv`` is one ``RpcClient.start_recv`` (TensorFlow's ``RpcRecvTensorCall``). It asks
``RecvTensor`` with a fresh request_id and shmrdv's ``inline_max``: a tensor up to that
size comes back in the one response; a larger one stays in the server's response cache
and the answer is empty bytes, and the receive then streams it with
``RecvTensorStream`` under the same request_id (a cache hit) on a thread of its own,
assembled into one array. Either way the consumer makes one copy of the bytes: the
response into the writable array it delivers. Retries, deadlines, cancels and the
errors a receive can end with are described on ``RpcClient``.

What a receive uses of its client is declared in ``CallContext``: the channels
(``channels.ChannelCache``), the acks (``acks.AckQueue``), the callback threads
(``runner.Runner``), the call metadata and inline limit, and ``forget``.

Thread model (docs/threads.md): a *blocking* receive's call is made by the receiving
thread, which then waits on it (``wait``), decodes the answer and fills its slot itself:
no other thread of ours runs. Any other unary call is a gRPC future whose outcome arrives
in gRPC's channel thread, which never blocks here (a large answer is decoded, and a
``done`` that is not ``direct`` runs, on a ``Runner`` thread). A streamed (large) value
has a thread of its own ("shmrdv-rpc-recv"); a retry or a wait for the producer's
address runs on a timer thread. One lock guards the state; ``done`` never runs under it,
and runs exactly once unless ``cancel`` returned ``True``.
"""

from __future__ import annotations

import dataclasses
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
from .methods import RECV_TENSOR_METHOD, RECV_TENSOR_STREAM_METHOD
from .rpc_errors import error_code, error_details
from .runner import Runner

__all__ = ["Address", "CallContext", "Recv"]

_log = logging.getLogger("shmrdv.rpc.client")

_RETRY_INITIAL = 0.05
_RETRY_MAX = 1.0
_MID_STREAM_RETRIES = 2
# How often a receive looks again for the address of a producer that has not started.
_RESOLVE_PERIOD = 0.05
# An answer larger than this is decoded and copied on a callback thread, not in gRPC's
# channel thread (a copy of a few hundred KiB costs less than the thread switch).
_COPY_IN_CHANNEL_THREAD = 1 << 20

# PENDING: no data yet (cancellable); ARRIVED: an answer is being decoded; RECEIVING: a
# stream is flowing; DONE: delivered or failed; CANCELLED.
_PENDING, _ARRIVED, _RECEIVING, _DONE, _CANCELLED = range(5)

#: The producer's ``host:port``, or a function that returns it and raises
#: ``UnavailableError`` while it is not known yet (a producer that has not started).
Address = str | Callable[[], str]


@dataclasses.dataclass(frozen=True, slots=True)
class CallContext:
    """What a receive uses of the client that started it."""

    channels: ChannelCache
    acks: AckQueue
    runner: Runner
    metadata: Sequence[tuple[str, str]]
    inline_max: int
    forget: Callable[[Recv], None]  # the receive has ended (delivered, failed, cancelled)
    count: Callable[[int], None]  # a value of this many bytes was received


def _new_request_id() -> int:
    # TensorFlow: GetUniqueRequestId, a random non-zero int64.
    while True:
        rid = secrets.randbits(63)
        if rid:
            return rid


class Recv:
    """One ``start_recv``: its calls, its state and its canceller.

    ``blocking``: ``done`` is a blocked receiver's slot (quick, never blocks) and the
    receiver calls ``wait`` until it is filled: the call it makes itself is waited on and
    decoded in its own thread.
    """

    def __init__(
        self,
        ctx: CallContext,
        address: Address,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        timeout: float | None,
        blocking: bool,
    ) -> None:
        self._ctx = ctx
        self._resolve = address
        self._address = address if isinstance(address, str) else "(address not known yet)"
        self._channel: grpc.Channel | None = None
        self.step_id = step_id
        self.key = key
        self.done = done
        self._blocking = blocking
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._request_id = _new_request_id()
        self._lock = threading.Lock()
        self._state = _PENDING
        self._streaming = False  # the RecvTensorStream phase (in self.thread)
        self._issued = False  # some call went out: the server may hold a value for it
        self._call: Any = None  # the call in flight (a unary future or a stream)
        self._own: Any = None  # the unary call the blocked receiver waits on itself
        self._owner = threading.get_ident()  # the receiving thread
        self._acks: list[int] = []  # the acks the unary call in flight carries
        self._timer: threading.Timer | None = None
        self._backoff = _RETRY_INITIAL
        self._last_unavailable: grpc.RpcError | None = None
        self._wake = threading.Event()
        self.thread: threading.Thread | None = None

    @property
    def receiving(self) -> bool:
        """Data is flowing: the receive can no longer be cancelled."""
        return self._state == _RECEIVING

    def _where(self) -> str:
        return f"key {self.key.full_key!r} (step {self.step_id}) from {self._address}"

    # -- called by other threads -------------------------------------------------------

    def cancel(self) -> bool:
        """Stop, and ``done`` is never called (``True``); ``False`` once delivered or failed.

        ``False`` also once a unary call has answered with the value (it is on its way to
        ``done``; a blocked receiver's own answer is delivered here). Mid-stream the
        partial value is dropped, so a receive whose deadline expires while a large tensor
        is (slowly) arriving does not wait past it. Whenever a call went out, the server
        is told to give back a value it took for it (to its key's head) instead of
        parking it for a retry that never comes.
        """
        take = None
        with self._lock:
            if self._state not in (_PENDING, _RECEIVING):
                return False
            call = self._call
            # A completed call whose answer is the value: it is delivered (a blocked
            # receiver's own call: here, now). An error or an empty answer ("stream it")
            # would start more work, which this cancel stops instead.
            if (
                not self._streaming
                and call is not None
                and not call.cancel()
                and call.exception() is None
                and call.result()
            ):
                if call is not self._own:
                    return False  # its callback is delivering it
                self._claim(call)
                take = call
            if take is None:
                self._state = _CANCELLED
                timer, self._timer = self._timer, None
                issued = self._issued
        if take is not None:
            self._take(take.result(), here=True)
            return False
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
        """Fail this receive with ``error`` unless it already finished (client closed,
        step aborted): the call in flight is stopped."""
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
        self._ctx.forget(self)
        invoke_done(self.done, error, None)

    def wait(self, timeout: float) -> bool:
        """A blocked receiver waits up to ``timeout`` on the call it made itself and, once
        it has answered, decodes it and fills its slot here. False: there is no such call
        (queued, resolving, retrying, streaming): wait on the slot instead."""
        with self._lock:
            call = self._own if self._state == _PENDING and self._call is self._own else None
        if call is None:
            return False
        try:
            call.exception(timeout)
        except grpc.FutureTimeoutError:
            return True
        except grpc.FutureCancelledError:
            return True  # cancelled by cancel() or close(): they answered
        self._outcome(call, here=True)
        return True

    # -- delivering --------------------------------------------------------------------

    def _deliver(
        self, error: BaseException | None, received: Received | None, *, here: bool = False
    ) -> None:
        """Answer ``done`` once: in this thread when ``here`` (a thread of ours), when the
        caller is blocked (its slot) or from the stream thread, else on a callback thread."""
        with self._lock:
            if self._state in (_DONE, _CANCELLED):
                return
            self._state = _DONE
        self._ctx.forget(self)
        if received is not None:
            self._ctx.count(received.value.nbytes)
        if here or self._blocking or threading.current_thread() is self.thread:
            invoke_done(self.done, error, received)
        else:
            self._ctx.runner.submit(invoke_done, self.done, error, received)

    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _timed_out(self, why: str = "") -> None:
        """The caller's timeout expired between attempts (the peer kept being unavailable)."""
        last = self._last_unavailable
        why = error_details(last) if last is not None else why
        self._deliver(
            DeadlineExceededError(
                f"Timed out after {self._timeout:g}s receiving {self._where()}"
                + (f"; the peer was unavailable: {why}" if why else "")
            ),
            None,
        )

    def out_of_files(self, e: grpc.RpcError) -> bool:
        """UNAVAILABLE for lack of descriptors is not transient the way a restarting peer
        is: say what ran out, and drop the channel so that the next receive, once
        descriptors are back, connects afresh instead of inheriting its reconnect backoff."""
        details = error_details(e)
        if error_code(e) != grpc.StatusCode.UNAVAILABLE or "Too many open files" not in details:
            return False
        self._ctx.channels.drop_channel(self._address, self._channel)
        self._deliver(
            ResourceExhaustedError(
                f"cannot connect for {self._where()}: too many open files (ulimit -n): {details}"
            ),
            None,
        )
        return True

    # -- starting: the producer's address and channel -----------------------------------

    def start(self) -> None:
        """Make the first call (in the caller's thread: a blocked receiver's own)."""
        resolve = self._resolve
        if not isinstance(resolve, str):
            try:
                self._address = resolve()
            except UnavailableError as e:
                self._retry_later(_RESOLVE_PERIOD, self.start, str(e))
                return
            except RendezvousError as e:
                self._deliver(e, None)
                return
            self._resolve = self._address
        try:
            self._channel = self._ctx.channels.channel(self._address)
            messages.encode_request(self.step_id, self.key.full_key, self._request_id)
        except RendezvousError as e:  # a bad address, or a step id the wire cannot carry
            self._deliver(e, None)
            return
        self._attempt()

    # -- the unary phase ----------------------------------------------------------------

    def _attempt(self) -> None:
        acks: list[int] = []
        # The receiving thread's own call: it waits on it and decodes it itself.
        own = self._blocking and threading.get_ident() == self._owner
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
                        self.step_id,
                        self.key.full_key,
                        self._request_id,
                        finished=acks,
                        inline_max=self._ctx.inline_max,
                    )
                    assert self._channel is not None
                    call = self._channel.unary_unary(RECV_TENSOR_METHOD).future(
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
                self._own = call if own else None
                self._acks = acks
        if expired:
            self._timed_out()
            return
        if call is None:
            self._ctx.acks.give_back(self._address, acks)
            assert failure is not None
            self._deliver(failure, None)
            return
        if not own:
            call.add_done_callback(self._on_callback)

    def _on_callback(self, call: Any) -> None:
        """The unary call's outcome, in gRPC's channel thread (never block here).

        Whatever goes wrong here fails this receive: its caller must not wait forever.
        """
        try:
            self._outcome(call, here=False)
        except Exception as e:
            _log.exception("RecvTensor callback for %s failed", self._where())
            self._deliver(InternalError(f"receiving {self._where()}: {e!r}"), None)

    def _claim(self, call: Any) -> None:
        """Under the lock: this thread handles ``call``'s answer (no other will)."""
        self._call = self._own = None
        self._state = _ARRIVED

    def _outcome(self, call: Any, *, here: bool) -> None:
        acks = self._acks
        with self._lock:
            if self._state != _PENDING or self._call is not call or call.cancelled():
                if not call.cancelled() and call.exception() is not None:
                    # Cancelled or closed meanwhile: a failed request may not have
                    # reached the server, so its acks go out again with the next one.
                    self._ctx.acks.give_back(self._address, acks)
                return  # answered there
            error = call.exception()
            if error is None and call.result():
                self._claim(call)
            else:
                self._call = self._own = None
        if error is None:
            self._answered(call.result(), here)
            return
        self._ctx.acks.give_back(self._address, acks)
        code = error_code(error)
        if self.out_of_files(error):
            pass
        elif code == grpc.StatusCode.UNAVAILABLE:
            self._last_unavailable = error
            pause, self._backoff = self._backoff, min(self._backoff * 2, _RETRY_MAX)
            self._retry_later(pause, self._attempt)
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and self._deadline is None:
            self._attempt()  # the server's longest wait (max_wait), not ours: ask again
        else:
            self.release_if_late(code)
            self._deliver(self.error(code, error), None)

    def _answered(self, data: bytes, here: bool) -> None:
        if not data:
            self._start_stream()  # larger than inline_max: it waits in the server's cache
        elif here or len(data) <= _COPY_IN_CHANNEL_THREAD:
            self._take(data, here)
        else:
            # Copying a large tensor would stall gRPC's channel thread (every call on the
            # channel): decode and copy it on a callback thread instead.
            self._ctx.runner.submit(self._take_off_channel, data)

    def _take_off_channel(self, data: bytes) -> None:
        try:
            self._take(data, True)
        except Exception as e:  # the caller must not wait forever
            _log.exception("decoding the RecvTensor answer for %s failed", self._where())
            self._deliver(InternalError(f"receiving {self._where()}: {e!r}"), None, here=True)

    def _take(self, data: bytes, here: bool) -> None:
        try:
            decoded = messages.decode_response(data)
        except RendezvousError as e:
            self._deliver(
                InternalError(
                    f"bad RecvTensor answer from {self._address} for {self._where()}: {e}"
                ),
                None,
                here=here,
            )
            return
        self._ctx.acks.ack(self._address, self._request_id)
        # The one copy: a private, writable array (the response bytes are read-only).
        value = np.array(decoded.value, copy=True)
        self._deliver(None, Received(value, decoded.is_dead), here=here)

    def _give_up(self) -> None:
        """Tell the server we will not take this request_id's value (MarkRecvFinished with
        shmrdv's "released" flag): a value it took goes back to its key's head now."""
        if self._channel is not None:
            notify(self._channel, self._request_id, self._ctx.metadata, released=True)

    def release_if_late(self, code: grpc.StatusCode) -> None:
        """The deadline passed with a call out: the server may have taken a value for it
        (being streamed, or answered too late). Releasing gives it back to the head of its
        key at once: the next receive gets it, in order, rather than a later value while
        this one waits in the server's cache until it expires."""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._issued:
            self._give_up()

    def _retry_later(self, pause: float, then: Callable[[], None], why: str = "") -> None:
        """Run ``then`` after ``pause`` (a transient UNAVAILABLE: the same request_id
        again, so a response lost on the wire is not lost; or an address not known yet)."""
        remaining = self._remaining()
        if remaining is not None:
            if remaining <= 0:
                self._timed_out(why)
                return
            pause = max(0.0, min(pause, remaining))
        timer = threading.Timer(pause, then)
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
            if self._state not in (_PENDING, _ARRIVED):
                return
            self._state = _PENDING
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
        request = messages.encode_request(self.step_id, self.key.full_key, self._request_id)
        assert self._channel is not None
        method = self._channel.unary_stream(RECV_TENSOR_STREAM_METHOD)
        mid_stream_failures = 0
        while True:
            with self._lock:
                if self._state in (_DONE, _CANCELLED):
                    return
                remaining = self._remaining()
                if remaining is not None and remaining <= 0:
                    break
                call = method(request, timeout=remaining, metadata=self._ctx.metadata)
                self._call = call
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
                if delivered or self._state in (_DONE, _CANCELLED) or self.out_of_files(e):
                    return
                code = error_code(e)
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
                    pause, self._backoff = self._backoff, min(self._backoff * 2, _RETRY_MAX)
                    remaining = self._remaining()
                    self._wake.wait(pause if remaining is None else max(0.0, min(pause, remaining)))
                    continue
                self.release_if_late(code)
                self._deliver(self.error(code, e), None)
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
            notify(self._channel, self._request_id, self._ctx.metadata)
            return
        self._timed_out()

    def error(self, code: grpc.StatusCode, e: grpc.RpcError) -> RendezvousError:
        """The receive's error for a call that failed with ``code``."""
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
