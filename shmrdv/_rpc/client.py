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

Modules: ``call`` (one receive's RPCs), ``channels`` (the channel and Exchange link per
peer, with fork handling), ``acks`` (acks piggybacked or sent late), ``runner`` (the
callback threads). This module is the client's face: it opens receives and closes it all.

Thread model: the sync gRPC API; thread-safe. A link has a reader thread
("shmrdv-rpc-link") that decodes each reply and calls ``done`` itself when the caller
said ``direct`` (a blocking receive's own slot), else hands it to a reused callback
thread. A unary call's outcome arrives in gRPC's channel thread, handled the same way; a
streamed (large) value has a thread of its own. (An asyncio channel would need none of
this, but grpc.aio does not survive ``fork`` — measured: a forked child's aio calls time
out — while a fresh sync channel in the child works; research/pitfalls.md §6.) ``done``
never runs under a lock, and exactly once unless the canceller returned ``True``.

Fork: channels and links are per process. A client used in a parent and then in a
forked child notices the new pid and opens fresh ones in the child; the parent's are
left alone (``channels``).
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
from . import messages
from .acks import AckQueue
from .call import CallContext, Recv
from .channels import ChannelCache
from .link import Link
from .methods import DEFAULT_INLINE_MAX, GET_STATUS_METHOD
from .rpc_errors import error_code, error_details
from .runner import Runner
from .security import TLSConfig, bearer_metadata, check_token

__all__ = ["RpcClient"]

_JOIN_TIMEOUT = 5.0


class RpcClient:
    """Pulls values from shmrdv (and TensorFlow) workers over gRPC.

    Args:
        tls: use TLS (``TLSConfig`` with the CA of the servers, and a client
            certificate for servers that require one). ``None``: plaintext.
        token: send ``authorization: Bearer <token>`` with every call.
        inline_max: largest tensor a peer answers in its unary response.

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
        self._lock = threading.Lock()  # guards _inflight and _closed
        self._inflight: set[Recv] = set()
        self._closed = False
        self._acks = AckQueue(self._metadata, self._route)
        self._channels = ChannelCache(self._tls, self._metadata, self._acks.take)
        self._runner = Runner()
        self._context = CallContext(
            channels=self._channels,
            acks=self._acks,
            runner=self._runner,
            metadata=self._metadata,
            inline_max=self._inline_max,
            forget=self._forget,
        )

    def _route(self, address: str) -> tuple[grpc.Channel | None, Link | None]:
        return self._channels.route(address)

    def _check_fork(self) -> None:
        if self._channels.forked():
            # A forked child: the parent's channels, threads and locks are not ours.
            self._reset()

    def _channel(self, address: str) -> grpc.Channel:
        self._check_fork()
        return self._channels.channel(address)

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
        recv = Recv(self._context, channel, address, int(step_id), pk, done, t, direct)
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

    def get_status(
        self, address: str, *, timeout: float = 5.0
    ) -> tuple[messages.DeviceAttributes, ...]:
        """TensorFlow's ``GetStatus`` of the worker at ``address`` (its devices); blocks.

        Public for tools (``shmrdv serve`` checks, probes): a cheap "is this peer up and
        whose incarnation is it" call; receives never need it. Raises the mapped
        error (``UnavailableError`` when the peer cannot be reached).
        """
        t = check_timeout(timeout)
        channel = self._channel(address)
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

    def _forget(self, recv: Recv) -> None:
        with self._lock:
            self._inflight.discard(recv)

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
        by_address, links = self._channels.close()
        unsent = self._acks.close(_JOIN_TIMEOUT)
        for recv in inflight:
            recv.close(CancelledError("RpcClient closed"))
        for link in links:
            link.close()
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
        """Counters: channels open, receives in flight, and of those the ones receiving data."""
        out = self._channels.stats()
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
