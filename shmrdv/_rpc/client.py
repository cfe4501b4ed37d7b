"""RpcClient: the consumer's client of the gRPC transport (TensorFlow's RpcRecvTensorCall).

``start_recv`` pulls the next value of a key from the producer's worker with a fresh
random non-zero ``request_id``: one unary ``RecvTensor`` per receive, as TensorFlow's
worker makes, answered as soon as the value is sent; a tensor larger than ``inline_max``
is then streamed in chunks with ``RecvTensorStream`` (``call.Recv``). Receives of one key
go out one at a time, in order: concurrent calls for one key would reach the producer in
any order and break the channel's FIFO promise (the oldest receive gets the oldest
value). The call is TensorFlow's ``RecvFromRemoteAsync`` (research/tf_rendezvous.md §3.1)
with additions (retries, a producer gone, cancels, acks, bad bytes) that ``call``
describes.

A blocked receiver of small values makes its call itself, in its own thread
(``own_call.OwnCalls``, which ``own_calls`` exposes so that ``GrpcTransport`` starts and
waits on them without a call through here); anything else is a ``call.Recv``.

Modules: ``own_call`` (a blocked receiver's own call), ``call`` (one receive; its phases
``recv_unary`` and ``recv_stream``), ``recv_errors`` (its errors), ``channels`` (the
channel per peer, with fork handling), ``acks`` (acks piggybacked or sent late),
``runner`` (the callback threads).
This module is the client's face: it orders receives, opens them and closes it all.

Thread model (docs/threads.md): the sync gRPC API; thread-safe. A blocking receive
(``blocking=True``, then ``wait``) makes its call from the receiving thread and waits on
it there (``own_call``): no thread of ours in between. Otherwise a unary call's outcome
arrives in gRPC's channel thread and ``done`` runs on a reused callback thread (``runner``); a
streamed (large) value has a thread of its own (grpc.aio would need none of this, but it
does not survive ``fork``: research/pitfalls.md §6). ``done`` never runs under a lock,
and exactly once unless the canceller returned ``True``.

Fork: channels are per process. A client used in a parent and then in a forked child
notices the new pid and opens fresh ones in the child; the parent's are left alone
(``channels``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from types import TracebackType

import grpc

from .._channels import WaiterTable
from .._errors import CancelledError, InvalidArgumentError, RendezvousError
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback, as_parsed_key, check_timeout, invoke_done
from .acks import AckQueue
from .call import Recv
from .channels import ChannelCache
from .methods import DEFAULT_INLINE_MAX
from .own_call import OwnCalls
from .recv_context import Address, CallContext, new_request_id
from .runner import Runner
from .security import TLSConfig, bearer_metadata, check_token
from .status import DeviceAttributes, get_status

__all__ = ["RpcClient"]

_JOIN_TIMEOUT = 5.0


class RpcClient:
    """Pulls values from shmrdv (and TensorFlow) workers over gRPC.

    Args:
        tls: use TLS (``TLSConfig`` with the CA of the servers, and a client
            certificate for servers that require one). ``None``: plaintext.
        token: send ``authorization: Bearer <token>`` with every call.
        inline_max: largest tensor asked for in RecvTensor's one response; larger ones
            are streamed in chunks.

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

    def _reset(self) -> None:
        self._lock = threading.Lock()  # guards the tables below and _closed
        self._inflight: set[Recv] = set()
        # Per (step, key): its receives in order, as waiters (they never queue values:
        # the producer holds those); the head's call is in flight.
        self._queues: WaiterTable[tuple[int, str], None, Recv] = WaiterTable()
        self._pid = os.getpid()
        self._aborted: dict[int, BaseException] = {}
        self._closed = False
        self._counters = {"received": 0, "received_bytes": 0}
        self._channels = ChannelCache(self._tls)
        self._acks = AckQueue(self._metadata, self._channels.route)
        self._runner = Runner()
        self._context = CallContext(
            channels=self._channels,
            acks=self._acks,
            runner=self._runner,
            metadata=self._metadata,
            inline_max=self._inline_max,
            forget=self._forget,
            count=self._count,
        )
        #: The blocked receivers' own calls, under this client's lock: a key with one has
        #: no ``Recv`` in ``_queues``; receives that come meanwhile wait behind it and
        #: join ``_queues`` when it ends (``_follow``).
        self.own_calls = OwnCalls(
            self._context,
            lock=self._lock,
            aborted=self._aborted,
            inflight=self._inflight,
            queued=self._queues.has,  # it never holds values: a key there has a Recv
            follow=self._follow,
        )

    def _check_fork(self) -> None:
        if self._pid != os.getpid() and self._channels.forked():
            # A forked child: the parent's channels, threads and locks are not ours.
            self._reset()

    # -- receiving -------------------------------------------------------------------------

    def start_recv(
        self,
        address: Address,
        step_id: int,
        key: ParsedKey | str,
        done: DoneCallback,
        *,
        timeout: float | None = None,
        blocking: bool = False,
        known: str | None = None,
    ) -> Canceller:
        """Start pulling the next value of ``key`` from the worker at ``address``.

        ``address``: ``host:port``, or a function returning it that raises
        ``UnavailableError`` while the producer's address is not known (asked again every
        50 ms); ``known``: its answer of a moment ago, if any. Returns at once.
        ``done(error, Received)`` is called exactly once unless the returned canceller
        answers ``True`` (it does while no data has arrived). The value is a private,
        writable array. ``timeout`` bounds the whole receive, retries included
        (``DeadlineExceededError``). Errors name the key and the peer (``call``).

        ``blocking``: ``done`` is quick and never blocks or raises (a blocked receiver's
        slot), and the caller calls ``wait(done, ...)`` until it has run: for small
        values the call is made, waited on and decoded in the caller's thread
        (``own_call``). Otherwise ``done`` runs on a callback thread.

        Raises ``AbortedError`` (the step was aborted: ``abort_step``) at once.
        """
        if self._pid != os.getpid():
            self._check_fork()
        t = None if timeout is None else check_timeout(timeout)
        if blocking and type(key) is ParsedKey:
            own = self.own_calls.start(address, known, int(step_id), key, done, t)
            if own is not None:
                return own
        try:
            pk = as_parsed_key(key)
        except RendezvousError as e:
            invoke_done(done, e, None)
            return _too_late
        request_id = new_request_id(63) | 1  # odd: never 0
        recv = Recv(self._context, address, int(step_id), pk, done, t, blocking, request_id)
        k = (recv.step_id, pk.full_key)
        with self._lock:
            err = self._aborted.get(recv.step_id)
            if err is not None:
                raise err
            if self._closed:
                closed = True
            else:
                closed = first = False
                if k in self.own_calls.by_key:
                    self.own_calls.queue_behind(k, recv)
                else:
                    first = self._queues.wait(k, recv)
                self._inflight.add(recv)
        if closed:
            invoke_done(done, CancelledError("RpcClient is closed"), None)
            return _too_late
        if first:
            recv.start()
        return recv.cancel

    def wait(self, done: DoneCallback, timeout: float) -> bool:
        """Help the blocking receive whose ``done`` this is: make its own call, up to
        ``timeout``, and decode its answer here. False: nothing to help with now (wait
        on ``done``'s slot instead)."""
        own = self.own_calls.by_done.get(done)
        if own is None:
            return False
        own.wait(timeout)
        return True

    def channel(self, address: str) -> grpc.Channel:
        """This process's channel to ``address`` (opened on first use; the client's TLS);
        ``InvalidArgumentError`` for a bad address."""
        self._check_fork()
        return self._channels.channel(address)

    @property
    def metadata(self) -> Sequence[tuple[str, str]]:
        """What goes with every call (the token, if any)."""
        return self._metadata

    def _forget(self, recv: Recv) -> None:
        """``recv`` has ended: the next receive of its key goes out."""
        k = (recv.step_id, recv.key.full_key)
        nxt = None
        with self._lock:
            self._inflight.discard(recv)
            if self.own_calls.drop_behind(k, recv):
                return
            was_head = self._queues.head(k) is recv
            if self._queues.cancel(k, recv) and was_head:
                nxt = self._queues.head(k)
        if nxt is not None:
            nxt.start()

    def _follow(
        self, k: tuple[int, str], then: Recv | None, behind: list[Recv]
    ) -> tuple[Recv | None, BaseException | None]:
        """``own_call.Follow``, under the lock: ``then`` (an own call gone on as a
        ``Recv``) and the receives behind the own call join ``_queues`` in order."""
        if then is not None and (self._closed or k[0] in self._aborted):
            return None, self._aborted.get(k[0]) or CancelledError("RpcClient is closed")
        if then is not None:
            behind = [then, *behind]
            self._inflight.add(then)
        head = None
        for recv in behind:
            if self._queues.wait(k, recv) and head is None:
                head = recv
        return head, None

    def _count(self, key: ParsedKey, nbytes: int) -> None:
        self._counters["received"] += 1
        self._counters["received_bytes"] += nbytes
        self.own_calls.learn(key, nbytes)

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Fail every receive of ``step_id`` with ``error``; later ones raise it at once."""
        with self._lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            # Out of the tables first: closing one then starts no later one.
            recvs = self._queues.abort(lambda k: k[0] == step_id)
            owns, behind = self.own_calls.take_step(step_id)
            recvs += behind
        for own in owns:
            own.close(error)
        for recv in recvs:
            recv.close(error)

    def cleanup_step(self, step_id: int) -> None:
        """Forget that ``step_id`` was aborted (it is cleaned up)."""
        with self._lock:
            self._aborted.pop(step_id, None)

    def get_status(self, address: str, *, timeout: float = 5.0) -> tuple[DeviceAttributes, ...]:
        """TensorFlow's ``GetStatus`` of the worker at ``address`` (its devices); blocks.

        Public for tools (``shmrdv serve`` checks, probes): a cheap "is this peer up and
        whose incarnation is it" call; receives never need it. Raises the mapped
        error (``UnavailableError`` when the peer cannot be reached).
        """
        t = check_timeout(timeout)
        self._check_fork()
        return get_status(self._channels.channel(address), address, self._metadata, t)

    # -- lifetime ----------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """Fail receives in flight with ``error`` (default ``CancelledError``), join their
        threads, close channels. Idempotent; blocks up to a few seconds per receive thread.
        """
        self._check_fork()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inflight = self._queues.abort()
            inflight += [r for r in self._inflight if r not in inflight]
            owns = self.own_calls.take_all()
        for own in owns:
            own.close(error if error is not None else CancelledError("RpcClient closed"))
        by_address = self._channels.close()
        unsent = self._acks.close(_JOIN_TIMEOUT)
        for recv in inflight:
            recv.close(error if error is not None else CancelledError("RpcClient closed"))
        for recv in inflight:
            if recv.thread is not None and recv.thread is not threading.current_thread():
                recv.thread.join(_JOIN_TIMEOUT)
        self._runner.shutdown(_JOIN_TIMEOUT)
        self._acks.flush(unsent, by_address)
        for channel in by_address.values():
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
        """Counters: channels open, receives in flight (and of those the ones receiving
        data), values and bytes received."""
        out = self._channels.stats()
        own = self.own_calls
        out["received"] = self._counters["received"] + own.received
        out["received_bytes"] = self._counters["received_bytes"] + own.received_bytes
        with self._lock:
            out["inflight"] = len(self._inflight) + len(own.by_key)
            out["receiving"] = sum(1 for r in self._inflight if r.receiving)
        return out

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else "open"
        return f"<shmrdv RpcClient {state} channels={s['channels']} inflight={s['inflight']}>"


def _too_late() -> bool:
    return False
