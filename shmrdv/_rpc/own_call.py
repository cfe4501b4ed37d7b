"""OwnCall: a blocked receiver's ``RecvTensor`` call, made by the receiving thread.

A blocked receiver (``RpcClient.start_recv(blocking=True)``) whose key's values are small
makes its call itself: a plain blocking unary call that grpcio answers in the calling
thread (no channel thread, no future, no hop: measured ~250 µs less per call than waiting
on a future), with a deadline of at most the wait's period (0.2 s), made again under the
same request_id while nothing comes (the server's response cache makes the repeats
safe). The answer is decoded once, into the writable array the slot gets
(``messages.decode_received``), and its ack rides on the next request to the same peer
(the peer's queue of ``acks.AckQueue``, used through its deque: no call into ``acks``).
Anything else (a value to stream, a failure to retry or name, about a second of nothing,
after which one long future costs less than repeats) goes on as a ``call.Recv`` under the
same request_id, which finds the value the server may hold for it.

``OwnCalls`` keeps a client's own calls, and the receives of a key that come while its
own call is out; ``GrpcTransport`` starts and waits on them directly.

Thread model (docs/threads.md): only the receiving thread calls ``wait``; ``cancel`` and
``close`` may come from any thread. One lock guards an own call's state; ``OwnCalls``'
tables are guarded by the client's lock, which it is given. ``done`` (a slot's: quick,
never blocks or raises) never runs under either.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping

import grpc

from .._errors import CancelledError, InternalError, RendezvousError
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback
from . import messages
from .acks import notify
from .call import Recv
from .recv_context import Address, CallContext, new_request_id
from .recv_errors import timeout_error
from .rpc_errors import error_code

__all__ = ["OWN_CALL_MAX", "OwnCall", "OwnCalls"]

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
# Keys whose last value size is remembered (``OwnCalls``: too large for an own call?).
_SIZES_KEPT = 4096

#: The client's side, under its lock, of an own call that ended or goes on as a ``Recv``
#: (``then``): queue it and the receives behind it; return the one to start now and the
#: error to fail ``then`` with (closed, aborted), each or None.
Follow = Callable[
    [tuple[int, str], "Recv | None", list[Recv]], tuple["Recv | None", "BaseException | None"]
]
# OwnCall's states: no call out; the receiving thread's call out; ended (delivered,
# failed or cancelled); gone on as a ``Recv``.
_IDLE, _CALLING, _ENDED, _HANDED = range(4)
_Peer = tuple[grpc.UnaryUnaryMultiCallable, "deque[tuple[int, float]]", grpc.Channel]


class OwnCalls:
    """The own calls of one client's blocked receivers (the module docstring). ``lock``
    is the client's and guards the tables here too; under it are read the client's
    ``aborted`` steps and its ``Recv``s in flight (``inflight``; ``queued(k)``: one of key
    ``k``); ``follow`` is the client's side of an own call's end."""

    def __init__(
        self,
        ctx: CallContext,
        *,
        lock: threading.Lock,
        aborted: Mapping[int, BaseException],
        inflight: Collection[Recv],
        queued: Callable[[tuple[int, str]], bool],
        follow: Follow,
    ) -> None:
        self._ctx = ctx
        self._lock = lock
        self._aborted = aborted
        self._inflight = inflight
        self._queued = queued
        self._follow = follow
        self._pid = os.getpid()
        self.closed = False  # set by the client (under the lock) when it closes
        #: The own calls out, by their slot's ``done`` (a blocked receiver's wait finds
        #: its own there) and by (step, full key); read only, the latter under the lock.
        self.by_done: dict[DoneCallback, OwnCall] = {}
        self.by_key: dict[tuple[int, str], OwnCall] = {}
        self._behind: dict[tuple[int, str], list[Recv]] = {}  # receives that came meanwhile
        # Per producer address: its RecvTensor callable, its queue of acks, its channel.
        self._peers: dict[str, _Peer] = {}
        self._sizes: dict[str, int] = {}  # full key -> bytes of its last value
        self.received = self.received_bytes = 0  # what the own calls delivered

    def start(
        self,
        address: Address,
        known: str | None,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        timeout: float | None = None,
    ) -> Canceller | None:
        """An own call for the blocked receive of ``key`` whose slot's ``done`` this is,
        registered (its canceller); None: a ``Recv`` instead (values too large, another
        receive of the key in flight, no address yet, a forked child, the client closed
        or the step aborted: the client knows what to do). ``known``: the producer's
        address of a moment ago, if any, else ``address`` is asked."""
        if self._pid != os.getpid() or self._sizes.get(key.full_key, 0) > OWN_CALL_MAX:
            return None
        if known is None:
            try:
                known = address if isinstance(address, str) else address()
            except RendezvousError:
                return None  # the Recv waits for it, or names the problem
        peer = self._peers.get(known)
        entry = self._ctx.channels.calls.get(known)
        if peer is None or entry is None or entry[0] is not peer[2]:  # new, or reopened
            peer = self._peer(known)
            if peer is None:
                return None
        k = (step_id, key.full_key)
        own = OwnCall(self, self._ctx, address, known, peer, k, key, done, timeout)
        with self._lock:
            if self.closed or step_id in self._aborted or self._out(k):
                return None
            self.by_done[done] = own
            self.by_key[k] = own
        return own.cancel

    def busy(self, k: tuple[int, str]) -> bool:
        """Whether a ``RecvTensor`` of (step, full key) ``k`` is out or queued here (an
        own call, or a ``Recv``): a receive of ``k`` that went elsewhere would break its
        order."""
        with self._lock:
            return self._out(k)

    def _out(self, k: tuple[int, str]) -> bool:
        """``busy``, the lock held."""
        return k in self.by_key or (bool(self._inflight) and self._queued(k))

    def _peer(self, address: str) -> _Peer | None:
        """``address``'s channel (opened now if need be), its callable and its acks."""
        try:
            channel = self._ctx.channels.channel(address)
        except RendezvousError:
            return None
        entry = self._ctx.channels.calls.get(address)
        if entry is None or entry[0] is not channel:
            return None
        peer = self._peers[address] = (entry[1], self._ctx.acks.pending(address), channel)
        return peer

    # -- the client's side: under its lock, but ``learn`` ---------------------------------

    def queue_behind(self, k: tuple[int, str], recv: Recv) -> None:
        """``recv`` waits for ``k``'s own call to end."""
        self._behind.setdefault(k, []).append(recv)

    def drop_behind(self, k: tuple[int, str], recv: Recv) -> bool:
        """Take ``recv`` out of those waiting behind ``k``'s own call, if it is there."""
        behind = self._behind.get(k)
        if behind is None or recv not in behind:
            return False
        behind.remove(recv)
        if not behind:
            del self._behind[k]
        return True

    def take_step(self, step_id: int) -> tuple[list[OwnCall], list[Recv]]:
        """The own calls of ``step_id``, and the receives behind them (out of the table)."""
        recvs: list[Recv] = []
        for k in [k for k in self._behind if k[0] == step_id]:
            recvs += self._behind.pop(k)
        return [own for k, own in self.by_key.items() if k[0] == step_id], recvs

    def take_all(self) -> list[OwnCall]:
        """Closing: every own call (the receives behind them are the client's to fail)."""
        self.closed = True
        self._behind.clear()
        return list(self.by_key.values())

    def learn(self, key: ParsedKey, nbytes: int) -> None:
        """A value of ``nbytes`` came for ``key`` (an own call is for small ones)."""
        sizes = self._sizes
        if len(sizes) >= _SIZES_KEPT and key.full_key not in sizes:
            sizes.clear()  # a bound, not an LRU: a hint is cheap to learn again
        sizes[key.full_key] = nbytes

    # -- an own call's end ----------------------------------------------------------------

    def ended(self, own: OwnCall, then: Recv | None = None) -> None:
        """``own`` has ended, or goes on as ``then`` (its ``Recv``, started here): the
        receives of its key that came meanwhile follow (``Follow``)."""
        k = own.k
        with self._lock:
            if self.by_done.get(own.done) is own:
                del self.by_done[own.done]
            if self.by_key.get(k) is own:
                del self.by_key[k]
            behind = self._behind.pop(k, None)
            if then is None and behind is None:
                return
            head, failed = self._follow(k, then, behind or [])
        if then is not None and failed is not None:
            then.close(failed)
        if head is not None:
            head.start()

    def delivered(self, own: OwnCall, nbytes: int) -> None:
        """``own`` delivered a value of ``nbytes``: its ack rides on the next request to
        its peer, and it has ended."""
        own.acks.append((own.request_id, time.monotonic()))
        self.received += 1
        self.received_bytes += nbytes
        if self._sizes.get(own.key.full_key) != nbytes:
            self.learn(own.key, nbytes)
        self.ended(own)


