"""A receive's unary phase: its ``RecvTensor`` calls, made again until one answers.

``UnaryCalls`` makes the calls of one ``call.Recv`` (its ``UnaryOwner``), all under the
receive's request_id, with shmrdv's ``inline_max`` and the acks that ride on them: gRPC
futures, whose outcomes arrive in gRPC's channel thread. (A blocked receiver's own calls,
made in its thread, are the client's: ``client.OwnCall``.) An answer with the value is
decoded and copied once into the writable array delivered (``messages.decode_received``);
an empty answer (the value is larger than ``inline_max``) hands the receive
to its stream phase (``UnaryOwner.start_stream``); a failure is retried or ends the
receive (``UnaryOwner``).

Thread model (docs/threads.md): it shares its receive's lock (the call in flight and the
receive's state change together); methods named ``*_locked`` are called with it held.
The channel thread never blocks here: a large answer is decoded on a ``Runner`` thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import grpc

from .._errors import CancelledError, InternalError, RendezvousError
from .._rendezvous import Received
from . import messages
from .channels import recv_tensor
from .recv_context import CallContext
from .rpc_errors import error_code

__all__ = ["UnaryCalls", "UnaryOwner"]

_log = logging.getLogger("shmrdv.rpc.client")

# An answer larger than this is decoded and copied on a callback thread, not in gRPC's
# channel thread (a copy of a few hundred KiB costs less than the thread switch).
_COPY_IN_CHANNEL_THREAD = 1 << 20


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
    """The ``RecvTensor`` calls of one receive (see the module's docstring)."""

    def __init__(
        self,
        owner: UnaryOwner,
        lock: threading.Lock,
        ctx: CallContext,
        request: tuple[int, str, int],  # step_id, full key, request_id
    ) -> None:
        self._owner = owner
        self._lock = lock
        self._ctx = ctx
        self._step_id, self._full_key, self._request_id = request
        self._call: Any = None  # the future in flight
        self._acks: list[int] = []  # the acks the future in flight carries
        self.issued = False  # some call went out: the server may hold a value for it

    # -- for the receive (its lock held where named so) ----------------------------------

    def answering_locked(self) -> bool:
        """The future in flight completed with the value: it is on its way to ``done``.
        Otherwise it is cancelled (an error or an empty answer would start more work)."""
        call = self._call
        return (
            call is not None
            and not call.cancel()
            and call.exception() is None
            and bool(call.result())
        )

    def stop(self) -> None:
        """Cancel the future in flight."""
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

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
        """Make the next call: a future, its outcome in gRPC's channel thread."""
        owner = self._owner
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
                    call = recv_tensor(owner.channel).future(
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
            self.failed(error, acks)

    def failed(self, error: grpc.RpcError, acks: list[int]) -> None:
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
            received = messages.decode_received(data)
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
        owner.deliver(None, received, here=here)
