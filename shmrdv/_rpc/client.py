"""RpcClient: the consumer's one receive state machine over gRPC.

A receive (``Recv``, TensorFlow's ``RpcRecvTensorCall``) pulls a (step, key)'s next
value with ``RecvTensor`` under a random request_id: in the blocked receiver's thread
(turns of at most ``TURN`` under that request_id, which the response cache makes safe)
or as a grpcio future; a chunked value's other chunks by offset. Receives of one key go
in order (``WaiterTable``). A key received again by a blocked receiver switches to
``RecvTensorSeries`` (``series``), read in its thread. A producer not listening yet is
retried until the deadline, one gone gets ``GONE_GRACE``; see ``error_for_code``.

Thread model (docs/threads.md): thread-safe; one lock (and its condition, on which
blocked receivers wait their turn), no call made under it; ``done`` of a callback
receive runs in gRPC's channel thread; its retry pause is a ``threading.Timer``.
"""

from __future__ import annotations

import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from .._channels import MISSING, WaiterTable
from .._errors import (
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
    error_for_code,
)
from .._keys import ParsedKey
from .._rendezvous import (
    Canceller,
    DoneCallback,
    Received,
    as_parsed_key,
    check_timeout,
    invoke_done,
)
from .channels import Channels, Peer, status
from .guard import TLSConfig, bearer_metadata, check_token
from .messages import Assembly, DeviceAttributes, encode_request, take_ids
from .outbox import SERVER_STOPPING
from .series import SeriesCall

__all__ = ["GONE_GRACE", "TURN", "Address", "RpcClient"]

#: The longest call a blocked receiver makes before it looks at its deadline and abort.
TURN = 0.2
#: A producer reached and then gone has this long to come back (as long as shared memory
#: takes to see a dead producer's presence record go).
GONE_GRACE = 1.0
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0
_CHUNKS_IN_FLIGHT = 4
# A blocked receiver whose turns brought nothing (0.4 s) waits on one long call.
_IDLE_TURNS = 2
_CHUNK_RETRIES = 2
_ACK_DELAY = 0.05  # a series' values read and not acknowledged are, after this long
_SEEN_KEPT = 4096  # receives counted per (step, key), to find the keys received again
_NO_SERIES_PAUSE = 5.0  # after a producer refused a series (its bounds)
_NEVER_CONNECTED = "failed to connect"  # grpcio's words for a peer not listening (yet)
_SHED = "CANCELLED"  # all a server's gRPC says of a call it had no room to start

#: The producer's ``host:port``, or a function giving it (told the address that refused a
#: connection, to look it up anew) that raises ``UnavailableError`` while it is not known.
Address = str | Callable[[str | None], str]

# Request ids need to be unique, not secret: seeded from the OS (again in a forked child).
_ids = random.Random(secrets.randbits(128))
os.register_at_fork(after_in_child=lambda: _ids.seed(secrets.randbits(128)))
#: One entry per fork this process is the child of: a client made before opens new channels.
_forks: list[None] = []
os.register_at_fork(after_in_child=lambda: _forks.append(None))

_QUEUED, _ACTIVE, _DONE = range(3)


