"""A receive started before its producer's pick of transport is known.

A key goes by its *producer's* first choice of transport (``_router.py``), which a consumer
learns from the producer's presence record. Before the producer has started, its record is
provisional and its order unknown. A receive started then listens on this worker's own
first choice at once, and, once the producer's record is final and picks another
transport, on that one too (each a non-blocking ``start_recv``, a *leg*): ``PickWatch``
looks for the final record, in one thread per router that runs only while such receives
wait. No leg starts on a transport the producer has not picked (a gRPC call to a producer
not yet listening would sit in gRPC's connect back-off; and a process with calls in gRPC
cannot fork cleanly). A producer sends each value on one transport only, so at most one
leg gets a value (``RaceRecv``):

* the first value ends the race: the other legs are cancelled and ``done`` gets it;
* an error ends it only when every leg started has failed and no other is to come
  (``add`` refused); ``done`` then gets the first error;
* ``cancel`` withdraws every leg still open and returns ``True``, or returns ``False``
  when a leg's value is already on its way (that leg then ends the race, as for
  ``Canceller``).

Thread model (docs/threads.md): legs complete in their transports' threads; one lock
guards a race's state; no leg is started, cancelled or ``done`` called under it.
``PickWatch``'s thread (``shmrdv-pick``) starts a receive's second leg; its lock guards
the list of receives it watches.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

from ._rendezvous import Canceller, DoneCallback, Received

__all__ = ["LegStarter", "PickWatch", "RaceRecv"]

_log = logging.getLogger("shmrdv")

LegStarter = Callable[[DoneCallback], Canceller]

#: How often ``PickWatch`` looks for final records: first after ``_FIRST_LOOK`` s, then
#: twice as long each time up to ``_LAST_LOOK`` s (a producer usually starts soon).
_FIRST_LOOK = 0.005
_LAST_LOOK = 0.1


class RaceRecv:
    """One receive over the legs ``starters`` and those ``add``ed later; call it to cancel."""

    def __init__(self, done: DoneCallback, starters: Sequence[LegStarter], what: str) -> None:
        self._done = done
        self._what = what
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._cancels: list[Canceller | None] = []
        self._ended = False
        self._cancelling = False
        self._error: BaseException | None = None
        try:
            for start in starters:
                if not self.add(start):
                    break
        except BaseException:
            self()
            raise

    @property
    def ended(self) -> bool:
        """Whether a value, an error or a cancel has ended the receive."""
        return self._ended

    def add(self, start: LegStarter) -> bool:
        """Start one more leg; ``False`` (nothing started) if the receive has ended."""
        with self._lock:
            if self._ended or self._cancelling:
                return False
            i = len(self._cancels)
            self._cancels.append(None)
            self._open.add(i)
        cancel = start(functools.partial(self._leg_done, i))
        with self._lock:
            ended = self._over()
            if not ended:  # (an ended race has let go of its legs: ``_let_go``)
                self._cancels[i] = cancel
            withdraw = ended and i in self._open
        if withdraw:  # the receive ended while the leg started
            cancel()
        return True

    def fail(self, error: BaseException) -> None:
        """End the receive with ``error`` (its producer's pick could not be made), unless
        a leg has ended it."""
        with self._lock:
            if self._ended or self._cancelling:
                return
            self._cancelling = True
            open_legs = [c for j, c in enumerate(self._cancels) if j in self._open]
        if not all(c is not None and c() for c in open_legs):
            return  # a leg's outcome is on its way: it ends the receive
        with self._lock:
            if self._over():
                return
            self._ended = True
            done = self._let_go()
        done(error, None)

    def _over(self) -> bool:
        """``_ended``, read again (a leg may have ended the receive meanwhile)."""
        return self._ended

    def _leg_done(self, i: int, error: BaseException | None, received: Received | None) -> None:
        with self._lock:
            self._open.discard(i)
            if self._ended:
                if received is not None:
                    _log.error(
                        "%s: a second value arrived on another transport; dropped", self._what
                    )
                return
            if error is not None and self._open and not self._cancelling:
                if self._error is None:
                    self._error = error
                return  # another leg may still deliver
            self._ended = True
            if error is not None and self._error is not None and not self._cancelling:
                error = self._error
            others = [c for j, c in enumerate(self._cancels) if j in self._open and c is not None]
            done = self._let_go()
        for cancel in others:
            cancel()
        done(error, received)

    def __call__(self) -> bool:
        """Cancel: withdraw every open leg (``True``), or ``False`` if a value won."""
        with self._lock:
            if self._ended:
                return False
            self._cancelling = True
            open_legs = [c for j, c in enumerate(self._cancels) if j in self._open]
        return self._cancelled([c is not None and c() for c in open_legs])

    def _cancelled(self, removed: list[bool]) -> bool:
        with self._lock:
            if self._ended or not all(removed):
                return False  # a leg's outcome is on its way (or came): it ends the race
            self._ended = True
            self._let_go()
            return True

    def _let_go(self) -> DoneCallback:
        """The race has ended (under the lock): drop the legs' cancellers and ``done``, and
        return ``done`` to call. The legs' callbacks point back here, and ``done`` is
        usually a slot that keeps this race to cancel it: kept, these cycles would hold the
        value, and with it a pool slot of its producer, until a full collection."""
        done, self._done = self._done, _ignore
        self._cancels = []
        return done


def _ignore(error: BaseException | None, received: Received | None) -> None:
    """An ended race's ``done``: nothing more is delivered."""


#: What ``PickWatch`` asks of a watched receive: ``None`` while the producer's record is
#: provisional; once final, the leg to add (``None`` too if it is the first leg's).
Pick = Callable[[], "tuple[LegStarter | None] | None"]


class PickWatch:
    """Starts a receive's leg on its producer's pick once the producer's record is final.

    One daemon thread, started with the first receive watched and ending when none is
    left; it calls each receive's ``pick`` outside its lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[tuple[RaceRecv, Pick]] = []
        self._running = False
        self._wake = threading.Event()

    def watch(self, race: RaceRecv, pick: Pick) -> None:
        with self._lock:
            self._watched.append((race, pick))
            start = not self._running
            self._running = True
        self._wake.set()  # a new receive: look soon again
        if start:
            threading.Thread(target=self._run, name="shmrdv-pick", daemon=True).start()

    def watching(self) -> int:
        """How many receives wait for their producer's pick."""
        with self._lock:
            return len(self._watched)

    def _run(self) -> None:
        pause = _FIRST_LOOK
        while True:
            if self._wake.wait(pause):
                self._wake.clear()
                pause = _FIRST_LOOK
            else:
                pause = min(pause * 2, _LAST_LOOK)
            with self._lock:
                watched = list(self._watched)
            done = [w for w in watched if self._look(*w)]
            with self._lock:
                for w in done:
                    self._watched.remove(w)
                if not self._watched:
                    self._running = False
                    return

    @staticmethod
    def _look(race: RaceRecv, pick: Pick) -> bool:
        """Whether ``race`` needs no more looking (ended, or its pick's leg added). An
        error of the pick or of the leg's start is the receive's: it ends with it."""
        if race.ended:
            return True
        try:
            found = pick()
            if found is None:
                return False
            (leg,) = found
            if leg is not None:
                race.add(leg)
        except Exception as e:
            race.fail(e)
        return True
