"""Waits: the RecvTensor calls of one server matched with the values of its source.

A call asks for the next value of a key (``take``): from the ``ResponseCache`` (a retry
under its request_id), by joining a waiter of the same request_id, or with a new waiter
that asks the ``TensorSource`` (the producer's outbox) with ``serve_recv``. A value
already there is taken at once, whatever the bounds; otherwise the call parks, if the
bounds on parked calls let it (``ParkedCalls``: in all, per peer host, per connection;
``RESOURCE_EXHAUSTED``), up to its deadline or ``max_wait``. The service (``service``)
sends what it took and says when it is through (``done_serving``, ``call_ended``).

A value taken counts in the producer's ``max_inflight_bytes`` until the call that
carries it has ended (``TensorSource.done_with``), not when it is taken: a client that
asks and never reads holds the window, not the producer's memory. A value is not lost
to calls that go away before it is sent: one that arrives after every call for it left,
or whose every call went away before it was fully sent and that no retry can claim (a
release from a client that gave it up, or cache expiry), goes back to the head of its
key (``TensorSource.requeue``).

Thread model (docs/threads.md): all of it runs on the server's event loop; no lock. A
value already there is settled in the loop without a thread hop (the source calls
``done`` in the loop's own thread). A call waiting for a value awaits an asyncio future
of its own, which the source's ``done`` (called in the producer's thread) settles with
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from .._errors import (
    DeadlineExceededError,
    InternalError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
)
from .._keys import DeviceName, ParsedKey
from .._rendezvous import Received
from .._window import counted_bytes
from . import messages
from .keycheck import check_served_key
from .methods import SERVER_STOPPING
from .parked import ParkedCalls
from .response_cache import ResponseCache, Waiter
from .tensor_source import TensorSource

__all__ = ["WaitLimits", "Waits"]

_log = logging.getLogger("shmrdv.rpc.server")


def _retrieve(fut: asyncio.Future[Received]) -> None:
    # Mark an exception as retrieved so asyncio does not log "never retrieved" when every
    # call that waited for this value has gone.
    if not fut.cancelled():
        fut.exception()


async def _woken(loop: asyncio.AbstractEventLoop, waiter: Waiter, timeout: float) -> bool:
    """Wait until ``waiter`` is settled (True) or ``timeout`` passes (False).

    Each call waiting on a waiter has a future of its own, which ``_settle`` completes
    directly (``_wake``): a call that leaves never cancels the shared one, and the wake-up
    takes one turn of the loop (``wait_for(shield(...))`` took four). ``loop`` is the
    running one (``asyncio.get_running_loop`` costs a ``getpid`` system call).
    """
    call: asyncio.Future[bool] = loop.create_future()
    waiter.calls.add(call)
    timer = loop.call_later(timeout, _resolve, call, False)
    try:
        return await call
    finally:
        timer.cancel()
        waiter.calls.discard(call)


def _resolve(call: asyncio.Future[bool], settled: bool) -> None:
    if not call.done():
        call.set_result(settled)


def _wake(waiter: Waiter) -> None:
    """``waiter`` is settled: wake every call waiting on it."""
    for call in waiter.calls:
        _resolve(call, True)


@dataclasses.dataclass(frozen=True)
class WaitLimits:
    """What a server's calls may wait for and keep (``RpcServer``'s arguments of the same
    names say each one's meaning and default): the response cache's time, entries and
    bytes; calls waiting for a value in all, per peer host and per connection; and how
    long one may wait."""

    cache_ttl: float
    cache_entries: int
    cache_bytes: int
    max_waiting: int
    max_waiting_per_peer: int
    max_waiting_per_connection: int
    max_wait: float


class Waits:
    """The waiters of one server: calls matched with values of one ``TensorSource``.

    ``take`` gives a call its value; ``done_serving``, ``call_ended`` and ``report_done``
    say what became of it. All but the constructor run on the server's event loop.
    """

    def __init__(self, source: TensorSource, task: DeviceName, limits: WaitLimits) -> None:
        self._source = source
        self._task = task
        self._max_wait = float(limits.max_wait)
        self._cache = ResponseCache(
            ttl=limits.cache_ttl,
            entries=limits.cache_entries,
            max_bytes=limits.cache_bytes,
            give_back=self._maybe_give_back,
            where=source.task,
        )
        self._address = "(not started)"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = -1
        self._stopping = False
        self._waiters: set[Waiter] = set()  # not yet settled
        self._parked = ParkedCalls(
            limits.max_waiting, limits.max_waiting_per_peer, limits.max_waiting_per_connection
        )
        self._stats = {"cache_hits": 0, "requeued": 0}

    def started(self, address: str) -> None:
        """The server listens on ``address``; called in the loop."""
        self._address = address
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def stop(self, error: RendezvousError) -> None:
        """Fail every waiting call with ``error`` and forget the cache (the server stops)."""
        self._stopping = True
        for waiter in list(self._waiters):
            if waiter.canceller is not None:
                waiter.canceller()
            self._settle(waiter, error, None)
        self._cache.clear()

    def drop_step(self, step_id: int) -> None:
        """Forget cached responses of ``step_id`` (TensorFlow: on CleanupGraph)."""
        self._cache.drop_step(step_id)

    def caches_any(self) -> bool:
        """Whether any response is cached (any thread: a snapshot)."""
        return len(self._cache) > 0

    def finished(self, request_id: int) -> None:
        """The client has the response of ``request_id`` (an ack): drop it from the cache."""
        self._cache.finished(request_id)

    def release(self, request_id: int) -> None:
        """The client gave ``request_id`` up: a value taken for it and not delivered goes
        back to its key now."""
        self._cache.release(request_id)

    def stats(self) -> dict[str, int]:
        """Counters: cache hits, values requeued, waiting, cached, parked."""
        out = dict(self._stats)
        out["waiting"] = len(self._waiters)
        out["cached"] = len(self._cache)
        out["cached_bytes"] = self._cache.cached_bytes
        out["parked"] = self._parked.total
        return out

    # -- what became of a value taken ------------------------------------------------------

    def done_serving(self, waiter: Waiter) -> None:
        """A call that took ``waiter``'s value is through with sending it (or failed)."""
        waiter.serving -= 1
        self._maybe_give_back(waiter)

    def call_ended(self, waiter: Waiter, cancelled: bool) -> None:
        """The unary call that sent ``waiter``'s value has ended: written to the client
        (delivered: the window counts it no more), or cancelled before (the value stays
        cached for a retry, or leaves: ``_maybe_give_back``).

        A call can end well here and still have been cancelled by its client: the answer
        was written before the client's cancel arrived. A client that then released the
        request_id (it cancelled before any data reached its caller) did not take the
        value, so it goes back to its key (bug 3c of issue 19: it was dropped, and the
        next receive waited for nothing)."""
        waiter.writing -= 1
        if cancelled or waiter.released:
            self._maybe_give_back(waiter)
        else:
            self.report_done(waiter)

    def report_done(self, waiter: Waiter) -> None:
        """Tell the source, once per value, that the service is done with it."""
        fut = waiter.future
        if waiter.reported or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return
        waiter.reported = True
        self._source.done_with(waiter.step_id, waiter.key, counted_bytes(fut.result().value.nbytes))

    # -- waiting for a value --------------------------------------------------------

    def _validate(self, req: messages.RecvRequest) -> ParsedKey:
        """Parse and check the key as TensorFlow's GrpcWorker does; raise the TF error."""
        return check_served_key(
            req.rendezvous_key, self._task, self._source.task, self._source.incarnation
        )

    async def take(
        self,
        req: messages.RecvRequest,
        timeout: float | None,
        peer_of: Callable[[], str],
    ) -> tuple[Waiter, Received]:
        """The value for ``req``: from the cache, by joining a waiter, or a new waiter.
        ``peer_of`` names the calling connection (grpc's ``context.peer``).

        A value already there is taken at once, whatever the bounds. Otherwise the call
        waits, if the bounds on waiting calls let it, up to its deadline
        (``DeadlineExceededError``); a call cancelled by its client
        (``asyncio.CancelledError``) leaves, and the last call to leave an unsettled
        waiter removes it from the source.
        """
        if self._stopping:
            raise UnavailableError(f"shmrdv RPC server {self._address} {SERVER_STOPPING}")
        pk = self._validate(req)
        waiter = self._find_or_start(req, pk)  # joined: waiter.joiners counts this call
        taken = False
        peer = ""
        try:
            if not waiter.future.done():
                peer = peer_of()
                why = self._parked.refusal(peer)
                if why is not None:
                    peer = ""
                    raise ResourceExhaustedError(
                        f"RecvTensor on {self._source.task}: {why}; key {pk.full_key!r} refused"
                    )
                self._parked.add(peer, 1)
                # A client that never sets a deadline (or a far one) must not park forever.
                timeout = self._max_wait if timeout is None else min(timeout, self._max_wait)
                assert self._loop is not None
                if not await _woken(self._loop, waiter, timeout):
                    raise DeadlineExceededError(
                        f"RecvTensor on {self._source.task}: no value for key {pk.full_key!r} "
                        f"(step {req.step_id}) before the call's deadline; the waiter was removed"
                    ) from None
            received = waiter.future.result()
            # The caller sends the value now and calls _done_serving when it is through.
            waiter.serving += 1
            taken = True
        finally:
            if peer:
                self._parked.add(peer, -1)
            waiter.joiners -= 1
            if waiter.joiners == 0 and not waiter.future.done():
                self._abandon(waiter)
            elif not taken:
                # Cancelled just as the value came: it stays cached for a retry under its
                # request_id, or (released, uncached) goes back to its key now.
                self._maybe_give_back(waiter)
        return waiter, received

    def _find_or_start(self, req: messages.RecvRequest, pk: ParsedKey) -> Waiter:
        """The waiter this call joins (counted in its ``joiners``): a cached one, or a new
        one whose value, if already there, it holds at once."""
        found = self._cache.find(req.request_id, req.step_id, pk)
        if isinstance(found, Waiter):
            if found.future.done():
                self._stats["cache_hits"] += 1
            found.joiners += 1
            return found
        cache_key = found
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[Received] = loop.create_future()
        fut.add_done_callback(_retrieve)
        waiter = Waiter(cache_key, fut, req.step_id, pk)
        # A request_id its client already gave up (the release overtook the call): the
        # client will not take this value, so one sent to it goes back (bug 3c of i19).
        waiter.released = cache_key is None and req.request_id != 0
        at_once: list[tuple[BaseException | None, Received | None]] = []
        starting = True

        def done(error: BaseException | None, received: Received | None) -> None:
            # Any thread (the producer's send, an abort); in this one, while serve_recv
            # runs, when the value is already there: settled below, with no hop.
            if starting and threading.get_ident() == self._loop_thread:
                at_once.append((error, received))
                return
            # The loop may be gone if the server stopped meanwhile; the value then has no
            # one left to go to.
            try:
                loop.call_soon_threadsafe(self._settle, waiter, error, received)
            except RuntimeError:
                _log.warning(
                    "value for key %r (step %d) arrived after the RPC server stopped; dropped",
                    pk.full_key,
                    req.step_id,
                )

        # serve_recv raises AbortedError for a cleaned-up step: the call fails at once.
        try:
            waiter.canceller = self._source.serve_recv(req.step_id, pk, done)
        except RendezvousError:
            raise
        except Exception as e:  # a bug in the source must still answer the call
            _log.exception("TensorSource.serve_recv failed for key %r", pk.full_key)
            raise InternalError(
                f"TensorSource of {self._source.task} failed on key {pk.full_key!r}: {e!r}"
            ) from e
        finally:
            starting = False
        self._waiters.add(waiter)
        if cache_key is not None:
            self._cache.add(waiter)
        waiter.joiners = 1  # before settling: a joined value is neither evicted nor given back
        if at_once:
            self._settle(waiter, *at_once[0])
        return waiter

    def _settle(
        self, waiter: Waiter, error: BaseException | None, received: Received | None
    ) -> None:
        """The source's answer, now in the loop: wake the calls, keep a value for retries."""
        self._waiters.discard(waiter)
        if waiter.future.done():
            return  # failed by stop(); a value arriving now has no one to go to
        if error is not None:
            if not isinstance(error, RendezvousError):
                error = InternalError(f"TensorSource.serve_recv failed: {error!r}")
            waiter.future.set_exception(error)
            _wake(waiter)
            if waiter.cache_key is not None:
                self._cache.uncache(waiter.cache_key)
            return
        if received is None:
            waiter.future.set_exception(InternalError("TensorSource called done(None, None)"))
            _wake(waiter)
            return
        waiter.send_start_micros = time.time_ns() // 1000
        waiter.future.set_result(received)
        _wake(waiter)
        if waiter.joiners == 0:
            # Every call left while the value was on its way (cancelled, or the connection
            # broke). Give it back to the head of its key rather than park it in the
            # cache: a retry with the same request_id starts a new waiter and gets it
            # first, and a client that cancelled never comes back for it.
            if waiter.cache_key is not None:
                self._cache.pop(waiter.cache_key)
            self._maybe_give_back(waiter)
            return
        if self._cache.delivered(waiter, received.value.nbytes, time.monotonic()):
            # Expiry also runs on every lookup; this timer covers a server that gets none.
            assert self._loop is not None
            self._loop.call_later(self._cache.ttl + 0.01, self._cache.expire)

    def _abandon(self, waiter: Waiter) -> None:
        """The last call waiting on ``waiter`` left before the value came: remove the waiter."""
        canceller = waiter.canceller
        if canceller is not None and canceller():
            self._waiters.discard(waiter)
            waiter.future.cancel()
            if waiter.cache_key is not None:
                self._cache.uncache(waiter.cache_key)
        # Otherwise the value is already on its way (a race with the cancel): _settle
        # keeps it for a retry (request_id) or gives it back to the source.

    def _maybe_give_back(self, waiter: Waiter) -> None:
        """A value no call uses and no retry can claim leaves the service: given back if
        no call delivered it, else (delivered, or sent to a call that went away) dropped."""
        if (
            waiter.given_back
            or waiter.joiners
            or waiter.serving
            or waiter.writing
            or not waiter.future.done()
            or (waiter.cache_key is not None and waiter.cache_key in self._cache)
        ):
            return
        if waiter.sent and not waiter.released:
            self.report_done(waiter)
            return
        self._give_back(waiter)

    def _give_back(self, waiter: Waiter) -> None:
        """A value taken from the source that no call delivered goes back to its key's head."""
        fut = waiter.future
        if fut.cancelled() or fut.exception() is not None:
            return
        waiter.given_back = True
        self.report_done(waiter)
        try:
            self._source.requeue(waiter.step_id, waiter.key, fut.result())
        except Exception:
            _log.exception("TensorSource.requeue failed for key %r", waiter.key.full_key)
        else:
            self._stats["requeued"] += 1