class Recv:
    """One receive: its state, its calls and its canceller (the module docstring)."""

    __slots__ = (
        "address", "assembly", "backoff", "blocking", "calls", "chunks", "client", "deadline",
        "done", "future", "gone_since", "k", "key", "peer", "refused", "retries", "rid",
        "started", "state", "timeout", "timer", "turns", "why",
    )  # fmt: skip

    def __init__(
        self, client: RpcClient, address: Address, step_id: int, key: ParsedKey,
        done: DoneCallback, blocking: bool, timeout: float | None,
    ) -> None:  # fmt: skip
        self.client, self.address, self.key = client, address, key
        self.k = (step_id, key.full_key)
        self.done, self.blocking, self.timeout = done, blocking, timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.rid = _ids.getrandbits(63) | 1  # odd: never 0 (TensorFlow: GetUniqueRequestId)
        self.state = _QUEUED
        self.started = False  # driven by futures: a callback receive, or a blocked one idle
        self.turns = 0  # a blocked receiver's calls that ended with nothing
        self.peer: Peer | None = None
        self.assembly: Assembly | None = None
        self.calls = 0  # calls made under rid (the producer may hold a value for it)
        self.future: Any = None  # the callback receive's call in flight
        self.chunks: dict[int, Any] = {}  # offset -> its call in flight
        self.retries: dict[int, int] = {}
        self.timer: threading.Timer | None = None
        self.backoff = _RETRY_FIRST
        self.gone_since: float | None = None
        self.refused: str | None = None  # the address that refused the last connection
        self.why = ""  # what the last failed call said (for a timeout's error)

    def cancel(self) -> bool:
        return self.client._cancel(self)

    def where(self) -> str:
        address = self.peer.address if self.peer is not None else "(address not known yet)"
        return f"key {self.key.full_key!r} (step {self.k[0]}) from {address}"

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class RpcClient:
    """Pulls values from shmrdv (and TensorFlow) workers over gRPC (module docstring).
    ``tls``: TLS channels (``TLSConfig``: the servers' CA, a client certificate if they
    require one); ``token``: sent with every call. ``close()`` fails receives in flight."""

    def __init__(self, *, tls: TLSConfig | None = None, token: str | None = None) -> None:
        if tls is not None and not isinstance(tls, TLSConfig):
            raise InvalidArgumentError(f"tls must be a TLSConfig or None, not {type(tls).__name__}")
        self._tls = tls
        self.metadata: Sequence[tuple[str, str]] = bearer_metadata(check_token(token))
        self._reset()

    def _reset(self) -> None:
        self._fork = len(_forks)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._channels = Channels(self._tls, self.metadata)
        # Per (step, key): values read ahead by a series, or the receives in order.
        self._table: WaiterTable[tuple[int, str], Received, Recv] = WaiterTable()
        self._blocked: dict[DoneCallback, Recv] = {}  # blocking receives by their done
        self._blocking: dict[tuple[int, str], int] = {}  # blocking receives waiting per key
        self._series: dict[tuple[int, str], SeriesCall] = {}
        self._releasing: set[tuple[int, str]] = set()  # keys whose series goes back
        self._seen: dict[tuple[int, str], int] = {}
        self._key_peer: dict[str, Peer] = {}  # the producer each key was received from
        self._had_series: dict[str, None] = {}
        self._aborted: dict[int, BaseException] = {}
        self._closed = False
        self._fetching: set[Recv] = set()  # receives fetching the chunks of a value
        self.received = self.received_bytes = 0

    def __repr__(self) -> str:
        return f"<shmrdv RpcClient channels={len(self._channels)} closed={self._closed}>"

    # -- receiving --------------------------------------------------------------------------

    def start_recv(
        self, address: Address, step_id: int, key: ParsedKey | str, done: DoneCallback, *,
        timeout: float | None = None, blocking: bool = False,
    ) -> Canceller:  # fmt: skip
        """Receive the next value of ``key`` from the producer at ``address``; returns at
        once. ``done(error, Received)`` is called exactly once unless the canceller returns
        True; the value is a private, writable array. ``timeout`` bounds the whole receive
        (``DeadlineExceededError``). ``blocking``: ``done`` fills a blocked receiver's slot
        and the caller calls ``wait(done, ...)`` until it has run. Raises the step's abort
        error at once."""
        if self._fork != len(_forks):
            self._reset()  # a forked child: the parent's channels are not ours
        t = check_timeout(timeout)
        try:
            pk = as_parsed_key(key)
        except RendezvousError as e:
            invoke_done(done, e, None)
            return _too_late
        k = (int(step_id), pk.full_key)
        got: Received | None = None
        error: BaseException | None = None
        with self._lock:
            aborted = self._aborted.get(k[0])
            if aborted is not None:
                raise aborted
            if self._closed:
                error = CancelledError("RpcClient is closed")
            else:
                value = self._table.take(k)
                if value is not MISSING:
                    got = value
                    self._count(value)
                else:
                    recv = Recv(self, address, k[0], pk, done, blocking, t)
                    self._table.wait(k, recv)
                    if blocking:
                        self._blocked[done] = recv
                        self._blocking[k] = self._blocking.get(k, 0) + 1
                    n = self._seen.get(k, 0)
                    if not n and len(self._seen) >= _SEEN_KEPT:
                        self._seen.clear()  # a bound: the counts only pick the method
                    self._seen[k] = n + 1
        if error is not None or got is not None:
            invoke_done(done, error, got)
            return _too_late
        self._drive(k)
        return recv.cancel

    def wait(self, done: DoneCallback, timeout: float) -> bool:
        """Drive the blocked receive whose ``done`` this is for up to ``timeout`` seconds
        (its call, or reading its key's series); False: no such receive (wait on its slot)."""
        recv = self._blocked.get(done)
        if recv is None:
            return False
        k = recv.k
        with self._lock:
            series = self._series.get(k)
            if recv.state == _DONE:
                return True
            busy = recv.state != _ACTIVE or recv.started or recv.chunks or k in self._releasing
            if series is not None and series.reader is None and k not in self._releasing:
                series.reader = recv
            elif series is not None or busy:
                self._cond.wait(timeout)
                return True
        if series is not None:
            self._read(recv, series)
        else:
            self._call(recv, timeout)
        return True

    def _drive(self, k: tuple[int, str]) -> None:
        """Start the head of ``k``'s receives as its mode says (after any change)."""
        release = issue = None
        with self._lock:
            head = self._table.head(k)
            if head is None or k in self._releasing:
                return
            if head.state == _QUEUED:
                head.state = _ACTIVE
            series = self._series.get(k)
            if series is None and head.blocking and self._wants_series(head):
                series = self._open_series(head)
            if series is not None:
                if series.reader is None and not self._blocking.get(k):
                    release = self._series.pop(k)
                    self._releasing.add(k)
            elif not head.blocking and not head.started:
                head.started = True
                issue = head
            self._cond.notify_all()
        if release is not None:
            self._release_series(k, release)
        elif issue is not None:
            self._issue(issue)

    # -- one call: the state machine ----------------------------------------------------------

    def _peer_of(self, recv: Recv) -> Peer | None:
        """The producer's channel; None (and a retry pause) while its address is unknown."""
        address, refused = recv.address, recv.refused
        recv.refused = None
        try:
            where = address if isinstance(address, str) else address(refused)
            peer = self._channels[where]  # (never UnavailableError)
        except UnavailableError as e:
            self._pause(recv, str(e))
            return None
        except RendezvousError as e:
            self._finish(recv, e, None)
            return None
        if refused is not None and where != refused:
            recv.gone_since = None  # it came back elsewhere (restarted)
        recv.peer = peer
        if len(self._key_peer) >= _SEEN_KEPT:
            self._key_peer.clear()
        self._key_peer[recv.k[1]] = peer
        return peer

    def _request(self, recv: Recv, peer: Peer, offset: int = 0) -> tuple[bytes, list[int]]:
        if offset:
            return encode_request(recv.k[0], recv.k[1], recv.rid, offset=offset), []
        acks = take_ids(peer.acks)
        released = take_ids(peer.releases)  # gone for good: never given back
        request = encode_request(recv.k[0], recv.k[1], recv.rid, finished=acks, released=released)
        return request, acks

    def _prepare(self, recv: Recv) -> tuple[Peer, bytes, list[int]] | None:
        """The producer and the request of ``recv``'s next call, counted as made (the
        producer may take a value for it); None when the receive ended or waits."""
        peer = self._peer_of(recv)
        if peer is None:
            return None
        remaining = recv.remaining()
        if remaining is not None and remaining <= 0:
            self._timed_out(recv)
            return None
        try:
            request, acks = self._request(recv, peer)
        except RendezvousError as e:
            self._finish(recv, e, None)
            return None
        with self._lock:
            if recv.state == _ACTIVE:
                recv.calls += 1
                return peer, request, acks
        peer.acks.extendleft(reversed(acks))
        return None

    def _call(self, recv: Recv, timeout: float) -> None:
        """A blocked receiver's call, in its thread: at most ``TURN`` seconds."""
        prepared = self._prepare(recv)
        if prepared is None:
            return
        peer, request, acks = prepared
        remaining = recv.remaining()
        t = min(timeout, TURN) if remaining is None else min(timeout, TURN, remaining)
        try:
            data = peer.recv(request, timeout=max(t, 0.001), metadata=self.metadata)
        except grpc.RpcError as e:
            peer.acks.extendleft(reversed(acks))
            self._failed(recv, peer, e)
            return
        self._answered(recv, peer, data)

    def _issue(self, recv: Recv) -> None:
        """A callback receive's call, as a future."""
        recv.timer = None
        prepared = self._prepare(recv)
        if prepared is None:
            return
        peer, request, acks = prepared
        fut = peer.recv.future(request, timeout=recv.remaining(), metadata=self.metadata)
        recv.future = fut
        fut.add_done_callback(lambda f: self._on_future(recv, peer, f, acks))

    def _on_future(self, recv: Recv, peer: Peer, fut: Any, acks: list[int]) -> None:
        recv.future = None
        if fut.cancelled():
            return
        error = fut.exception()
        if error is not None:
            peer.acks.extendleft(reversed(acks))
            self._failed(recv, peer, error)
        else:
            self._answered(recv, peer, fut.result())

    def _answered(self, recv: Recv, peer: Peer, data: bytes) -> None:
        """An answer: the value, or its first chunk (then fetch the rest)."""
        peer.reached = True
        assembly = recv.assembly = Assembly()
        try:
            got = assembly.feed(data, owned=True)
            if got is None and not assembly.missing:  # an ask, or no tensor at all
                raise InvalidArgumentError("neither a tensor nor the first of its chunks")
        except RendezvousError as e:
            self._finish(
                recv, InternalError(f"bad RecvTensor answer for {recv.where()}: {e}"), None
            )
            return
        if got is not None:
            peer.acks.append(recv.rid)
            if not self._finish(recv, None, got):
                peer.releases.append(recv.rid)  # too late: cancelled meanwhile
            return
        with self._lock:
            if recv.state != _ACTIVE:
                return
            self._fetching.add(recv)
            for offset in assembly.missing[:_CHUNKS_IN_FLIGHT]:
                recv.chunks[offset] = None
        for offset in list(recv.chunks):
            self._fetch(recv, peer, offset)

    def _fetch(self, recv: Recv, peer: Peer, offset: int) -> None:
        request, _ = self._request(recv, peer, offset)
        with self._lock:
            assembly = recv.assembly
            if recv.state != _ACTIVE or assembly is None:
                return
            fut = recv.chunks[offset] = peer.recv.future(
                request, timeout=recv.remaining(), metadata=self.metadata
            )
        fut.add_done_callback(lambda f: self._chunk(recv, peer, offset, f, assembly))

    def _chunk(self, recv: Recv, peer: Peer, offset: int, fut: Any, assembly: Assembly) -> None:
        """A chunk came (gRPC's thread): into place; the next one, or the value."""
        if fut.cancelled() or recv.state != _ACTIVE or recv.assembly is not assembly:
            return
        error = fut.exception()
        if error is not None:
            tries = recv.retries[offset] = recv.retries.get(offset, 0) + 1
            code, details = status(error)
            if code == grpc.StatusCode.UNAVAILABLE and tries <= _CHUNK_RETRIES:
                self._fetch(recv, peer, offset)
                return
            with self._lock:  # the value is asked for again, whole (same request_id)
                calls = [c for c in recv.chunks.values() if c is not None]
                recv.chunks.clear()
                recv.assembly = None
                self._fetching.discard(recv)
                self._cond.notify_all()
            for call in calls:
                call.cancel()
            if recv.blocking and not recv.started and code == grpc.StatusCode.UNAVAILABLE:
                recv.why = details  # its receiver calls again (and pauses) in its own thread
                return
            self._failed(recv, peer, error)
            return
        try:
            with self._lock:
                recv.chunks.pop(offset, None)
                got = assembly.feed(fut.result())
                following = [o for o in assembly.missing if o not in recv.chunks]
                following = following[: _CHUNKS_IN_FLIGHT - len(recv.chunks)]
                for o in following:
                    recv.chunks[o] = None
        except RendezvousError as e:
            self._finish(recv, InternalError(f"bad RecvTensor chunk for {recv.where()}: {e}"), None)
            return
        if got is not None:
            peer.finished(recv.rid)  # its bytes count in the window until acknowledged
            if not self._finish(recv, None, got):
                peer.releases.append(recv.rid)
            return
        for o in following:
            self._fetch(recv, peer, o)

    def _failed(self, recv: Recv, peer: Peer, error: Any) -> None:
        """A call failed: again (same request_id), after a pause, or the receive fails."""
        code, details = status(error)
        if recv.state != _ACTIVE:
            return
        remaining = recv.remaining()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and (remaining is None or remaining > 0):
            if recv.blocking and not recv.started:  # a turn: again, from the receiver
                recv.turns += 1
                if recv.turns < _IDLE_TURNS:
                    return
                recv.started = True  # idle: one long call, which abort and close can stop
            self._issue(recv)  # (a long call's end: the server's max_wait)
            return
        if code == grpc.StatusCode.UNAVAILABLE:
            if "Too many open files" in details:
                self._channels.drop(peer)
                self._finish(recv, ResourceExhaustedError(
                    f"cannot connect for {recv.where()}: too many open files (ulimit -n): {details}"
                ), None)  # fmt: skip
                return
            if _NEVER_CONNECTED in details.lower():
                recv.refused = peer.address
            gone = self._gone(recv, details, code)
            if gone is not None:
                self._finish(recv, gone, None)
            else:
                self._pause(recv, details)
            return
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._timed_out(recv, details)
            return
        if code == grpc.StatusCode.CANCELLED and details.upper() == _SHED:
            self._pause(recv, "the server's gRPC had too many calls waiting to start")
            return
        err = error_for_code(code)(f"RecvTensor of {recv.where()} failed: {details}")
        err.__cause__ = error
        self._finish(recv, err, None)

    def _gone(self, recv: Recv, details: str, code: grpc.StatusCode) -> UnavailableError | None:
        """Whether the producer went away (the receive's error) or may come back (None)."""
        now = time.monotonic()
        if recv.gone_since is None:
            peer = recv.peer
            if _NEVER_CONNECTED in details.lower() and not (peer is not None and peer.reached):
                return None  # not listening yet: waited for until the deadline
            recv.gone_since = now
        if now - recv.gone_since < GONE_GRACE and SERVER_STOPPING not in details:
            return None
        return UnavailableError(
            f"producer {recv.key.src} went away while receiving {recv.where()}: "
            f"gRPC {code.name}: {details}"
        )

    def _pause(self, recv: Recv, why: str) -> None:
        """Call again after a pause (in a blocked receiver's thread, or a timer's)."""
        recv.why = why
        pause, recv.backoff = recv.backoff, min(recv.backoff * 2, _RETRY_MAX)
        if recv.gone_since is not None:
            pause = min(pause, max(0.0, recv.gone_since + GONE_GRACE - time.monotonic()))
        remaining = recv.remaining()
        if remaining is not None:
            if remaining <= 0:
                self._timed_out(recv, why)
                return
            pause = min(pause, remaining)
        if recv.blocking and not recv.started:  # in the receiver's own thread
            time.sleep(min(pause, TURN))
            return
        timer = threading.Timer(pause, self._issue, (recv,))
        timer.daemon = True
        with self._lock:
            if recv.state != _ACTIVE:
                return
            recv.timer = timer
        timer.start()

    def _timed_out(self, recv: Recv, why: str = "") -> None:
        after = "" if recv.timeout is None else f" after {recv.timeout:g}s"
        why = why or recv.why
        because = f"; the peer was unavailable: {why}" if why else ""
        error = DeadlineExceededError(f"Timed out{after} receiving {recv.where()}{because}")
        self._finish(recv, error, None)

    def _finish(self, recv: Recv, error: BaseException | None, got: Received | None) -> bool:
        """End ``recv`` with its value or error, once (False: it had ended already); after
        an error, what the producer took for it goes back."""
        if got is None:
            if not self._stop(recv):
                return False
        else:
            with self._lock:
                if recv.state == _DONE:
                    return False
                self._end(recv)
                self._count(got)
        invoke_done(recv.done, error, got)
        self._drive(recv.k)
        return True

    def _end(self, recv: Recv) -> None:
        """``recv`` leaves the tables (the lock is held)."""
        k = recv.k
        recv.state = _DONE
        self._fetching.discard(recv)
        self._table.cancel(k, recv)
        if recv.blocking and self._blocked.pop(recv.done, None) is recv:
            self._blocking[k] -= 1
            if not self._blocking[k]:
                del self._blocking[k]
        self._cond.notify_all()

    def _count(self, got: Received) -> None:
        self.received += 1
        self.received_bytes += got.value.nbytes

    def _cancel(self, recv: Recv) -> bool:
        """The canceller: True, and ``done`` is never called; False once it was delivered
        or failed. A value taken for its calls goes back to its key's head."""
        if not self._stop(recv):
            return False
        self._drive(recv.k)
        return True

    def _stop(self, recv: Recv) -> bool:
        """End ``recv`` without a value, stopping its calls and releasing its request_id
        (False: it had ended)."""
        with self._lock:
            if recv.state == _DONE:
                return False
            self._end(recv)
            calls = [recv.future, *recv.chunks.values()]
            timer, recv.timer = recv.timer, None
            issued = recv.calls > 0
        for call in calls:
            if call is not None:
                call.cancel()
        if timer is not None:
            timer.cancel()
        if issued and recv.peer is not None:
            recv.peer.releases.append(recv.rid)
        return True

    # -- series -------------------------------------------------------------------------------

    def _wants_series(self, head: Recv) -> bool:
        """A key received again (or that had a series), from a producer that takes them."""
        if self._seen.get(head.k, 0) < 2 and head.k[1] not in self._had_series:
            return False
        peer = head.peer or self._key_peer.get(head.k[1])
        return peer is not None and time.monotonic() >= peer.no_series and not head.calls

    def _open_series(self, head: Recv) -> SeriesCall:
        peer = head.peer or self._key_peer[head.k[1]]
        rid = _ids.getrandbits(63) | 1
        series = self._series[head.k] = SeriesCall(peer, head.k[0], head.k[1], rid)
        if len(self._had_series) >= _SEEN_KEPT:
            self._had_series.clear()
        self._had_series[head.k[1]] = None
        return series

    def _read(self, recv: Recv, series: SeriesCall) -> None:
        """A blocked receiver reads its key's series until its own value comes (the reader
        role is its until it returns: after a value, a tick, or a failure)."""
        k = recv.k
        recv.peer = series.peer  # (for its errors)
        try:
            while recv.state != _DONE:
                values = series.read()
                if not values:
                    return  # a tick: back to the receiver's loop (deadline, abort)
                recv.gone_since = None
                done = []
                with self._lock:
                    for got in values:
                        waiter = self._table.put(k, got)
                        if waiter is not None:
                            self._end(waiter)
                            self._count(got)
                            done.append((waiter, got))
                for waiter, got in done:
                    invoke_done(waiter.done, None, got)
        except grpc.RpcError as e:
            self._series_failed(recv, series, e)
        except RendezvousError as e:
            self._fail_key(
                k, series, InternalError(f"bad RecvTensorSeries for {recv.where()}: {e}")
            )
        finally:
            with self._lock:
                if series.reader is recv:
                    series.reader = None
                self._cond.notify_all()
                flush = None
                if series.held > series.acked and series.flush is None:
                    flush = series.flush = threading.Timer(_ACK_DELAY, self._flush, (series,))
                    flush.daemon = True
            if flush is not None:
                flush.start()
            self._drive(k)

    def _flush(self, series: SeriesCall) -> None:
        """What a series' reader read and left unacknowledged (no reader saw the series
        ask since) is acknowledged: the producer's window counts it no more."""
        with self._lock:
            series.flush = None
            reading = series.reader is not None
        if not reading:
            series.ack()

    def _series_failed(self, recv: Recv, series: SeriesCall, error: grpc.RpcError) -> None:
        code, details = status(error)
        if code == grpc.StatusCode.CANCELLED:
            return  # released, aborted or closed: whoever cancelled it goes on
        fresh = series.held == 0 and series.values == 0
        if fresh and code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED):
            # A producer that takes no series (TensorFlow, an older shmrdv), or no more now.
            forever = code == grpc.StatusCode.UNIMPLEMENTED
            series.peer.no_series = float("inf") if forever else time.monotonic() + _NO_SERIES_PAUSE
            with self._lock:
                if self._series.get(recv.k) is series:
                    del self._series[recv.k]
            return
        if code == grpc.StatusCode.UNAVAILABLE:
            if self._moved(recv, series, details):  # restarted elsewhere: its series is gone
                with self._lock:
                    if self._series.get(recv.k) is series:
                        del self._series[recv.k]
                    if self._key_peer.get(recv.k[1]) is series.peer:
                        del self._key_peer[recv.k[1]]
                recv.peer = recv.gone_since = None  # the receive goes on with RecvTensor
                return
            gone = self._gone(recv, details, code)
            if gone is None:
                self._pause(recv, details)
            else:  # the series stays: a receive that comes later opens it again
                self._fail_key(recv.k, series, gone, keep=True)
            return
        err = error_for_code(code)(f"RecvTensorSeries of {recv.where()} failed: {details}")
        self._fail_key(recv.k, series, err)

    @staticmethod
    def _moved(recv: Recv, series: SeriesCall, details: str) -> bool:
        """Whether the producer of ``series``, not listening where it was, now has
        another address (looked up anew)."""
        if _NEVER_CONNECTED not in details.lower() or isinstance(recv.address, str):
            return False
        try:
            return recv.address(series.peer.address) != series.peer.address
        except RendezvousError:
            return False

    def _fail_key(
        self, k: tuple[int, str], series: SeriesCall, error: BaseException, *, keep: bool = False
    ) -> None:
        """The series of ``k`` failed: every receive waiting on ``k`` fails with ``error``
        (``keep``: the series stays, for receives to come)."""
        with self._lock:
            if not keep and self._series.get(k) is series:
                del self._series[k]
            waiters = self._table.abort(lambda key: key == k)
            for waiter in waiters:
                self._end(waiter)
        if not keep:
            series.release()
        for waiter in waiters:
            invoke_done(waiter.done, error, None)

    def _release_series(self, k: tuple[int, str], series: SeriesCall) -> None:
        """No blocked receiver reads ``k``'s series for its callback receives: the
        producer takes back what was not read, then they go on with ``RecvTensor``."""

        def released(_: Any) -> None:
            with self._lock:
                self._releasing.discard(k)
            self._drive(k)

        fut = series.release() if not self._closed else None
        if fut is None:
            released(None)
        else:
            fut.add_done_callback(released)

    # -- steps and lifetime -----------------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Fail the receives of ``step_id`` with ``error``; later ones raise it at once."""
        with self._lock:
            error = self._aborted.setdefault(step_id, error)
            recvs = self._table.abort(lambda k: k[0] == step_id)
            series = [s for k, s in self._series.items() if k[0] == step_id]
            for k in [k for k in self._series if k[0] == step_id]:
                del self._series[k]
        self._fail(recvs, series, error)

    def _fail(self, recvs: list[Recv], series: list[SeriesCall], error: BaseException) -> None:
        for s in series:
            s.release()
        for recv in recvs:
            if self._stop(recv):
                invoke_done(recv.done, error, None)

    def cleanup_step(self, step_id: int) -> None:
        """Forget ``step_id`` (its abort, its counts)."""
        with self._lock:
            self._aborted.pop(step_id, None)
            for k in [k for k in self._seen if k[0] == step_id]:
                del self._seen[k]

    def close(self, error: BaseException | None = None) -> None:
        """Fail the receives in flight with ``error`` (default ``CancelledError``), send
        the acks still waiting (up to a second) and close the channels. Idempotent."""
        if self._fork != len(_forks):
            self._reset()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            recvs = self._table.abort()
            series = list(self._series.values())
            self._series.clear()
        self._fail(recvs, series, error or CancelledError("RpcClient closed"))
        self._channels.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_status(self, address: str, *, timeout: float = 5.0) -> tuple[DeviceAttributes, ...]:
        """TensorFlow's ``GetStatus`` of the worker at ``address`` (its devices); blocks.
        Raises the mapped error (``UnavailableError`` when it cannot be reached)."""
        if self._fork != len(_forks):
            self._reset()
        return self._channels.get_status(address, check_timeout(timeout))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "channels": len(self._channels),
                "received": self.received,
                "received_bytes": self.received_bytes,
                "receives_pending": self._table.pending_waiters,
                "fetching": len(self._fetching),
                "series": len(self._series),
            }


def _too_late() -> bool:
    return False
