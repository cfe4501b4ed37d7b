"""Pool slots: a producer's reusable, pre-faulted segments, lent to its consumers and back.

Fresh tmpfs pages cost a fault, an allocation and a zeroing each (research/pitfalls.md §5),
so large messages go into slots the producer keeps mapped. Publishing renames a slot to the
message's name; its consumer (``mappings.py``) renames it ``held`` while its array lives,
``returned`` once it is collected, and stores the ticket of the slot's next lend in the
slot's control block, which the producer reads at its next acquire: the names stay the
truth whoever crashes. A holder's incarnation in the block lets a slot whose holder is gone
be taken back. Only the slot's own file (its inode) is ever taken back.

Thread model (docs/threads.md): ``SlotPool`` is thread-safe; its lock is never held
across a call that can block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import InternalError, ResourceExhaustedError
from .._keys import DeviceName
from .._transport import PeerDirectory
from .files import Segment, move_noreplace
from .naming import MAX_SLOT, SLOT_BITS, Names

__all__ = ["CONTROL", "DEFAULT_MAX_SLOTS", "HOLDER_AT", "WORD", "ProducerAlive", "Slot"]
__all__ += ["SlotPool", "run_alive"]

_log = logging.getLogger("shmrdv.shm.pool")

#: ``alive(task, incarnation)``: is that task's live worker of that incarnation? Lock-free
#: (it runs inside the garbage collector) and never blocks.
ProducerAlive = Callable[[str, int], bool]


def run_alive(peers: PeerDirectory) -> ProducerAlive:
    """``pool.ProducerAlive`` over the liveness monitor. Lock-free, never blocks (it may run
    inside the garbage collector); raises what ``PeerDirectory.state`` raises."""

    def alive(task: str, incarnation: int) -> bool:
        seen = peers.state(DeviceName.parse(task))
        record = seen.record if seen.state == "alive" else None
        return record is not None and record.incarnation == incarnation

    return alive


#: At most this many slots (each holds a mapping and a file descriptor).
DEFAULT_MAX_SLOTS = 256
_MIN_CLASS = 4096
# Room for the header above a power-of-two tensor (else a 256 MiB tensor's slot, 512 MiB,
# would fill the default pool alone).
_HEADER_ROOM = 64 << 10
# An acquire looks at most at this many lent slots, oldest first (a stat each while not
# given back: with a backlog each look is wasted), each for being lost at most this often.
_RECLAIM_SCAN = 8
_LOST_CHECK_S = 1.0
CONTROL = 64  # bytes at the end of every slot file, out of reach of the data
# The return word, the ticket of the slot's next lend (tickets only grow: a word left from
# an earlier lend never matches), then the holder word, the incarnation of the consumer
# run holding the lend (0: none).
WORD = struct.Struct("<Q")
HOLDER_AT = WORD.size


def _counted(cls: int) -> int:
    """The bytes a slot of class ``cls`` counts against the pool's limit (its data part)."""
    return cls - _HEADER_ROOM if cls > 2 * _HEADER_ROOM else cls


def size_class(nbytes: int) -> int:
    """The slot size serving a segment of ``nbytes`` and the control block: the next power
    of two (at least 4 KiB); above 128 KiB, that of the data, plus 64 KiB for the header."""
    n = max(nbytes + CONTROL, _MIN_CLASS)
    if n <= 2 * _HEADER_ROOM:
        return 1 << (n - 1).bit_length()
    return (1 << (n - _HEADER_ROOM - 1).bit_length()) + _HEADER_ROOM


@dataclass(eq=False)
class Slot:
    index: int
    capacity: int
    segment: Segment  # its mapping in the producer
    ticket: int  # the index and the lend generation (naming.SLOT_BITS)
    ino: tuple[int, int]  # (st_dev, st_ino) of the file: its identity across renames
    state: str = "allocated"  # free | allocated | lent | lost
    lent_name: str = ""  # the message name it was published under
    lent_to: str = ""  # the consumer task it was published for
    checked_at: float = 0.0  # time.monotonic() of the last lost check (or of the lend)
    sized: int = -1  # the acquire in which its file's size was last checked
    # The producer holds ``allocate``'s array over it: not written again before collected.
    pinned: bool = False


