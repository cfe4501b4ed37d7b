"""Finding a consumer's messages by listing /dev/shm, where no ring record leads to them.

Names are the truth, rings are the fast path. A listing (``Listing``: rate-limited, none
while the directory is unchanged) finds what a ring cannot show: the messages whose
records a full ring lost (``recover``), the messages and rings of a producer that is gone
or whose incarnation is unknown (``resolve_incarnation``, ``find_gone``, ``find_rings``),
and which of many waiting channels of a ringless producer have a message at all
(``published``). A name new to the consumer costs one ``lstat`` if it is another user's,
at most ``_NEW_PER_LISTING`` of them per listing, and is never looked at again if refused
(issue 13 §2).

Thread model (docs/threads.md): every method runs under ``Consumer.lock``.
"""

from __future__ import annotations

import logging
import os

from .._errors import InternalError, RendezvousError
from .._keys import parse_key
from .._transport import TransportContext
from .book import Book, Channel, Notice, Source
from .files import is_ours, peek_header
from .inbox import Inbox
from .listing import Listing
from .naming import Names
from .producer import task_name
from .ring import RINGS_SUPPORTED

__all__ = ["Recovery"]

_log = logging.getLogger("shmrdv.shm")

# Names a listing found not ours (another user's, not a regular file, a ring for another
# consumer, no valid header) are remembered, up to this many, and skipped without a system
# call afterwards: a flood of planted names costs one ``lstat`` each, once (issue 13 §2).
_REFUSED_MAX = 1 << 17
# At most this many names new to the consumer are looked at per listing (one ``lstat``,
# then maybe one open each); the rest wait for the next listing. Bounds a listing's work
# whatever another user plants.
_NEW_PER_LISTING = 32768

#: What a listing tells of a published message: step, key, seq, incarnation, created, slot.
Listed = tuple[int, str, int, int, int, int]


