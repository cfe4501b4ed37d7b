"""A receive's unary phase: its ``RecvTensor`` calls, made again until one answers.

``UnaryCalls`` makes the calls of one ``call.Recv`` (its ``UnaryOwner``), all under the
receive's request_id, with shmrdv's ``inline_max`` and the acks that ride on them. A
blocked receiver of small values makes its own call in ``wait``: a plain blocking unary
call, which grpcio answers in the calling thread (no channel thread, no future: measured
~250 µs less per call than waiting on a future), with a deadline of at most the wait's
period (0.2 s), made again until the value comes (the server's response cache makes the
repeats safe). Any other call is a gRPC future whose outcome arrives in gRPC's channel
thread. An answer with the value is decoded and copied once into the writable array
delivered; an empty answer (the value is larger than ``inline_max``) hands the receive
to its stream phase (``UnaryOwner.start_stream``); a failure is retried or ends the
receive (``UnaryOwner``).

Thread model (docs/threads.md): it shares its receive's lock (the call in flight and the
receive's state change together); methods named ``*_locked`` are called with it held.
The channel thread never blocks here: a large answer is decoded on a ``Runner`` thread.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Protocol

import grpc
import numpy as np

from .._errors import CancelledError, InternalError, RendezvousError
from .._received import Received
from . import messages
from .methods import RECV_TENSOR_METHOD
from .recv_context import CallContext
from .rpc_errors import error_code

__all__ = ["UnaryCalls", "UnaryOwner"]

_log = logging.getLogger("shmrdv.rpc.client")

# After this many own calls (about a second of the wait's 0.2 s turns) without a value,
# a blocked receiver waits on one long call instead: an idle receiver's repeats cost
# 0.8-1 % of a core (bench idle probe), one long call about 0.5 %.
_OWN_CALLS_IDLE = 5
# A blocked receiver's own call in flight (``UnaryCalls._call``): no future to cancel.
_OWN: Any = object()
# An answer larger than this is decoded and copied on a callback thread, not in gRPC's
# channel thread (a copy of a few hundred KiB costs less than the thread switch).
_COPY_IN_CHANNEL_THREAD = 1 << 20
# Each channel's RecvTensor callable, made once: ``Channel.unary_unary`` costs a few
# microseconds per call (grpcio builds a closure and evaluates its type annotations).
_RECV_TENSOR: weakref.WeakKeyDictionary[grpc.Channel, grpc.UnaryUnaryMultiCallable] = (
    weakref.WeakKeyDictionary()
)


def _recv_tensor(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """``channel``'s RecvTensor callable (identity serializers: bytes in, bytes out)."""
    method = _RECV_TENSOR.get(channel)
    if method is None:
        method = _RECV_TENSOR[channel] = channel.unary_unary(RECV_TENSOR_METHOD)
    return method


class UnaryOwner(Protocol):
    """The receive whose calls these are (``call.Recv``)."""

    @property
    def address(self) -> str: ...

    @property
    def channel(self) -> grpc.Channel: ...

    def pending_locked(self) -> bool:
        """No answer yet and not ended (the receive's lock is held)."""

    def arrived_locked(self) -> None:
        """An answer with the value came: it is being decoded (lock held)."""

    def where(self) -> str: ...

    def remaining(self) -> float | None: ...

    def deliver(
        self, error: BaseException | None, received: Received | None, *, here: bool = False
    ) -> None: ...

    def timed_out(self) -> None: ...

    def out_of_files(self, error: grpc.RpcError) -> bool: ...

    def retry_unavailable(self, error: grpc.RpcError) -> None:
        """A transient UNAVAILABLE: fail if the producer is gone, else ``attempt`` again
        after a pause."""

    def release_if_late(self, code: grpc.StatusCode) -> None: ...

    def error(self, code: grpc.StatusCode, error: grpc.RpcError) -> RendezvousError: ...

    def give_up(self) -> None: ...

    def start_stream(self) -> None: ...


