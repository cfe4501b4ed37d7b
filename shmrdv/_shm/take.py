"""Taking a channel's next message (``Consumer.lock`` held), wherever it waits.

From the stash when a ring brought it (``book.py``); by its name (``named.py``) when its
producer has no ring, when its ring lost records (then first a listing, ``recovery.py``),
or when the stash holds later messages but not this one: the ring is drained first (its
record may be there still), then a sequence number the producer skipped is skipped.

Thread model (docs/threads.md): every method runs under ``Consumer.lock``.
"""

from __future__ import annotations

import logging

from numpy import ndarray

from .._errors import InternalError
from .._rendezvous import Received
from .book import Book, Channel, Notice, Stashed
from .inbox import Inbox
from .named import NamedMessages
from .recovery import Recovery

__all__ = ["Taker"]

_log = logging.getLogger("shmrdv.shm")


class Taker:
    """Takes the next message of one consumer's channels (see the module docstring)."""

    def __init__(self, book: Book, inbox: Inbox, recovery: Recovery, named: NamedMessages) -> None:
        self._book = book
        self._inbox = inbox
        self._recovery = recovery
        self._named = named

    def take(
        self, ch: Channel, probe: bool, drained: bool = False
    ) -> Received | BaseException | None:
        """The channel's next message, if it is there (under the lock).

        From the stash when a ring brought it; by its name when ``probe`` (a producer
        without a ring), when its ring lost records, or when the stash holds later
        messages but not this one (a sequence number the producer skipped). None: not
        there yet.
        """
        book = self._book
        if ch.nready and ch.inc:
            # The common case written out (a ring brought it; ``taken`` of a live value):
            # the poll of every waiting receive takes its value here.
            stash = book.stash.get(ch.step)
            if stash is not None:
                got = stash.pop((ch.key, ch.inc, ch.seq), None)
                if got is not None:
                    ch.nready -= 1
                    if not stash:
                        del book.stash[ch.step]
                    book.done(ch, ch.seq)
                    if type(got) is not ndarray:
                        return self.taken(ch, got)
                    ch.seq += 1
                    return book.taken(got)
        if not ch.nready:
            lost = self._inbox.lost_records(ch.src)
            if not (probe or lost):
                return None
            if lost:
                self._recovery.recover(ch.src)
            if not ch.nready and not ch.inc:
                self._recovery.resolve_incarnation(ch)  # may attach a gone producer's ring
            if not ch.nready:
                return self._named.take(ch) if ch.inc else None
        stash = book.stash.get(ch.step)
        got = None
        if stash is not None:
            if not ch.inc:
                book.adopt_incarnation(ch)
            got = stash.pop((ch.key, ch.inc, ch.seq), None)
        if got is not None:
            ch.nready -= 1
            if not stash:
                del book.stash[ch.step]
            book.done(ch, ch.seq)
            return self.taken(ch, got)
        # Later messages are here but not this one. Its record may still be in the ring: a
        # listing (recovery) stashed the notice of a later message published by name while
        # this one went inline. Records are appended in sequence, so draining now brings it
        # (checked first: SIGBUS); skipping before that lost messages.
        if not drained:
            self._inbox.drain_all()
            return self.take(ch, probe, drained=True)
        # Was it published without a record?
        found = self._named.take(ch)
        if found is not None:
            return found
        if self._recovery.recover(ch.src):
            return self.take(ch, probe)
        nxt = book.next_stashed(ch)
        if nxt is None:
            ch.nready = 0  # what was counted is gone (another incarnation's, or stale)
            return None
        _log.debug("message %d of %r never came; skipping to %d", ch.seq, ch.key, nxt)
        ch.seq = nxt
        return self.take(ch, probe)

    def taken(self, ch: Channel, got: Stashed) -> Received | BaseException:
        if type(got) is Notice:
            named = self._named.take(ch, got)
            if named is not None:
                return named
            ch.seq += 1
            return InternalError(
                f"message {ch.seq - 1} of key {ch.key!r} from {ch.src.task} was announced but "
                "its segment is gone"
            )
        ch.seq += 1
        return self._book.taken(got)