class Recovery:
    """The listings of one consumer (see the module docstring)."""

    def __init__(
        self, ctx: TransportContext, names: Names, book: Book, inbox: Inbox, tick: float
    ) -> None:
        self._ctx = ctx
        self._names = names
        self._book = book
        self._inbox = inbox
        #: The namespace's names in /dev/shm (also used to skip refused names elsewhere).
        self.listing = Listing(names.prefix, tick / 2, _REFUSED_MAX)
        # Names of published messages already looked at by a listing.
        self._listed: dict[str, Listed] = {}
        self._listed_gen = -1  # the listing generation ``_listed`` reflects
        self._rings_gen = -1  # the listing generation ``find_rings`` went through

    def recover(self, src: Source) -> bool:
        """Stash notices for ``src``'s messages whose records its full ring lost (one listing).

        Returns whether it stashed anything. Rate-limited with the other listings.
        """
        lost = [(r, r.lost) for r in src.rings if r.lost != r.lost_seen]
        if not lost or not self._list_messages():
            return False
        for r, n in lost:
            r.lost_seen = n
        incs = {r.inc for r in src.rings}
        book = self._book
        found = False
        for step, key, seq, inc, _created, slot in list(self._listed.values()):
            if inc not in incs or self._ctx.cleaned_up(step):
                continue
            ch = book.find(step, key)
            if ch is not None and (ch.inc not in (0, inc) or seq < ch.seq):
                continue
            if (key, inc, seq) in book.stash.get(step, {}):
                continue
            try:
                if task_name(parse_key(key).src) != src.task:
                    continue
            except RendezvousError:
                continue
            ch = book.channel(step, key, src, inc)
            book.put(ch, inc, seq, Notice(slot))
            found = True
        return found

    def find_gone(self, src: Source) -> list[Channel]:
        """The waiting channels of ``src`` that a listing shows a message for: ``src``'s
        incarnation is unknown (it is gone, or has not started) or its keys are pinned to
        an earlier run. Costs O(messages listed), not O(channels)."""
        if RINGS_SUPPORTED:
            self.find_rings()
        self._list_messages()
        book = self._book
        out = []
        for step, key, seq, inc, _created, _slot in list(self._listed.values()):
            chans = book.channels.get(step)
            ch = chans.get(key) if chans is not None else None
            if type(ch) is not Channel:  # none, or idle (no waiters)
                continue
            if ch.src is not src or ch not in book.waiters or ch.seq != seq:
                continue
            if ch.inc not in (0, inc):
                continue
            ch.inc = inc
            out.append(ch)
        return out

    def published(self, chans: list[Channel]) -> list[Channel]:
        """Those of ``chans`` whose next message a listing shows (one listing for many)."""
        self._list_messages()
        there = {(s, k, q, i) for s, k, q, i, _c, _sl in self._listed.values()}
        return [c for c in chans if (c.step, c.key, c.seq, c.inc) in there]

    def resolve_incarnation(self, ch: Channel) -> bool:
        """Find the incarnation of the channel's producer: its presence record, else (it is
        gone) the newest message a listing shows for the channel's next receive."""
        src = ch.src
        if not src.inc:
            try:
                record = self._ctx.peers.lookup(src.dev)
            except RendezvousError as e:  # a record that is not ours, or corrupt
                _log.warning("presence record of %s: %s", src.task, e)
                return False
            if record.final and record.incarnation:
                src.inc = record.incarnation
        if src.inc:
            ch.inc = src.inc
            return True
        # No record: the producer has not started, or it closed after sending. Its
        # messages are still there, under names computed with its incarnation.
        if RINGS_SUPPORTED:
            self.find_rings()
            if ch.nready:
                self._book.adopt_incarnation(ch)
                return ch.inc != 0
        self._list_messages()
        best, best_at = 0, -1
        for step, key, seq, inc, created, _slot in self._listed.values():
            if step == ch.step and seq == ch.seq and key == ch.key and created > best_at:
                best, best_at = inc, created
        ch.inc = best
        return best != 0

    def find_rings(self) -> None:
        """Attach the rings addressed to this worker that a listing shows (a producer that
        closed before we learned its incarnation); each name is tried once."""
        listing = self.listing
        if not listing.refresh() or self._rings_gen == listing.generation:
            return
        self._rings_gen = listing.generation
        marker = self._names.prefix + "q"
        budget = _NEW_PER_LISTING
        for name in listing.names:
            if not name.startswith(marker) or listing.refused(name):
                continue
            if budget <= 0:
                listing.incomplete()
                break
            budget -= 1
            try:
                if not is_ours(os.stat(Names.path(name), follow_symlinks=False)):
                    listing.refuse(name)  # another user's: one lstat, never opened
                    continue
            except OSError:
                continue
            try:
                self._inbox.attach(name, None)
            except InternalError as e:  # not ours, or not for this consumer: never again
                listing.refuse(name)
                _log.debug("%s", e)
            except RendezvousError as e:
                _log.debug("%s", e)

    def _list_messages(self) -> bool:
        """Bring ``_listed`` up to date with /dev/shm (``Listing``: a listdir at most once
        per half tick, none while the directory is unchanged); False if it may be stale.

        A name new to this consumer costs one ``lstat`` if it is another user's, at most
        ``_NEW_PER_LISTING`` of them per listing, and is never looked at again if refused.
        """
        listing = self.listing
        if not listing.refresh():
            return False
        if self._listed_gen == listing.generation:
            return True
        self._listed_gen = listing.generation
        marker = self._names.prefix + "m"
        listed = self._listed
        present = set()
        new: list[str] = []
        for e in listing.names:
            if e.startswith(marker):
                present.add(e)
                if e not in listed:
                    new.append(e)
        for name in list(listed):
            if name not in present:
                del listed[name]
        if len(new) > _NEW_PER_LISTING:
            del new[_NEW_PER_LISTING:]
            listing.incomplete()
        for name in new:
            h = peek_header(Names.path(name))  # one lstat for another user's name
            if h is None:
                listing.refuse(name)
            else:
                listed[name] = (
                    h.step_id,
                    h.key,
                    h.seq,
                    h.producer_incarnation,
                    h.created_ns,
                    h.slot,
                )
        return True
