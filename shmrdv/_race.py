"""One receive listening on several transports at once: the first value wins.

A key goes by its *producer's* first choice of transport (``_router.py``), which a consumer
learns from the producer's presence record. Before the producer has started, its record is
provisional and its order unknown, so a receive started then listens on every transport
both may use (each a non-blocking ``start_recv``, a *leg*). A producer sends each value
on one transport only, so at most one leg gets a value:

* the first value ends the race: the other legs are cancelled and ``done`` gets it;
* an error ends it only when every leg has failed (a leg whose peer is not up yet may
  fail while the other still waits); ``done`` then gets the first error;
* ``cancel`` withdraws every leg still open and returns ``True``, or returns ``False``
  when a leg's value is already on its way (that leg then ends the race, as for
  ``Canceller``).

Thread model (docs/threads.md): legs complete in their transports' threads; one lock
guards the race's state; no leg is started, cancelled or ``done`` called under it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

from ._callbacks import DoneCallback
from ._received import Received
from ._rendezvous import Canceller

__all__ = ["RaceRecv"]

_log = logging.getLogger("shmrdv")

LegStarter = Callable[[DoneCallback], Canceller]


class RaceRecv:
    """The race of ``len(starters)`` legs for one receive; call it to cancel."""

    def __init__(self, done: DoneCallback, starters: Sequence[LegStarter], what: str) -> None:
        self._done = done
        self._what = what
        self._lock = threading.Lock()
        self._open = set(range(len(starters)))
        self._cancels: list[Canceller | None] = [None] * len(starters)
        self._ended = False
        self._cancelling = False
        self._error: BaseException | None = None
        try:
            self._start(starters)
        except BaseException:
            self()
            raise

    def _start(self, starters: Sequence[LegStarter]) -> None:
        for i, start in enumerate(starters):
            if self._no_more_legs(i, len(starters)):
                return
            cancel = start(functools.partial(self._leg_done, i))
            if self._ended_meanwhile(i, cancel):
                cancel()

    def _no_more_legs(self, i: int, n: int) -> bool:
        """Whether a leg delivered at once: legs ``i`` to ``n - 1`` then never start."""
        with self._lock:
            if self._ended:
                self._open.difference_update(range(i, n))
            return self._ended

    def _ended_meanwhile(self, i: int, cancel: Canceller) -> bool:
        """Keep leg ``i``'s canceller; whether the race ended while it started (it is
        then to be withdrawn)."""
        with self._lock:
            self._cancels[i] = cancel
            return self._ended and i in self._open

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
        for cancel in others:
            cancel()
        self._done(error, received)

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
            return True
