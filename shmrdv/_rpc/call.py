"""One receive over gRPC: the state its phases share, ended exactly once.

``Recv`` is one ``RpcClient.start_recv`` (TensorFlow's ``RpcRecvTensorCall``), under the
request_id the client drew for it. Its unary phase (``recv_unary.UnaryCalls``) asks
``RecvTensor`` with shmrdv's ``inline_max``: a tensor up to that size comes back in the one response; a
larger one stays in the server's response cache and the answer is empty bytes, and the
receive then streams it (``recv_stream``) under the same request_id (a cache hit) on a
thread of its own, assembled into one array. Either way the consumer makes one copy of
the bytes: the response into the writable array it delivers. ``Recv`` holds what the
phases share (the state, the producer's address and channel, the deadline, retries
after a transient ``UNAVAILABLE``) and ends the receive exactly once. The errors
themselves, and when a producer counts as gone, are ``recv_errors``'.

A receive is TensorFlow's ``RecvFromRemoteAsync`` (research/tf_rendezvous.md §3.1) with
these additions:

* a transient ``UNAVAILABLE`` (peer not up yet, connection refused or reset before any
  data came) is retried with backoff (50 ms doubling to 1 s) and the *same*
  ``request_id``, until the caller cancels or its ``timeout`` expires. The server's
  response cache makes that safe: a retry joins the first attempt's waiter or gets its
  delivered value, so a response lost on the wire is not a lost tensor;
* a producer that was reached and then went away (its server stopping, the connection
  lost) fails the receive with ``UnavailableError`` naming it, its address and the gRPC
  status: at once when its server said it is stopping, else after 1 s of not coming
  back (``recv_errors.PeerWatch``), as shared memory notices a dead producer;
* a server's longest wait (``RpcServer(max_wait=)``) ending a receive without a timeout
  of its own is asked again, transparently;
* once data is flowing the call can no longer be cancelled (the producer has given the
  value away); a connection lost mid-stream is retried twice (the server still caches
  the value), then fails with ``UnavailableError``. No partial array is ever delivered;
* a cancelled call tells the server (``MarkRecvFinished`` with shmrdv's "released"
  flag): a value the server took for it goes back to its key's head;
* acks (TensorFlow's ``MarkRecvFinished``) ride on the next request to the same peer;
  one that none takes within 50 ms goes on its own (``acks``);
* a peer's bytes that do not parse, or describe an impossible tensor (the element-count
  rule of ``_values.shape_problem``), fail the receive with ``InternalError`` naming the
  peer, before anything is allocated.

What it uses of its client is ``recv_context.CallContext``.

Thread model (docs/threads.md): unary outcomes arrive in gRPC's channel thread (a blocked
receiver's own calls are ``own_call.OwnCall``'s, which hands a receive it cannot finish
to a ``Recv``); a streamed value has a thread of its own ("shmrdv-rpc-recv"); a retry or a wait for the
producer's address runs on a timer thread. One lock guards the state; ``done`` never
runs under it, and runs exactly once unless ``cancel`` returned ``True``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from .._errors import RendezvousError, ResourceExhaustedError, UnavailableError
from .._keys import ParsedKey
from .._rendezvous import DoneCallback, Received, invoke_done
from . import messages, recv_stream
from .acks import notify
from .recv_context import Address, CallContext
from .recv_errors import PeerWatch, call_error, out_of_files, timeout_error
from .recv_unary import UnaryCalls

__all__ = ["Recv"]

_RETRY_INITIAL = 0.05
_RETRY_MAX = 1.0
# How often a receive looks again for the address of a producer that has not started:
# at first every 50 ms, then less often (doubling, up to 0.4 s), so a receive that waits
# long for a producer to start costs a few timers a second, not twenty.
_RESOLVE_PERIOD = 0.05
_RESOLVE_MAX = 0.4

# PENDING: no data yet (cancellable); ARRIVED: an answer is being decoded; RECEIVING: a
# stream is flowing; DONE: delivered or failed; CANCELLED.
_PENDING, _ARRIVED, _RECEIVING, _DONE, _CANCELLED = range(5)


class Recv:
    """One ``start_recv``: its state, its phases and its canceller.

    ``blocking``: ``done`` is a blocked receiver's slot (quick, never blocks): it is
    filled in whatever thread the outcome arrives.
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
        request_id: int,
    ) -> None:
        self._ctx = ctx
        self._resolve = address
        self._lookup = None if isinstance(address, str) else address
        self._address = address if isinstance(address, str) else "(address not known yet)"
        self._channel: grpc.Channel | None = None
        self.step_id = step_id
        self.key = key
        self.done = done
        self._blocking = blocking
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._request_id = request_id
        self._lock = threading.Lock()
        self._state = _PENDING
        self._streaming = False  # the RecvTensorStream phase (in self.thread)
        self._stream_call: Any = None  # the stream call in flight
        self._timer: threading.Timer | None = None
        self._backoff = _RETRY_INITIAL
        self._resolve_pause = _RESOLVE_PERIOD
        self._last_unavailable: grpc.RpcError | None = None
        self._peer = PeerWatch()  # whether the producer went away
        self._wake: threading.Event | None = None  # ends a stream's backoff pause early
        self.thread: threading.Thread | None = None
        self._unary = UnaryCalls(self, self._lock, ctx, (step_id, key.full_key, request_id))
        self._resumed: tuple[grpc.RpcError | None] | None = None  # ``resume``

    @property
    def receiving(self) -> bool:
        """Data is flowing: the receive can no longer be cancelled."""
        return self._state == _RECEIVING

    @property
    def ended(self) -> bool:
        """Delivered, failed or cancelled."""
        return self._state in (_DONE, _CANCELLED)

    @property
    def address(self) -> str:
        """The producer's ``host:port`` (a placeholder until it is known)."""
        return self._address

    @property
    def channel(self) -> grpc.Channel:
        """The channel to the producer (known once ``start`` found it)."""
        assert self._channel is not None
        return self._channel

    def where(self) -> str:
        return f"key {self.key.full_key!r} (step {self.step_id}) from {self._address}"

    # -- called by other threads -------------------------------------------------------

    def cancel(self) -> bool:
        """Stop, and ``done`` is never called (``True``); ``False`` once delivered or failed.

        ``False`` also once a unary call has answered with the value (it is on its way to
        ``done``). Mid-stream the partial value is dropped, so a receive whose deadline
        expires while a large tensor is (slowly) arriving does not wait past it. Whenever a
        call went out, the server is told to give back a value it took for it (to its
        key's head) instead of parking it for a retry that never comes; a blocked
        receiver's own call still in progress tells it when it returns.
        """
        with self._lock:
            if self._state not in (_PENDING, _RECEIVING):
                return False
            if not self._streaming and self._unary.answering_locked():
                return False
            self._state = _CANCELLED
            timer, self._timer = self._timer, None
            issued = self._unary.issued
            call = self._stream_call if self._streaming else None
            wake = self._wake
        if wake is not None:
            wake.set()
        self._unary.stop()
        if timer is not None:
            timer.cancel()
        if call is not None:
            call.cancel()
        if issued:
            self.give_up()
        self._ctx.forget(self)
        return True

    def close(self, error: BaseException) -> None:
        """Fail this receive with ``error`` unless it already finished (client closed,
        step aborted): the call in flight is stopped."""
        with self._lock:
            if self._state in (_DONE, _CANCELLED):
                return
            self._state = _DONE
            timer, self._timer = self._timer, None
            call = self._stream_call
            wake = self._wake
        if wake is not None:
            wake.set()
        self._unary.stop()
        if timer is not None:
            timer.cancel()
        if call is not None:
            call.cancel()
        self._ctx.forget(self)
        invoke_done(self._spend(), error, None)

    # -- ending ----------------------------------------------------------------------

    def deliver(
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
            self._ctx.count(self.key, received.value.nbytes)
        done = self._spend()
        if here or self._blocking or threading.current_thread() is self.thread:
            invoke_done(done, error, received)
        else:
            self._ctx.runner.submit(invoke_done, done, error, received)

    def _spend(self) -> DoneCallback:
        """``done``, once it is due (the state says so): the receive keeps no reference to
        it. Its objects refer to one another (its unary phase, gRPC's future), so a ``done``
        kept here would keep its caller's future, and the value, until a GC pass."""
        done, self.done = self.done, _spent
        return done

    def remaining(self) -> float | None:
        """Seconds to the receive's deadline (None: none)."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def timed_out(self, why: str = "") -> None:
        """The deadline passed: fail with ``DeadlineExceededError``."""
        self.deliver(timeout_error(self._timeout, self.where(), self._last_unavailable, why), None)

    def out_of_files(self, e: grpc.RpcError) -> bool:
        """Out of descriptors (``recv_errors.out_of_files``): fail, and drop the channel."""
        error = out_of_files(e, self.where())
        if error is None:
            return False
        self._ctx.channels.drop_channel(self._address, self._channel)
        self.deliver(error, None)
        return True

    # -- starting: the producer's address and channel ---------------------------------

    def start(self) -> None:
        """Find the producer's address and channel, then make the first call. A step id or key the wire cannot
        carry fails when the request is encoded."""
        resolve = self._resolve
        if not isinstance(resolve, str):
            try:
                self._address = resolve()
            except UnavailableError as e:
                pause = self._resolve_pause
                self._resolve_pause = min(2 * pause, _RESOLVE_MAX)
                self._retry_later(pause, self.start, str(e))
                return
            except RendezvousError as e:
                self.deliver(e, None)
                return
            self._resolve = self._address
        try:
            self._channel = self._ctx.channels.channel(self._address)
        except RendezvousError as e:  # a bad address
            self.deliver(e, None)
            return
        resumed, self._resumed = self._resumed, None
        if resumed is None:
            self._unary.attempt()
        elif resumed[0] is None:
            self.start_stream()
        else:
            self._unary.failed(resumed[0], [])

    def resume(self, address: str, failure: grpc.RpcError | None) -> None:
        """Before ``start``: a call under this request_id to ``address`` (an own call,
        ``own_call``) answered "stream it" (``failure`` None) or failed so; ``start``
        goes on from there (streams, or retries or names the failure)."""
        self._address = self._resolve = address
        self._resumed = (failure,)
        self._unary.issued = True

    def _again(self) -> None:
        """A retry after UNAVAILABLE: look the producer's address up again first (it may
        have restarted elsewhere), then call."""
        if self._lookup is not None:
            try:
                address = self._lookup()
            except RendezvousError:
                address = self._address
            if address != self._address:
                try:
                    channel = self._ctx.channels.channel(address)
                except RendezvousError as e:
                    self.deliver(e, None)
                    return
                with self._lock:
                    self._address, self._channel = address, channel
                    self._peer.reset()
        self._unary.attempt()

    def _retry_later(self, pause: float, then: Callable[[], None], why: str = "") -> None:
        """Run ``then`` after ``pause`` (a transient UNAVAILABLE: the same request_id
        again, so a response lost on the wire is not lost; or an address not known yet)."""
        remaining = self.remaining()
        if remaining is not None:
            if remaining <= 0:
                self.timed_out(why)
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
            self.deliver(
                ResourceExhaustedError(f"cannot retry receiving {self.where()}: {e}"), None
            )

    def give_up(self) -> None:
        """Tell the server we will not take this request_id's value (MarkRecvFinished with
        shmrdv's "released" flag): a value it took goes back to its key's head now."""
        if self._channel is not None:
            notify(self._channel, self._request_id, self._ctx.metadata, released=True)

    def release_if_late(self, code: grpc.StatusCode) -> None:
        """The deadline passed with a call out: the server may have taken a value for it
        (being streamed, or answered too late). Releasing gives it back to the head of its
        key at once: the next receive gets it, in order, rather than a later value while
        this one waits in the server's cache until it expires."""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._unary.issued:
            self.give_up()

    # -- for the unary phase (``recv_unary.UnaryOwner``) -------------------------------

    def pending_locked(self) -> bool:
        """No answer yet and not ended (the lock is held)."""
        return self._state == _PENDING

    def arrived_locked(self) -> None:
        """An answer with the value came (the lock is held)."""
        self._state = _ARRIVED

    def retry_unavailable(self, error: grpc.RpcError) -> None:
        """A transient UNAVAILABLE: fail if the producer is gone, else call again (same
        request_id) after a backoff pause."""
        gone = self._peer.gone(error, str(self.key.src), self.where())
        if gone is not None:
            self.deliver(gone, None)
            return
        self._last_unavailable = error
        pause, self._backoff = self._backoff, min(self._backoff * 2, _RETRY_MAX)
        self._retry_later(self._peer.pause(pause), self._again)

    # -- the stream phase (a thread of its own: large values, ``recv_stream``) ----------

    def start_stream(self) -> None:
        assert self._channel is not None
        request = messages.encode_request(self.step_id, self.key.full_key, self._request_id)
        owner: recv_stream.StreamOwner = self
        thread = threading.Thread(
            target=recv_stream.run,
            args=(owner, self._channel, request, self._request_id, self._ctx.metadata),
            name="shmrdv-rpc-recv",
            daemon=True,
        )
        with self._lock:
            if self._state not in (_PENDING, _ARRIVED):
                return
            self._state = _PENDING
            self._streaming = True
            self._wake = threading.Event()
            self.thread = thread
        try:
            thread.start()
        except RuntimeError as e:  # "can't start new thread"
            self.deliver(
                ResourceExhaustedError(f"cannot start a receive thread for {self.where()}: {e}"),
                None,
            )

    def open_stream(self, start: Callable[[float | None], Any]) -> Any | None:
        """Start the next stream call as the call in flight (``recv_stream.StreamOwner``)."""
        with self._lock:
            if self._state in (_DONE, _CANCELLED):
                return None
            remaining = self.remaining()
            if remaining is None or remaining > 0:
                self._stream_call = start(remaining)
                return self._stream_call
        self.timed_out()
        return None

    def begin_receiving(self) -> bool:
        """Data is flowing: no cancel from now on; False if cancelled or closed already."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _RECEIVING
            return self._state == _RECEIVING

    def pause_unavailable(self, error: grpc.RpcError) -> None:
        """A backoff pause after a transient UNAVAILABLE mid-stream (a cancel ends it)."""
        self._last_unavailable = error
        pause, self._backoff = self._backoff, min(self._backoff * 2, _RETRY_MAX)
        remaining = self.remaining()
        assert self._wake is not None  # made when the stream phase started
        self._wake.wait(pause if remaining is None else max(0.0, min(pause, remaining)))

    def error(self, code: grpc.StatusCode, e: grpc.RpcError) -> RendezvousError:
        """The receive's error for a call that failed with ``code``."""
        return call_error(code, e, self.where(), self._timeout, receiving=self._state == _RECEIVING)


def _spent(error: BaseException | None, received: Received | None) -> None:
    """A receive's ``done`` once it has been called (``Recv._spend``)."""
