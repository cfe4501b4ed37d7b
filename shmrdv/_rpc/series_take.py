"""Taking a key's values from the ``TensorSource`` for a RecvTensorSeries.

``series_service`` writes a series; what it writes comes from here, one value at a time
(``SeriesTakes.take``: at once when the value is there, else when it is sent, else
nothing after the series' idle time, ``IdleClock``), or as many as are there now
(``take_now``, ``more``). A value taken that nobody will write any more goes back to
the head of its key (``requeue``), and so does one that was on its way from the
producer's thread when its take gave up: for a resumable series, before what the
series kept (``end``: the series' ``Retained`` entry ends only once such values are
back, as they came after every value it kept).

Thread model (docs/threads.md): the server's event loop, no lock. A value already there
is taken in the loop with no hop; one sent later comes in the producer's ``send`` thread
(the source's ``done``), which hands it to the loop with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from .._errors import InternalError, RendezvousError, UnavailableError
from .._keys import ParsedKey
from .._rendezvous import Received
from .._window import counted_bytes
from .methods import SERVER_STOPPING
from .series_retained import Retained, RetainedTable
from .tensor_source import TensorSource

__all__ = ["IdleClock", "SeriesTakes", "requeue"]

_log = logging.getLogger("shmrdv.rpc.server")

# What a take settles with: (error, value).
_Outcome = tuple[BaseException | None, Received | None]
# How long a take that may ask for an ack waits for a value before it gives up and the
# series asks (a producer held by its window waits for the ack).
_ASK_DELAY = 0.005


def requeue(source: TensorSource, step_id: int, pk: ParsedKey, received: Received) -> None:
    """``received`` back to the head of its key in ``source`` (a failure is logged)."""
    try:
        source.requeue(step_id, pk, received)
    except Exception:
        _log.exception("TensorSource.requeue failed for key %r", pk.full_key)


class SeriesTakes:
    """The takes of one server's series: values of ``source``, whose resumable series
    keep their entries in ``retained``.

    ``started`` is called in the loop before the first take; ``stop`` ends every take
    (loop thread); ``check_serving`` raises once the server stops.
    """

    def __init__(self, source: TensorSource, retained: RetainedTable) -> None:
        self._source = source
        self._retained = retained
        self._address = "(not started)"
        self._loop_thread = -1
        self._stopping = False
        # Takes waiting for a value, with their cancellers (stop fails them).
        self._waiting: dict[asyncio.Future[_Outcome], Callable[[], bool]] = {}

    def started(self, address: str) -> None:
        """The server listens on ``address`` (called in the loop)."""
        self._address = address
        self._loop_thread = threading.get_ident()

    def stop(self, error: RendezvousError) -> None:
        """The server stops: a take waiting for a value fails with ``error``, and the
        takes that come later with ``UnavailableError``."""
        self._stopping = True
        for fut, cancel in list(self._waiting.items()):
            if cancel() and not fut.done():
                fut.set_result((error, None))

    def check_serving(self) -> None:
        """``UnavailableError`` once the server stops."""
        if self._stopping:
            raise UnavailableError(f"shmrdv RPC server {self._address} {SERVER_STOPPING}")

    def end(self, kept: Retained) -> None:
        """The call of ``kept``'s series ended: what it kept goes back to its key, now,
        or once the values taken for it that were on their way went back first
        (``_settle``)."""
        if kept.late:
            kept.ending = True
        else:
            self._retained.end(kept)

    def more(self, step_id: int, pk: ParsedKey, first: Received, room: int) -> list[Received]:
        """``first`` and the values of ``pk`` already there, up to about ``room`` bytes."""
        batch = [first]
        size = counted_bytes(first.value.nbytes)
        while size < room:
            received = self.take_now(step_id, pk)
            if received is None:
                break
            batch.append(received)
            size += counted_bytes(received.value.nbytes)
        return batch

    def take_now(self, step_id: int, pk: ParsedKey) -> Received | None:
        """The next value of ``pk`` if it is there now; else (or on an error, which the
        next ``take`` raises) None, and nothing waits for one."""
        got: list[_Outcome] = []
        taking = [True]
        loop = asyncio.get_running_loop()

        def done(error: BaseException | None, received: Received | None) -> None:
            if taking[0]:
                got.append((error, received))
                return
            # Sent just as the take gave up (another thread): back to the key's head.
            try:
                loop.call_soon_threadsafe(self._late, step_id, pk, received)
            except RuntimeError:
                pass

        try:
            cancel = self._source.serve_recv(step_id, pk, done)
        except RendezvousError:
            return None
        finally:
            taking[0] = False
        if not got:
            cancel()
            return None
        error, received = got[0]
        return None if error is not None else received

    def _late(self, step_id: int, pk: ParsedKey, received: Received | None) -> None:
        if received is not None:
            self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))
            requeue(self._source, step_id, pk, received)

    async def take(
        self,
        step_id: int,
        pk: ParsedKey,
        clock: IdleClock,
        ask: bool = False,
        kept: Retained | None = None,
    ) -> tuple[Received | None, bool]:
        """The next value of ``pk``: at once when it is there, else when it is sent;
        None after ``idle`` seconds without one (``clock``, the series'). Also whether
        it was waited for. With ``ask``: (None, False) after ``_ASK_DELAY`` without one.
        Raises the source's error."""
        self.check_serving()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_Outcome] = loop.create_future()
        loop_thread = self._loop_thread
        landed = [False]  # _settle ran for the value (or error) this take got

        def done(error: BaseException | None, received: Received | None) -> None:
            # In the loop when the value is already there; else the producer's thread.
            if threading.get_ident() == loop_thread:
                self._settle(fut, step_id, pk, error, received, kept, landed)
                return
            try:
                loop.call_soon_threadsafe(
                    self._settle, fut, step_id, pk, error, received, kept, landed
                )
            except RuntimeError:  # the loop is gone: the server stopped
                if received is not None:
                    self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))

        try:
            cancel = self._source.serve_recv(step_id, pk, done)
        except RendezvousError:
            raise
        except Exception as e:  # a bug in the source must still end the call
            _log.exception("TensorSource.serve_recv failed for key %r", pk.full_key)
            raise InternalError(f"TensorSource of {self._source.task} failed: {e!r}") from e
        waited = not fut.done()
        if waited:
            self._waiting[fut] = cancel
            idle = [False]
            asked = [False]

            def expire() -> None:
                # cancel() False: the value is on its way, and settles ``fut``.
                if not fut.done() and cancel():
                    idle[0] = True
                    fut.set_result((None, None))

            def ask_now() -> None:
                if not fut.done() and cancel():
                    asked[0] = True
                    fut.set_result((None, None))

            # The future itself and the series' one timer: no timer made and cancelled
            # per value (nor ``asyncio.wait``'s waiter future, set and callbacks); one
            # more only to ask for an ack.
            clock.start(expire)
            asking = loop.call_later(_ASK_DELAY, ask_now) if ask else None
            try:
                await fut
                if idle[0]:
                    return None, True
                if asked[0]:
                    return None, False
            except asyncio.CancelledError:
                # The consumer went away: a value taken for it goes back to its key.
                removed = cancel()
                if not removed and not landed[0] and kept is not None:
                    # On its way from the sender's thread: it goes back to the key in
                    # _settle, before what the series kept (taken earlier) goes.
                    kept.late += 1
                if not fut.done():
                    fut.cancel()  # one still on its way goes back in _settle
                elif not fut.cancelled():  # (the task's cancel cancels what it awaits)
                    self._settle(fut, step_id, pk, *fut.result())
                raise
            finally:
                clock.stop()
                if asking is not None:
                    asking.cancel()
                self._waiting.pop(fut, None)
        error, received = fut.result()
        if error is not None:
            if isinstance(error, RendezvousError):
                raise error
            raise InternalError(f"TensorSource.serve_recv failed: {error!r}")
        if received is None:
            raise InternalError("TensorSource called done(None, None)")
        return received, waited

    def _settle(
        self,
        fut: asyncio.Future[_Outcome],
        step_id: int,
        pk: ParsedKey,
        error: BaseException | None,
        received: Received | None,
        kept: Retained | None = None,
        landed: list[bool] | None = None,
    ) -> None:
        if landed is not None:
            landed[0] = True
        if not fut.done():
            fut.set_result((error, received))
            return
        if received is not None:
            # Nobody takes it any more (the consumer went away, the server stopped).
            self._source.done_with(step_id, pk, counted_bytes(received.value.nbytes))
            requeue(self._source, step_id, pk, received)
        if kept is not None and fut.cancelled() and kept.late:
            # Back at the key's head: now what the series kept goes before it.
            kept.late -= 1
            if not kept.late and kept.ending:
                kept.ending = False
                self._retained.end(kept)


class IdleClock:
    """The idle end of one series: one timer for all its takes, not one per take.

    A take that waits calls ``start`` with its ``expire``, and ``stop`` when it has
    its value (or ends); ``expire`` runs once the take has waited ``idle`` seconds. The
    timer set for an earlier wait, when it fires, sets itself again for the wait then in
    progress, if any; with none, the next ``start`` sets one. Loop thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float) -> None:
        self._loop = loop
        self._idle = idle
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0
        self._expire: Callable[[], None] | None = None

    def start(self, expire: Callable[[], None]) -> None:
        self._since = self._loop.time()
        self._expire = expire
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._idle, self._fire)

    def stop(self) -> None:
        self._expire = None

    def close(self) -> None:
        """The series ended: no timer left behind (it would hold the series for
        ``idle`` seconds)."""
        self._expire = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        expire = self._expire
        if expire is None:
            return
        due = self._since + self._idle
        if self._loop.time() >= due:
            self._expire = None
            expire()
        else:
            self._timer = self._loop.call_at(due, self._fire)