class OwnCall:
    """A blocked receiver's receive made by its own thread (the module's docstring):
    ``wait`` makes one call and decodes its answer into the slot, or hands the receive
    to a ``call.Recv`` under the same request_id (``OwnCalls.ended``).

    ``peer``: the producer's RecvTensor callable, its queue of acks and its channel;
    ``k``: (step, full key); ``lookup``: the producer's address as ``call.Recv`` takes it.
    """

    __slots__ = (
        "_call",
        "_channel",
        "_ctx",
        "_deadline",
        "_lock",
        "_lookup",
        "_made",
        "_owner",
        "_recv",
        "_state",
        "_timeout",
        "acks",
        "address",
        "done",
        "k",
        "key",
        "request_id",
    )

    def __init__(
        self,
        owner: OwnCalls,
        ctx: CallContext,
        lookup: Address,
        address: str,
        peer: _Peer,
        k: tuple[int, str],
        key: ParsedKey,
        done: DoneCallback,
        timeout: float | None,
    ) -> None:
        self._owner = owner
        self._ctx = ctx
        self._lookup = lookup
        self.address = address
        self._call, self.acks, self._channel = peer
        self.k = k
        self.key = key
        self.done = done
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.request_id = new_request_id(63) | 1  # odd: never 0
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
        self._owner.ended(self)
        return True

    def close(self, error: BaseException) -> None:
        """Fail the receive with ``error`` unless it ended (a call out ends at its short
        deadline, then gives back what it got). A handed-over one is its ``Recv``'s."""
        with self._lock:
            if self._state in (_ENDED, _HANDED):
                return
            self._state = _ENDED
        self._owner.ended(self)
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
            self._owner.ended(self)
            self.done(timeout_error(self._timeout, self.where(), None), None)
            return
        # The acks waiting for this peer ride on the request (the acker thread sends
        # those that wait too long: ``acks``); the queue's own deque, taken here.
        acks: list[int] = []
        pending = self.acks
        try:
            while pending and len(acks) < messages.MAX_ACKS:
                acks.append(pending.popleft()[0])
        except IndexError:  # the acker took the last one meanwhile
            pass
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
            self._owner.ended(self)
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
        try:
            received = messages.decode_received(data)
        except RendezvousError as e:
            self._owner.ended(self)
            self.done(InternalError(f"bad RecvTensor answer for {self.where()}: {e}"), None)
            return
        self._owner.delivered(self, received.value.nbytes)
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
        self._owner.ended(self, recv)
