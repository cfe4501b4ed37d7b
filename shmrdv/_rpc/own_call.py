"""OwnCall: a blocked receiver's ``RecvTensor`` call, made by the receiving thread.

A blocked receiver (``RpcClient.start_recv(blocking=True)``) whose key's values are small
makes its call itself: a plain blocking unary call that grpcio answers in the calling
thread (no channel thread, no future, no hop: measured ~250 µs less per call than waiting
on a future), with a deadline of at most the wait's period (0.2 s), made again under the
same request_id while nothing comes (the server's response cache makes the repeats
safe). The answer is decoded once, into the writable array the slot gets
(``messages.decode_received``), and its ack rides on the next request (``acks``).
Anything else (a value to stream, a failure to retry or name, about a second of nothing,
after which one long future costs less than repeats) goes on as a ``call.Recv`` under the
same request_id, which finds the value the server may hold for it.

Thread model (docs/threads.md): only the receiving thread calls ``wait``; ``cancel`` and
``close`` may come from any thread. One lock guards the state; ``done`` (a slot's: quick,
never blocks or raises) never runs under it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from .._callbacks import DoneCallback
from .._errors import CancelledError, InternalError, RendezvousError
from .._keys import ParsedKey
from . import messages
from .acks import notify
from .call import Recv
from .recv_context import Address, CallContext
from .recv_errors import timeout_error
from .rpc_errors import error_code

__all__ = ["OWN_CALL_MAX", "OwnCall"]

#: A blocked receiver makes its own call while its key's values are at most this large;
#: larger ones go through a future, answered in gRPC's channel thread. Measured (bench,
#: pinned, same run): the own call cut a 64 KiB round trip from 1.8-2.2 ms to 1.1 ms, but
#: made 1 MiB slower (4-5.5 ms against 3.1-3.6 ms; again with this module: shmrdv_grpc_step
#: at 1 MiB x3.9-8.0 the pull with a 1 MiB limit, x0.7-2.6 with this one).
OWN_CALL_MAX = 256 << 10
# After this many own calls (about a second of the wait's 0.2 s turns) without a value,
# a blocked receiver waits on one long call instead: an idle receiver's repeats cost
# 0.8-1 % of a core (bench idle probe), one long call about 0.5 %.
_OWN_CALLS_IDLE = 5

#: The client's side of an own call's end: ``end(own, None)`` (ended) or ``end(own, recv)``
#: (goes on as ``recv``: the client queues and starts it).
End = Callable[["OwnCall", Recv | None], None]
# OwnCall's states: no call out; the receiving thread's call out; ended (delivered,
# failed or cancelled); gone on as a ``Recv``.
_IDLE, _CALLING, _ENDED, _HANDED = range(4)


class OwnCall:
    """A blocked receiver's receive made by its own thread (the module's docstring).

    ``entry``: the producer's channel and its RecvTensor callable; ``k``: (step, full
    key); ``lookup``: the producer's address as ``call.Recv`` takes it.

    ``wait`` makes one blocking ``RecvTensor`` call (deadline: the wait's period) and
    decodes its answer into the slot; a call ended by that deadline is made again at the
    next ``wait`` under the same request_id. A stream, a failure, or about a second of
    nothing hands the receive to a ``call.Recv`` under the same request_id
    (``RpcClient._end_own``), which retries, streams or names the error.
    """

    __slots__ = (
        "_call",
        "_channel",
        "_ctx",
        "_deadline",
        "_end",
        "_lock",
        "_lookup",
        "_made",
        "_recv",
        "_state",
        "_timeout",
        "address",
        "done",
        "k",
        "key",
        "request_id",
    )

    def __init__(
        self,
        ctx: CallContext,
        end: End,
        lookup: Address,
        address: str,
        entry: tuple[grpc.Channel, grpc.UnaryUnaryMultiCallable],
        k: tuple[int, str],
        key: ParsedKey,
        done: DoneCallback,
        timeout: float | None,
        request_id: int,
    ) -> None:
        self._ctx = ctx
        self._end = end
        self._lookup = lookup
        self.address = address
        self._channel, self._call = entry
        self.k = k
        self.key = key
        self.done = done
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.request_id = request_id
        self._lock = threading.Lock()
        self._state = _IDLE
        self._made = 0  # calls made (a call out may have had a value taken for it)
        self._recv: Recv | None = None

    def where(self) -> str:
        return f"key {self.k[1]!r} (step {self.k[0]}) from {self.address}"

    def cancel(self) -> bool:
        """The receive's canceller: ``True`` and ``done`` is never called, or ``False``
        (delivered or failed). A call out is given up when it returns."""
        with self._lock:
            state = self._state
            if state == _HANDED:
                recv = self._recv
            elif state == _ENDED:
                return False
            else:
                self._state = _ENDED
        if state == _HANDED:
            assert recv is not None
            return recv.cancel()
        if state == _IDLE and self._made:
            self._give_up()
        self._end(self, None)
        return True

    def close(self, error: BaseException) -> None:
        """Fail the receive with ``error`` unless it ended (a call out ends at its short
        deadline, then gives back what it got). A handed-over one is its ``Recv``'s."""
        with self._lock:
            if self._state in (_ENDED, _HANDED):
                return
            self._state = _ENDED
        self._end(self, None)
        self.done(error, None)

    def _give_up(self) -> None:
        """A value the server took for this request_id goes back to its key's head."""
        notify(self._channel, self.request_id, self._ctx.metadata, released=True)

    def wait(self, timeout: float) -> None:
        """The receiving thread makes the call (see the class docstring)."""
        ctx = self._ctx
        deadline = self._deadline
        t = timeout if deadline is None else min(timeout, deadline - time.monotonic())
        with self._lock:
            if self._state != _IDLE:
                return
            if t <= 0:
                self._state = _ENDED
                late = True
            else:
                self._state = _CALLING
                late = False
        if late:  # the receive's own timeout: what the server took for it goes back
            if self._made:
                self._give_up()
            self._end(self, None)
            self.done(timeout_error(self._timeout, self.where(), None), None)
            return
        acks = ctx.acks.take(self.address)
        data = b""
        failure: BaseException | None = None
        try:
            request = messages.encode_request(
                self.k[0], self.k[1], self.request_id, finished=acks, inline_max=ctx.inline_max
            )
            self._made += 1
            data = self._call(request, timeout=max(t, 0.001), metadata=ctx.metadata)
        except grpc.RpcError as e:
            failure = e
        except RendezvousError as e:  # a step id or key the wire cannot carry
            failure = e
        except ValueError as e:  # the channel was closed under us
            failure = CancelledError(f"receiving {self.where()}: {e}")
        with self._lock:
            mine = self._state == _CALLING
            if mine:
                ended = bool(data) or isinstance(failure, RendezvousError)
                self._state = _ENDED if ended else _IDLE
        if failure is not None:
            ctx.acks.give_back(self.address, acks)
        if not mine:  # cancelled or closed meanwhile
            self._give_up()
            return
        if data:
            self._deliver(data)
        elif isinstance(failure, RendezvousError):
            self._end(self, None)
            self.done(failure, None)
        elif (
            isinstance(failure, grpc.RpcError)
            and error_code(failure) == grpc.StatusCode.DEADLINE_EXCEEDED
            and self._made < _OWN_CALLS_IDLE
        ):
            return  # the call's own short deadline: the next wait calls again
        else:
            assert failure is None or isinstance(failure, grpc.RpcError)
            self._hand_over(failure)

    def _deliver(self, data: bytes) -> None:
        ctx = self._ctx
        try:
            received = messages.decode_received(data)
        except RendezvousError as e:
            self._end(self, None)
            self.done(InternalError(f"bad RecvTensor answer for {self.where()}: {e}"), None)
            return
        ctx.acks.ack(self.address, self.request_id)
        self._end(self, None)
        ctx.count(self.key, received.value.nbytes)
        self.done(None, received)

    def _hand_over(self, failure: grpc.RpcError | None) -> None:
        """Go on as a ``Recv`` under the same request_id (it finds the value the server
        may hold for it): a stream, a failure to retry or name, or a long wait."""
        remaining = None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)
        recv = Recv(
            self._ctx,
            self._lookup,
            self.k[0],
            self.key,
            self.done,
            remaining,
            True,
            self.request_id,
        )
        recv.resume(self.address, failure)
        with self._lock:
            if self._state != _IDLE:
                return  # cancelled or closed meanwhile
            self._state = _HANDED
            self._recv = recv
        self._end(self, recv)