class SlotPool:
    """The producer side of the slot protocol, up to ``limit`` bytes of slots. Thread-safe.
    ``holder_alive(consumer task, incarnation)`` says whether the consumer run holding a
    slot lives."""

    def __init__(
        self, names: Names, task: str, incarnation: int, limit: int, holder_alive: ProducerAlive
    ) -> None:
        self._names = names
        self._holder_alive = holder_alive
        self._task = task
        self._incarnation = incarnation
        self._limit = limit
        self._lock = threading.Lock()
        self._free: dict[int, list[Slot]] = {}  # size class -> free slots
        self._lent: deque[Slot] = deque()
        self._pinned: list[Slot] = []  # given back, still pinned
        self._slots: dict[int, Slot] = {}
        self._next_index = 0
        self._bytes = 0
        self._count = 0  # slots created or being created
        self._acquires = 0  # for ``Slot.sized``
        self._closed = False
        self.reused = self.created = self.lost = 0
        self.refused = 0  # files under a slot's names that were not that slot's
        self.reclaimed = 0  # held slots taken back from a consumer run that is gone

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "pool_slots": len(self._slots),
                "pool_bytes": self._bytes,
                "pool_free": sum(len(v) for v in self._free.values()),
                "pool_lent": len(self._lent),
                "pool_reused": self.reused,
                "pool_created": self.created,
                "pool_lost": self.lost,
                "pool_refused": self.refused,
                "pool_reclaimed": self.reclaimed,
            }

    def _path(self, kind: Callable[[str, int, int], str], ticket: int) -> str:
        return Names.path(kind(self._task, self._incarnation, ticket))

    def acquire(self, nbytes: int) -> Slot | None:
        """A free slot for a segment of ``nbytes`` (now ``allocated``), or None when the
        pool cannot serve it (the caller writes a one-off segment). Never blocks."""
        cls = size_class(nbytes)
        counted = _counted(cls)
        if counted > self._limit:
            return None
        with self._lock:
            if self._closed:
                return None
            self._acquires += 1
            slot = self._take_free(cls)
            if slot is None:
                self._reclaim()
                slot = self._take_free(cls)
            if slot is not None and self._intact(slot):
                # No consumer holds its next lend yet: cleared here, where its control
                # block was just read, not after the caller's write.
                mem = slot.segment.buf
                WORD.pack_into(mem, len(mem) - CONTROL + HOLDER_AT, 0)
                self.reused += 1
                return slot
            while self._full(counted) and self._evict_one(cls):
                pass
            if self._full(counted) or self._next_index > MAX_SLOT:
                return None  # (a million slots in one run: one-off segments from now on)
            index = self._next_index
            self._next_index += 1
            self._bytes += counted  # reserved before leaving the lock
            self._count += 1
        seg = None
        try:
            seg = Segment.create(
                self._names, cls, self._names.pool(self._task, self._incarnation, index)
            )
            st = os.stat(seg.path, follow_symlinks=False)
        except BaseException as e:
            if seg is not None:
                seg.unlink_quietly()
                seg.close()
            with self._lock:
                self._bytes -= counted
                self._count -= 1
            # No room for the class (an exact-size segment may still fit), or the name
            # exists: planted (our names are never reused), never written into.
            if isinstance(e, ResourceExhaustedError):
                _log.info("no room for a %d-byte pool slot: %s", cls, e)
            elif isinstance(e, (InternalError, OSError)):
                _log.warning("pool slot %d of incarnation %016x: %s", index, self._incarnation, e)
            else:
                raise
            return None
        slot = Slot(index, cls, seg, index, (st.st_dev, st.st_ino))
        with self._lock:
            self._slots[index] = slot
            self.created += 1
        return slot

    def _full(self, counted: int) -> bool:
        return self._bytes + counted > self._limit or self._count >= DEFAULT_MAX_SLOTS

    def _intact(self, slot: Slot) -> bool:
        """Whether the slot's file still holds it all (one fstat, unless ``_came_back`` made
        it a moment ago): writing to a page a truncation took is a SIGBUS."""
        if slot.sized == self._acquires:
            return True
        try:
            slot.segment.check_size(slot.capacity)
        except InternalError as e:
            _log.warning("dropping pool slot %d: %s", slot.index, e)
            self._forget(slot, unlink=True)
            return False
        return True

    def _take_free(self, cls: int) -> Slot | None:
        free = self._free.get(cls)
        if not free:
            return None
        slot = free.pop()
        slot.state = "allocated"
        return slot

    def _reclaim(self) -> None:
        """Take back slots given back, and held ones whose consumer run is gone; forget those
        under none of their names any more."""
        if self._pinned:
            pinned, self._pinned = self._pinned, []
            for slot in pinned:
                self._freed_as(slot, slot.ticket, slot.segment.name)
        now = time.monotonic()
        for _ in range(min(len(self._lent), _RECLAIM_SCAN)):
            slot = self._lent.popleft()
            if self._came_back(slot) or slot.state != "lent" or self._take_back(slot):
                continue  # free again, or forgotten (its file was shrunk under it)
            if now - slot.checked_at < _LOST_CHECK_S:
                self._lent.append(slot)
                continue
            slot.checked_at = now
            if os.path.lexists(Names.path(slot.lent_name)):
                self._lent.append(slot)  # not received yet: its consumer's
                continue
            held = self._path(self._names.held, slot.ticket)
            if os.path.lexists(held):
                if not self._reclaim_held(slot, held):
                    self._lent.append(slot)  # still with its consumer
                continue
            if self._came_back(slot) or slot.state != "lent" or self._take_back(slot):
                continue  # given back while we looked, or forgotten
            _log.debug("pool slot %d (%s) was freed by its consumer", slot.index, slot.lent_name)
            self.lost += 1
            self._forget(slot)

    def _reclaim_held(self, slot: Slot, held: str) -> bool:
        """Take back a slot still ``held`` by a consumer run that is gone (killed); whether
        it was. Only our file, only when the holder word names a run known to be over."""
        if not slot.lent_to:
            return False
        seg = slot.segment
        try:
            seg.check_size(slot.capacity)
            holder = WORD.unpack_from(seg.buf, slot.capacity - CONTROL + HOLDER_AT)[0]
            st = os.stat(held, follow_symlinks=False)
            if not holder or (st.st_dev, st.st_ino) != slot.ino:
                return False
            if self._holder_alive(slot.lent_to, holder):
                return False
            move_noreplace(held, self._path(self._names.returned, slot.ticket))
        except Exception:  # cannot tell (a corrupt or foreign record, a file gone): not over
            return False
        if not self._take_back(slot):
            return False
        self.reclaimed += 1
        _log.info("took back slot %d from %s (run %016x, gone)", slot.index, slot.lent_to, holder)
        return True

    def _came_back(self, slot: Slot) -> bool:
        """Whether the consumer gave ``slot`` back through its control block: then it is free,
        under its ``returned`` name. A shrunk slot is forgotten."""
        nxt = slot.ticket + (1 << SLOT_BITS)
        seg = slot.segment
        try:
            seg.check_size(slot.capacity)
            word = WORD.unpack_from(seg.buf, slot.capacity - CONTROL)[0]
        except InternalError as e:
            _log.warning("dropping pool slot %d: %s", slot.index, e)
            self.lost += 1
            slot.state = "lost"
            with contextlib.suppress(OSError):  # a returned name is ours to remove (a held
                self._remove_returned(slot)  # one is still its consumer's)
            self._forget(slot)
            return False
        if word != nxt:
            return False
        self._freed_as(slot, nxt, self._names.returned(self._task, self._incarnation, slot.ticket))
        slot.sized = self._acquires
        return True

    def _freed_as(self, slot: Slot, ticket: int, pool_name: str) -> None:
        slot.segment.name = pool_name
        slot.ticket = ticket
        slot.state = "free"
        slot.lent_name = slot.lent_to = ""
        if slot.pinned:
            self._pinned.append(slot)  # free, not to be written while the producer reads it
        else:
            self._free.setdefault(slot.capacity, []).append(slot)

    def _take_back(self, slot: Slot) -> bool:
        """Whether ``slot`` is under its ``returned`` name (given back without the word): if
        so it is free again, under that name."""
        ret = self._names.returned(self._task, self._incarnation, slot.ticket)
        try:
            st = os.stat(Names.path(ret), follow_symlinks=False)
        except OSError:
            return False  # not given back (yet)
        if (st.st_dev, st.st_ino) != slot.ino:
            self._refuse(Names.path(ret))  # not the file we created: never take it as ours
            return False
        self._freed_as(slot, slot.ticket + (1 << SLOT_BITS), ret)
        return True

    def _refuse(self, path: str) -> None:
        self.refused += 1
        if self.refused == 1:
            msg = "refusing %s: not this producer's pool slot (planted?); more in pool_refused"
            _log.warning(msg, path)

    def _forget(self, slot: Slot, unlink: bool = False) -> None:
        self._slots.pop(slot.index, None)
        self._bytes -= _counted(slot.capacity)
        self._count -= 1
        if unlink:
            slot.segment.unlink()
        slot.segment.close()

    def _evict_one(self, wanted: int) -> bool:
        """Drop a free slot of another size class to make room; False if there is none."""
        for cls, free in self._free.items():
            if cls != wanted and free:
                self._forget(free.pop(), unlink=True)
                return True
        return False

    def release(self, slot: Slot) -> None:
        """Give back an allocated slot that was not published (an ``allocate`` never sent)."""
        with self._lock:
            if self._closed:
                self._forget(slot, unlink=True)
                return
            slot.state = "free"
            self._free.setdefault(slot.capacity, []).append(slot)

    def lend(self, slot: Slot, name: str, consumer: str, *, pinned: bool = False) -> None:
        """``slot`` was published as message ``name`` for the consumer task ``consumer``;
        ``pinned``: not written again, once back, until ``unpin``."""
        with self._lock:
            slot.pinned = pinned
            slot.state = "lent"
            slot.lent_name = name
            slot.lent_to = consumer
            slot.checked_at = time.monotonic()
            self._lent.append(slot)

    @staticmethod
    def unpin(slot: Slot) -> None:
        """The producer's array over ``slot`` is collected. Takes no lock: it runs wherever
        the array is collected, maybe inside the GC."""
        slot.pinned = False

    def close(self) -> None:
        """Unlink free slots and those given back; lent ones belong to their consumers (who
        unlink them when they give them back and find the producer gone)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self._slots.values())
            self._free.clear()
            lent = list(self._lent)
            self._lent.clear()
        for slot in slots:
            if slot.state != "lent":
                slot.segment.unlink()
                slot.segment.close()
        for slot in lent:
            try:
                self._remove_returned(slot)
            except OSError as e:
                _log.warning("cannot remove returned pool slot %d: %s", slot.index, e)
            slot.segment.close()

    def _remove_returned(self, slot: Slot) -> None:
        """Unlink ``slot``'s ``returned`` name if it is the slot's own inode."""
        ret = self._path(self._names.returned, slot.ticket)
        try:
            st = os.stat(ret, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == slot.ino:
                os.unlink(ret)
        except FileNotFoundError:
            pass
