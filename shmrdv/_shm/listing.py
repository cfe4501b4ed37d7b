"""One namespace's names in /dev/shm, listed again only when the directory changed.

A consumer looks for messages by listing /dev/shm when it cannot compute their names (a
producer that is gone, records its full ring lost). Other local users can plant any
number of names under the job's public prefix (issue 13 §2), so a listing must cost
little per name and must not be repeated for nothing:

* the directory's mtime is checked first (one ``stat``): unchanged since a listing whose
  mtime was old enough to trust (the kernel stamps changes with a coarse clock), the
  names are still those of that listing and nothing is listed;
* a real listing happens at most once per ``min_interval`` seconds, however often the
  directory changes, and less often (down to a quarter of that rate) while the listings
  find nothing new;
* names found unusable (another user's, a ring for another consumer, no valid header) are
  remembered (``refuse``, bounded) and skipped by every later listing without a system call.

Pure bookkeeping over ``os.stat`` and ``os.listdir``; not thread-safe (its owner's lock).
"""

from __future__ import annotations

import os
import time

from .naming import Names

__all__ = ["Listing"]

# A listing is trusted to be complete only if the directory's mtime was at least this
# old when it was taken: a change in the same coarse clock tick could keep the mtime.
_TRUST_NS = 20_000_000


class Listing:
    """The names under ``prefix`` in /dev/shm (or ``directory``; see the module docstring)."""

    def __init__(
        self,
        prefix: str,
        min_interval: float,
        refused_max: int = 1 << 17,
        directory: str | None = None,
    ) -> None:
        self._prefix = prefix
        self._dir = Names.path("") if directory is None else directory
        self._interval = min_interval
        self._refused_max = refused_max
        self._gap = min_interval  # the current least time between two listdirs
        self._at = -4 * min_interval  # monotonic time of the last listdir
        self._mtime = -1  # the directory's mtime at that listing, if trusted, else -1
        #: The names of the last listing (prefix matched, refused ones left out).
        self.names: list[str] = []
        #: Bumped by every listing: a user compares it to skip names it has seen.
        self.generation = 0
        self.listings = 0
        self._refused: set[str] = set()

    def refresh(self) -> bool:
        """Make ``names`` current if allowed; True if they are (listed now, or the directory
        has not changed since), False if a listing is due but rate-limited or failed."""
        path = self._dir
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return False
        if mtime == self._mtime:
            return True
        now = time.monotonic()
        if now - self._at < self._gap:
            return False
        self._at = now
        try:
            entries = os.listdir(path)
        except OSError:
            return False
        self.listings += 1
        self._mtime = mtime if time.time_ns() - mtime >= _TRUST_NS else -1
        refused = self._refused
        if len(refused) > self._refused_max // 2:
            refused.intersection_update(entries)  # forget the names that are gone
        fresh = set(entries)
        fresh -= refused  # in C: a flood of refused names costs no Python per name
        prefix = self._prefix
        names = [e for e in fresh if e.startswith(prefix)]
        # Nothing new of ours since the last listing: list less often (up to
        # ``4 * min_interval``) while the directory churns for nothing.
        if set(names) <= set(self.names):
            self._gap = min(2 * self._gap, 4 * self._interval)
        else:
            self._gap = self._interval
        self.names = names
        self.generation += 1
        return True

    def refuse(self, name: str) -> None:
        """``name`` is unusable: leave it out of every later listing (up to a bound)."""
        if len(self._refused) < self._refused_max:
            self._refused.add(name)

    def refused(self, name: str) -> bool:
        return name in self._refused

    def incomplete(self) -> None:
        """A user left names of this listing unexamined: list again when next allowed."""
        self._mtime = -1