class UnaryCalls:
    """The ``RecvTensor`` calls of one receive (see the module's docstring).

    ``own_calls``: the receiving thread (the one constructing this) makes them itself in
    ``wait``, while its key's values are small.
    """

    def __init__(
        self,
        owner: UnaryOwner,
        lock: threading.Lock,
        ctx: CallContext,
        request: tuple[int, str, int],  # step_id, full key, request_id
        own_calls: bool,
    ) -> None:
        self._owner = owner
        self._lock = lock
        self._ctx = ctx
        self._step_id, self._full_key, self._request_id = request
        self._own_calls = own_calls
        self._thread = threading.get_ident()  # the receiving thread
        # A blocked receiver's next call is its own to make (in ``wait``), set once the
        # address is known; ``_go`` wakes it when another thread made it so.
        self._own_turn = False
        self._own_made = 0  # own calls made (each ends at its short deadline, or answered)
        self._go = threading.Event()
        self._call: Any = None  # the call in flight: a future, or _OWN
        self._acks: list[int] = []  # the acks the future in flight carries
        self.issued = False  # some call went out: the server may hold a value for it

    # -- for the receive (its lock held where named so) ----------------------------------

    def answering_locked(self) -> bool:
        """The future in flight completed with the value: it is on its way to ``done``.
        Otherwise it is cancelled (an error or an empty answer would start more work)."""
        call = self._call
        return (
            call is not None
            and call is not _OWN
            and not call.cancel()
            and call.exception() is None
            and bool(call.result())
        )

    def own_call_out_locked(self) -> bool:
        """The receiving thread's own call is in progress (it gives up when it returns)."""
        return self._call is _OWN

    def stop(self) -> None:
        """Cancel the future in flight and wake a receiving thread waiting for its turn."""
        with self._lock:
            call = self._call
        if call is not None and call is not _OWN:
            call.cancel()
        self._go.set()

    # -- making the calls ----------------------------------------------------------------

    def _request(self, acks: list[int]) -> bytes:
        return messages.encode_request(
            self._step_id,
            self._full_key,
            self._request_id,
            finished=acks,
            inline_max=self._ctx.inline_max,
        )

    def attempt(self) -> None:
        """Make the next call: a future (its outcome in gRPC's channel thread), or for a
        blocked receiver, its turn to make it itself (``wait``)."""
        owner = self._owner
        if self._own_calls and self._own_made < _OWN_CALLS_IDLE:
            with self._lock:
                if not owner.pending_locked():
                    return
                self._own_turn = True
            self._go.set()
            return
        # A receiver that waited that long for nothing waits on one long call (a future)
        # from now on: its repeats would cost CPU for a latency nobody waits for.
        self._own_calls = False
        acks: list[int] = []
        with self._lock:
            if not owner.pending_locked():
                return
            remaining = owner.remaining()
            if remaining is not None and remaining <= 0:
                expired = True
            else:
                expired = False
                acks = self._ctx.acks.take(owner.address)
                failure: RendezvousError | None = None
                try:
                    request = self._request(acks)
                    call = _recv_tensor(owner.channel).future(
                        request, timeout=remaining, metadata=self._ctx.metadata
                    )
                    self.issued = True
                except RendezvousError as e:  # a step id or key the wire cannot carry
                    call = None
                    failure = e
                except ValueError as e:  # the channel was closed under us
                    call = None
                    failure = CancelledError(f"receiving {owner.where()}: {e}")
                self._call = call
                self._acks = acks
        if expired:
            owner.timed_out()
            return
        if call is None:
            self._ctx.acks.give_back(owner.address, acks)
            assert failure is not None
            owner.deliver(failure, None)
            return
        call.add_done_callback(self._on_callback)

    def wait(self, timeout: float) -> bool:
        """A blocked receiver makes its own call here: a plain blocking unary call, the
        one grpcio answers in the calling thread (no channel thread, no future), with a
        deadline of at most ``timeout``; an answer is decoded and its slot filled here.
        A call that ends at that deadline is made again under the same request_id at
        the next ``wait`` (the server's response cache makes that safe). While its turn
        has not come (queued behind another receive of the key, its producer's address
        not known yet, a retry's pause) it waits up to ``timeout`` for it. False: nothing
        to do here (not the receiving thread): wait on the slot instead."""
        if not self._own_calls or threading.get_ident() != self._thread:
            return False
        owner = self._owner
        end = time.monotonic() + timeout
        if not self._own_turn:
            self._go.wait(timeout)
        failure: RendezvousError | None = None
        with self._lock:
            if not owner.pending_locked() or not self._own_turn:
                return True
            self._own_turn = False
            self._go.clear()
            left = end - time.monotonic()
            remaining = owner.remaining()
            if remaining is not None and remaining <= 0:
                expired = True
            else:
                expired = False
                t = max(left, 0.001) if remaining is None else min(max(left, 0.001), remaining)
                acks = self._ctx.acks.take(owner.address)
                try:
                    request = self._request(acks)
                except RendezvousError as e:
                    failure = e
                else:
                    self._call = _OWN
                    self.issued = True
                    self._own_made += 1
        if expired:
            owner.timed_out()
            return True
        if failure is not None:
            self._ctx.acks.give_back(owner.address, acks)
            owner.deliver(failure, None, here=True)
            return True
        data = b""
        error: grpc.RpcError | None = None
        try:
            data = _recv_tensor(owner.channel)(request, timeout=t, metadata=self._ctx.metadata)
        except grpc.RpcError as e:
            error = e
        except ValueError as e:  # the channel was closed under us
            owner.deliver(CancelledError(f"receiving {owner.where()}: {e}"), None, here=True)
            return True
        finally:
            with self._lock:
                if self._call is _OWN:
                    self._call = None
                mine = owner.pending_locked()
                if mine and error is None and data:
                    owner.arrived_locked()
        if not mine:
            # Cancelled or closed while the call was out: a value the server took for it
            # goes back to its key's head.
            owner.give_up()
            return True
        if error is None:
            self._answered(data, here=True)
        else:
            self._failed(error, acks)
        return True

    # -- outcomes ------------------------------------------------------------------------

    def _on_callback(self, call: Any) -> None:
        """The future's outcome, in gRPC's channel thread (never block here).

        Whatever goes wrong here fails this receive: its caller must not wait forever.
        """
        try:
            self._outcome(call)
        except Exception as e:
            _log.exception("RecvTensor callback for %s failed", self._owner.where())
            self._owner.deliver(InternalError(f"receiving {self._owner.where()}: {e!r}"), None)

    def _outcome(self, call: Any) -> None:
        acks = self._acks
        with self._lock:
            if not self._owner.pending_locked() or self._call is not call or call.cancelled():
                if not call.cancelled() and call.exception() is not None:
                    # Cancelled or closed meanwhile: a failed request may not have
                    # reached the server, so its acks go out again with the next one.
                    self._ctx.acks.give_back(self._owner.address, acks)
                return  # answered there
            error = call.exception()
            self._call = None
            if error is None and call.result():
                self._owner.arrived_locked()
        if error is None:
            self._answered(call.result(), here=False)
        else:
            self._failed(error, acks)

    def _failed(self, error: grpc.RpcError, acks: list[int]) -> None:
        """A call failed: try again (same request_id) or fail the receive."""
        owner = self._owner
        self._ctx.acks.give_back(owner.address, acks)
        code = error_code(error)
        if owner.out_of_files(error):
            return
        if code == grpc.StatusCode.UNAVAILABLE:
            owner.retry_unavailable(error)
            return
        remaining = owner.remaining()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and (remaining is None or remaining > 0):
            # The call's own short deadline (a blocked receiver's), or the server's longest
            # wait (max_wait), not the receive's: ask again, same request_id.
            self.attempt()
            return
        owner.release_if_late(code)
        owner.deliver(owner.error(code, error), None)

    def _answered(self, data: bytes, here: bool) -> None:
        if not data:
            self._owner.start_stream()  # larger than inline_max: it waits in the server's cache
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
            where = self._owner.where()
            _log.exception("decoding the RecvTensor answer for %s failed", where)
            self._owner.deliver(InternalError(f"receiving {where}: {e!r}"), None, here=True)

    def _take(self, data: bytes, here: bool) -> None:
        owner = self._owner
        try:
            decoded = messages.decode_response(data)
        except RendezvousError as e:
            owner.deliver(
                InternalError(
                    f"bad RecvTensor answer from {owner.address} for {owner.where()}: {e}"
                ),
                None,
                here=here,
            )
            return
        self._ctx.acks.ack(owner.address, self._request_id)
        # The one copy: a private, writable array (the response bytes are read-only).
        value = np.array(decoded.value, copy=True)
        owner.deliver(None, Received(value, decoded.is_dead), here=here)
