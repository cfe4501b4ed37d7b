"""A consumer's mappings of its producers' pool slots, kept from one message to the next.

A pool slot travels between the same two processes again and again (``pool.py``). Mapped
afresh for each message it costs an ``mmap``, a ``munmap`` and a minor fault for every
64 KiB the receiver touches: 257 faults for a 16 MiB array read in full (issue 18 §2). A
slot's file keeps its inode across the renames of the slot protocol, so the consumer finds
its mapping again by (device, inode): the name is still opened with ``open_checked``
(``O_NOFOLLOW | O_NONBLOCK``, then owner, mode, type and size checked on the descriptor),
and only when that file is the very one already mapped, at the same size, is the new
descriptor closed and the kept mapping used. The inode number cannot be reused meanwhile:
the kept mapping holds the file.

A slot announced by its producer's ring (a notice naming the slot's ticket) is found by
``find`` without opening its name at all: the ring is the producer's own (created ``0600``
by this user and checked when attached, ``inbox.py``), and it names the run and the slot
that this consumer mapped, checked, before. The caller still renames the message's name
to ``held`` and checks the file's size (``fstat``) before it reads a byte.

Each message still gets an array of its own (``Segment.lend``), whose collection gives the
slot back; the mapping outlives it. A kept mapping is dropped when the cache is full (the
least recently used one that lends nothing), and when it has lent nothing for a while and
its slot is under none of its names any more (its producer dropped it, or is gone). Each
kept mapping holds one file descriptor (CPython's ``mmap`` keeps a ``dup``), hence the cap.

Thread model (docs/threads.md): not thread-safe; the consumer calls it under its lock.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from .files import Segment, open_checked
from .naming import SLOT_BITS, Names

__all__ = ["SlotIdent", "SlotMaps"]

#: At most this many kept mappings (file descriptors) per consumer: the pool's own default.
KEEP_MAX = 256
# A kept mapping that lent nothing for this long is checked for its slot's existence.
_IDLE_S = 2.0
# At most this many idle mappings are checked per sweep (a few stats each).
_SWEEP_MAX = 8

#: A slot file's identity across renames: (st_dev, st_ino).
SlotIdent = tuple[int, int]
_Ident = SlotIdent
# A ticket's slot index (naming.SLOT_BITS).
_INDEX = (1 << SLOT_BITS) - 1


@dataclass(eq=False)
class _Kept:
    segment: Segment
    size: int
    task: str  # the producer's task, incarnation and slot index: the slot's names
    incarnation: int
    slot: int  # the ticket of its last lend
    used_at: float


class SlotMaps:
    """The kept mappings of one consumer (see the module docstring)."""

    def __init__(self, names: Names, limit: int = KEEP_MAX) -> None:
        self._names = names
        self._limit = limit
        self._kept: OrderedDict[_Ident, _Kept] = OrderedDict()  # least recently used first
        # (producer task, incarnation, slot index) -> the kept mapping of that slot
        self._by_slot: dict[tuple[str, int, int], _Ident] = {}
        self.hits = 0
        self.maps = 0

    def __len__(self) -> int:
        return len(self._kept)

    def open(self, name: str) -> tuple[Segment, _Ident, bool]:
        """Open segment ``name``: (segment, its (device, inode), whether it is a kept mapping).

        Raises what ``Segment.attach`` raises: ``FileNotFoundError`` unchanged when there is
        no such name, ``InternalError`` for a file that is not ours, ``ResourceExhaustedError``
        when out of descriptors. A segment that is not kept is the caller's to close, or to
        ``keep``.
        """
        fd, st = open_checked(self._names.path(name), os.O_RDWR, "segment")
        ident = (st.st_dev, st.st_ino)
        kept = self._kept.get(ident)
        if kept is not None:
            if kept.size == st.st_size and not kept.segment.closed:
                os.close(fd)
                kept.used_at = time.monotonic()
                self._kept.move_to_end(ident)
                kept.segment.name = name
                self.hits += 1
                return kept.segment, ident, True
            self._drop(ident)  # resized: not the mapping to use any more
        self.maps += 1
        return Segment.map_fd(self._names, name, fd, st), ident, False

    def find(self, task: str, incarnation: int, ticket: int) -> tuple[Segment, _Ident] | None:
        """The kept mapping of the slot of ``ticket`` (its index) of ``task``'s run
        ``incarnation``, if there is one; the caller checks the file's size before use."""
        ident = self._by_slot.get((task, incarnation, ticket & _INDEX))
        if ident is None:
            return None
        kept = self._kept.get(ident)
        if kept is None or kept.segment.closed:
            return None
        kept.used_at = time.monotonic()
        self._kept.move_to_end(ident)
        self.hits += 1
        return kept.segment, ident

    def peek(self, task: str, incarnation: int, ticket: int) -> Segment | None:
        """``find``'s mapping, without counting a use (for a look ahead at the next one)."""
        ident = self._by_slot.get((task, incarnation, ticket & _INDEX))
        kept = self._kept.get(ident) if ident is not None else None
        if kept is None or kept.segment.closed:
            return None
        return kept.segment

    def keep(self, seg: Segment, ident: _Ident, task: str, incarnation: int, slot: int) -> None:
        """Keep ``seg`` (a pool slot of ``task``'s ``incarnation`` lent under ticket ``slot``)
        mapped for its next message; for a kept one, note the ticket of this lend."""
        kept = self._kept.get(ident)
        if kept is not None:
            kept.slot = slot
            return
        while len(self._kept) >= self._limit and self._evict_one():
            pass
        if len(self._kept) >= self._limit:
            seg.close()  # every kept mapping lends an array: this one is not kept
            return
        self._kept[ident] = _Kept(seg, seg.size, task, incarnation, slot, time.monotonic())
        self._by_slot[(task, incarnation, slot & _INDEX)] = ident

    def forget(self, ident: _Ident) -> None:
        """Drop the kept mapping of ``ident`` (its file turned out unusable)."""
        if ident in self._kept:
            self._drop(ident)

    def _evict_one(self) -> bool:
        for ident, kept in self._kept.items():
            if not kept.segment.lent:
                self._drop(ident)
                return True
        return False

    def _drop(self, ident: _Ident) -> None:
        kept = self._kept.pop(ident)
        at = (kept.task, kept.incarnation, kept.slot & _INDEX)
        if self._by_slot.get(at) == ident:
            del self._by_slot[at]
        kept.segment.close()  # unmapped now, or when its last lent array is collected

    def sweep(self) -> None:
        """Drop idle mappings whose slot is gone (a few ``stat`` calls; once per tick)."""
        now = time.monotonic()
        looked = 0
        for ident, kept in list(self._kept.items()):
            if looked >= _SWEEP_MAX:
                return
            if now - kept.used_at < _IDLE_S or kept.segment.lent:
                continue
            looked += 1
            kept.used_at = now
            if not self._slot_exists(ident, kept):
                self._drop(ident)

    def _slot_exists(self, ident: _Ident, kept: _Kept) -> bool:
        names = self._names
        for name in (
            # Taken back, the slot is free under its next ticket (naming.SLOT_BITS).
            names.pool(kept.task, kept.incarnation, kept.slot + (1 << SLOT_BITS)),
            names.returned(kept.task, kept.incarnation, kept.slot),
            names.held(kept.task, kept.incarnation, kept.slot),
        ):
            try:
                st = os.stat(names.path(name), follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == ident:
                return True
        return False

    def close(self) -> None:
        """Drop every kept mapping (arrays still lent keep theirs until collected)."""
        while self._kept:
            self._drop(next(iter(self._kept)))
