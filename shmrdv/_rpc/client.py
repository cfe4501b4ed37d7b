"""RpcClient: the consumer's client of the gRPC transport (TensorFlow's RpcRecvTensorCall).

``start_recv`` pulls the next value of a key from the producer's worker with a fresh
random non-zero ``request_id``: one unary ``RecvTensor`` per receive, as TensorFlow's
worker makes, answered as soon as the value is sent; a tensor larger than ``inline_max``
is then streamed in chunks with ``RecvTensorStream`` (``call.Recv``). Receives of one key
go out one at a time, in order: concurrent calls for one key would reach the producer in
any order and break the channel's FIFO promise (the oldest receive gets the oldest
value). The call is TensorFlow's ``RecvFromRemoteAsync`` (research/tf_rendezvous.md §3.1)
with these additions:

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

Modules: ``call`` (one receive; its phases ``recv_unary`` and ``recv_stream``),
``recv_errors`` (its errors), ``channels`` (the channel per peer, with fork handling),
``acks`` (acks piggybacked or sent late), ``runner`` (the callback threads).
This module is the client's face: it orders receives, opens them and closes it all.

Thread model (docs/threads.md): the sync gRPC API; thread-safe. A blocking receive
(``blocking=True``, then ``wait``) makes its call from the receiving thread and waits on
it there: no thread of ours in between. Otherwise a unary call's outcome arrives in
gRPC's channel thread and ``done`` runs on a reused callback thread (``runner``); a
streamed (large) value has a thread of its own. (An asyncio channel would need none of
this, but grpc.aio does not survive ``fork`` — measured: a forked child's aio calls time
out — while a fresh sync channel in the child works; research/pitfalls.md §6.) ``done``
never runs under a lock, and exactly once unless the canceller returned ``True``.

Fork: channels are per process. A client used in a parent and then in a forked child
notices the new pid and opens fresh ones in the child; the parent's are left alone
(``channels``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

import grpc

from .._callbacks import DoneCallback, invoke_done
from .._errors import CancelledError, InvalidArgumentError, RendezvousError
from .._keys import ParsedKey
from .._rendezvous import Canceller, as_parsed_key, check_timeout
from .._status import error_for_code
from .._waiters import WaiterTable
from . import messages
from .acks import AckQueue
from .call import Recv
from .channels import ChannelCache
from .methods import DEFAULT_INLINE_MAX, GET_STATUS_METHOD
from .recv_context import Address, CallContext
from .rpc_errors import error_code, error_details
from .runner import Runner
from .security import TLSConfig, bearer_metadata, check_token

__all__ = ["RpcClient"]

_JOIN_TIMEOUT = 5.0
# Keys whose last value size is remembered (``_last_size``).
_SIZES_KEPT = 4096


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
        self._blocked: dict[DoneCallback, Recv] = {}  # blocking receives, by their slot
        self._aborted: dict[int, BaseException] = {}
        self._closed = False
        self._counters = {"received": 0, "received_bytes": 0}
        self._sizes: dict[str, int] = {}  # full key -> bytes of its last value
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
            last_size=self._last_size,
        )

    def _check_fork(self) -> None:
        if self._channels.forked():
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
    ) -> Canceller:
        """Start pulling the next value of ``key`` from the worker at ``address``.

        ``address``: ``host:port``, or a function returning it that raises
        ``UnavailableError`` while the producer's address is not known (asked again every
        50 ms). Returns at once. ``done(error, Received)`` is called exactly once unless
        the returned canceller answers ``True`` (it does while no data has arrived; the
        call is then stopped and its server-side waiter removed). The value is a private,
        writable array. ``timeout`` bounds the whole receive, retries included
        (``DeadlineExceededError``); without it an unreachable peer is retried until the
        caller cancels. Errors name the key and the peer: the server's error class
        (``AbortedError``, ``InvalidArgumentError``, ...), ``UnavailableError`` for a
        connection lost mid-stream, ``UnauthenticatedError`` for a refused token.

        ``blocking``: ``done`` is quick and never blocks (a blocked receiver's slot), and
        the caller calls ``wait(done, ...)`` until it has run: the call is made, waited on
        and decoded in the caller's thread. Otherwise ``done`` runs on a callback thread.

        Raises ``AbortedError`` (the step was aborted: ``abort_step``) at once; ``done``
        is then never called.
        """
        self._check_fork()
        t = check_timeout(timeout)
        try:
            pk = as_parsed_key(key)
        except RendezvousError as e:
            invoke_done(done, e, None)
            return _too_late
        recv = Recv(self._context, address, int(step_id), pk, done, t, blocking)
        k = (recv.step_id, pk.full_key)
        with self._lock:
            err = self._aborted.get(recv.step_id)
            if err is not None:
                raise err
            if self._closed:
                closed = True
            else:
                closed = False
                first = self._queues.wait(k, recv)
                self._inflight.add(recv)
                if blocking:
                    self._blocked[done] = recv
        if closed:
            invoke_done(done, CancelledError("RpcClient is closed"), None)
            return _too_late
        if first:
            recv.start()
        return recv.cancel

    def wait(self, done: DoneCallback, timeout: float) -> bool:
        """Help the blocking receive whose ``done`` this is: wait up to ``timeout`` on the
        call it made, and decode its answer here. False: nothing to help with now (wait
        on ``done``'s slot instead)."""
        recv = self._blocked.get(done)
        return recv is not None and recv.wait(timeout)

    def _forget(self, recv: Recv) -> None:
        """``recv`` has ended: the next receive of its key goes out."""
        k = (recv.step_id, recv.key.full_key)
        nxt = None
        with self._lock:
            self._inflight.discard(recv)
            if self._blocked.get(recv.done) is recv:
                del self._blocked[recv.done]
            was_head = self._queues.head(k) is recv
            if self._queues.cancel(k, recv) and was_head:
                nxt = self._queues.head(k)
        if nxt is not None:
            nxt.start()

    def _count(self, key: ParsedKey, nbytes: int) -> None:
        self._counters["received"] += 1
        self._counters["received_bytes"] += nbytes
        if len(self._sizes) >= _SIZES_KEPT and key.full_key not in self._sizes:
            self._sizes.clear()  # a bound, not an LRU: a hint is cheap to learn again
        self._sizes[key.full_key] = nbytes

    def _last_size(self, key: ParsedKey) -> int:
        """Bytes of the last value of ``key`` received (0: none yet): how a blocked
        receiver of it will wait (``call``)."""
        return self._sizes.get(key.full_key, 0)

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Fail every receive of ``step_id`` with ``error``; later ones raise it at once."""
        with self._lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            # Out of the table first: closing one then starts no later one.
            recvs = self._queues.abort(lambda k: k[0] == step_id)
        for recv in recvs:
            recv.close(error)

    def cleanup_step(self, step_id: int) -> None:
        """Forget that ``step_id`` was aborted (it is cleaned up)."""
        with self._lock:
            self._aborted.pop(step_id, None)

    def get_status(
        self, address: str, *, timeout: float = 5.0
    ) -> tuple[messages.DeviceAttributes, ...]:
        """TensorFlow's ``GetStatus`` of the worker at ``address`` (its devices); blocks.

        Public for tools (``shmrdv serve`` checks, probes): a cheap "is this peer up and
        whose incarnation is it" call; receives never need it. Raises the mapped
        error (``UnavailableError`` when the peer cannot be reached).
        """
        t = check_timeout(timeout)
        self._check_fork()
        channel = self._channels.channel(address)
        try:
            data = channel.unary_unary(GET_STATUS_METHOD)(b"", timeout=t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_for_code(error_code(e))(
                f"GetStatus of {address} failed: {error_details(e)}"
            ) from e
        try:
            return messages.decode_status_response(data)
        except RendezvousError as e:
            raise type(e)(f"bad GetStatusResponse from {address}: {e}") from e

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
        out.update(self._counters)
        with self._lock:
            out["inflight"] = len(self._inflight)
            out["receiving"] = sum(1 for r in self._inflight if r.receiving)
        return out

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else "open"
        return f"<shmrdv RpcClient {state} channels={s['channels']} inflight={s['inflight']}>"


def _too_late() -> bool:
    return False
