"""Pool slots: a producer's reusable, pre-faulted segments, lent to its consumers and back.

Fresh tmpfs pages cost a fault, an allocation and a zeroing each: writing a new segment
runs at a fraction of the speed of pages already faulted (research/pitfalls.md §5). So a
producer writes large messages into slots it keeps mapped (``SlotPool``): a send renames
the slot to the message's name (it belongs to the consumer then); the consumer renames it
to ``held`` while its array lives and, once the array is collected, to ``returned``, then
stores the ticket of the slot's next lend in the
slot's control block (its last ``CONTROL`` bytes, outside every message's data). The
producer reads that word at its next acquire and publishes the slot again from its
``returned`` name: nothing but renames and a word cross the processes. The names stay the
truth whoever crashes: a slot is under ``m`` while published, ``h`` while held, ``r`` once
given back, ``p`` when free. A consumer notes its incarnation in the block's second word
once it holds a slot, so that a producer takes back a slot whose holder is gone.

The consumer's half (taking, holding, giving back, kept mappings) is ``mappings.py``.

Only files this producer created are taken back: a ``returned`` name must still be the
slot's own inode (another user could plant a file under it, pitfalls.md §7). A slot's
names are over its *ticket* (``naming.SLOT_BITS``), whose generation grows at each lend:
a name seen vacated is never wanted again.

Thread model (docs/threads.md): ``SlotPool`` is thread-safe; its lock is never held
across a call that can block.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .._errors import InternalError, ResourceExhaustedError
from .files import Segment, move_noreplace
from .naming import MAX_SLOT, SLOT_BITS, Names

__all__ = ["CONTROL", "HOLDER_AT", "WORD", "ProducerAlive", "Slot", "SlotPool", "size_class"]

_log = logging.getLogger("shmrdv.shm.pool")

#: ``alive(task, incarnation)``: is that task's live worker of that incarnation? Lock-free
#: (it runs inside the garbage collector) and never blocks.
ProducerAlive = Callable[[str, int], bool]

_MIN_CLASS = 4096
#: Default cap on the number of slots (each holds one mapping and one file descriptor).
DEFAULT_MAX_SLOTS = 256
# A lent slot is checked for its return at most this many times per acquire, oldest first.
# An acquire that finds no free slot looks at most this many lent slots (one stat each
# when not returned): with a backlog nothing comes back, and each look is wasted.
_RECLAIM_SCAN = 8
# A lent slot is checked for being lost (two more stats) at most this often.
_LOST_CHECK_S = 1.0


# Room for the header above a power-of-two tensor: with plain powers of two a 256 MiB
# tensor's slot (512 MiB) would fill the default pool alone.
_HEADER_ROOM = 64 << 10


#: Bytes at the end of every slot file kept for its control block (the return word), out of
#: reach of any message's data: a class serves a segment of at most its size minus these.
CONTROL = 64
# The return word: the ticket of the slot's next lend, stored by the consumer that gave it
# back (``return_slot``). Tickets only grow, so a word left from an earlier lend never
# matches.
WORD = struct.Struct("<Q")
# The holder word, right after the return word: the incarnation of the consumer run that
# took the lend (0: not known).
HOLDER_AT = WORD.size


def _clear_holder(mem: mmap.mmap | bytearray) -> None:
    """Producer side, when a slot is taken for its next lend: no consumer holds it yet."""
    if len(mem) >= CONTROL:
        WORD.pack_into(mem, len(mem) - CONTROL + HOLDER_AT, 0)


def _counted(cls: int) -> int:
    """The bytes a slot of class ``cls`` counts against the pool's limit (its data part)."""
    return cls - _HEADER_ROOM if cls > 2 * _HEADER_ROOM else cls


def size_class(nbytes: int) -> int:
    """The slot size serving a segment of ``nbytes`` (and the ``CONTROL`` block): the next
    power of two (>= 4 KiB), above 128 KiB the next power of two of the data plus 64 KiB of
    room for the header."""
    n = max(nbytes + CONTROL, _MIN_CLASS)
    if n <= 2 * _HEADER_ROOM:
        return 1 << (n - 1).bit_length()
    return (1 << (n - _HEADER_ROOM - 1).bit_length()) + _HEADER_ROOM


@dataclass(eq=False)
class Slot:
    """One pool slot: its index, its mapping in the producer, its state."""

    index: int
    capacity: int
    segment: Segment
    ticket: int = -1  # the index and the lend generation (naming.SLOT_BITS); set at creation
    ino: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file: its identity across renames
    state: str = "free"  # free | allocated | lent | lost
    lent_name: str = field(default="")  # the message name it was published under
    lent_to: str = field(default="")  # the consumer task it was published for
    checked_at: float = 0.0  # time.monotonic() of the last lost check (or of the lend)
    sized: int = -1  # the acquire in which its file's size was last checked
    # The producer still holds the array ``allocate`` made over it (or a view of it): once
    # given back, the slot waits for that array's collection before it is written again.
    pinned: bool = False


class SlotPool:
    """The producer side of the slot protocol. Thread-safe."""

    def __init__(
        self,
        names: Names,
        task: str,
        incarnation: int,
        limit_bytes: int,
        max_slots: int = DEFAULT_MAX_SLOTS,
        holder_alive: ProducerAlive | None = None,
    ) -> None:
        self._names = names
        # ``holder_alive(consumer task, incarnation)``: is that run alive (a lost check asks
        # it of a slot whose held name stays)? None: never take a held slot back.
        self._holder_alive = holder_alive
        self._task = task
        self._incarnation = incarnation
        self._limit = limit_bytes
        self._max_slots = max_slots
        self._lock = threading.Lock()
        self._free: dict[int, list[Slot]] = {}  # size class -> free slots
        self._lent: deque[Slot] = deque()
        self._pinned: list[Slot] = []  # given back, still pinned (``Slot.pinned``)
        self._slots: dict[int, Slot] = {}
        self._next_index = 0
        self._bytes = 0
        self._count = 0  # slots created or being created
        self._acquires = 0  # acquires so far (``Slot.sized``)
        self._closed = False
        self.reused = 0
        self.created = 0
        self.lost = 0
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

    def acquire(self, nbytes: int) -> Slot | None:
        """A free slot for a segment of ``nbytes`` (its state becomes ``allocated``), or None.

        None means the pool cannot serve it (too big for the limit, or full of lent
        slots): the caller writes a one-off segment instead.
        """
        cls = size_class(nbytes)
        if self._limit <= 0 or _counted(cls) > self._limit:
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
                # No consumer holds its next lend yet (``hold``): cleared now, where its
                # control block was just read, not in the publish after the caller's write.
                _clear_holder(slot.segment.buf)
                self.reused += 1
                return slot
            while (
                self._bytes + _counted(cls) > self._limit or self._count >= self._max_slots
            ) and self._evict_one(cls):
                pass
            if self._bytes + _counted(cls) > self._limit or self._count >= self._max_slots:
                return None
            if self._next_index > MAX_SLOT:
                return None  # a million slots created in one run: one-off segments from now on
            index = self._next_index
            self._next_index += 1
            self._bytes += _counted(cls)  # reserve before leaving the lock
            self._count += 1
        try:
            seg = Segment.create(
                self._names, cls, self._names.pool(self._task, self._incarnation, index)
            )
        except BaseException as e:
            with self._lock:
                self._bytes -= _counted(cls)
                self._count -= 1
            if isinstance(e, ResourceExhaustedError):
                # /dev/shm cannot hold the size class: the caller tries an exact-size
                # segment, which may still fit.
                _log.info("no room for a %d-byte pool slot: %s", cls, e)
                return None
            if isinstance(e, InternalError):
                # The name exists: planted by someone (our names are per incarnation and
                # never reused). Never write into it; the caller uses a one-off segment.
                _log.warning("pool slot %d of incarnation %016x: %s", index, self._incarnation, e)
                return None
            raise
        try:
            st = os.stat(seg.path, follow_symlinks=False)
        except OSError:
            seg.unlink()
            seg.close()
            with self._lock:
                self._bytes -= _counted(cls)
                self._count -= 1
            return None
        slot = Slot(
            index=index,
            capacity=cls,
            segment=seg,
            ticket=index,
            ino=(st.st_dev, st.st_ino),
            state="allocated",
        )
        with self._lock:
            self._slots[index] = slot
            self.created += 1
        return slot

    def _intact(self, slot: Slot) -> bool:
        """(Under the lock) whether the slot's file still holds the whole slot (one fstat,
        unless ``_came_back`` made it a moment ago): writing to a page a truncation took
        would be a SIGBUS. A truncated slot is dropped."""
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
        if free:
            slot = free.pop()
            slot.state = "allocated"
            return slot
        return None

    def _reclaim(self) -> None:
        """Take back slots their consumers have given back: through the control block (no
        name touched), or under their ``returned`` name (``r`` name -> ``p`` name).

        Forgets slots that are under none of their names any more (see the module docstring).
        """
        if self._pinned:
            pinned = self._pinned
            self._pinned = []
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
            if self._exists(slot.lent_name):
                self._lent.append(slot)  # not received yet: its consumer's
                continue
            held = self._names.path(self._names.held(self._task, self._incarnation, slot.ticket))
            if self._exists(held):
                if not self._reclaim_held(slot, held):
                    self._lent.append(slot)  # still with its consumer
                continue
            if self._came_back(slot) or slot.state != "lent" or self._take_back(slot):
                continue  # given back while we looked, or forgotten
            _log.debug(
                "pool slot %d (%s) was freed by its consumer; forgetting it",
                slot.index,
                slot.lent_name,
            )
            self.lost += 1
            self._forget(slot)

    def _reclaim_held(self, slot: Slot, held: str) -> bool:
        """Take back a slot whose ``held`` name stays although the consumer run that holds
        it is gone (killed: nothing renamed or unlinked it); whether it was. Only the file
        we created, only when the holder word names a run and its presence record says that
        run is over: a live consumer's slot is never touched."""
        if self._holder_alive is None or not slot.lent_to:
            return False
        seg = slot.segment
        try:
            seg.check_size(slot.capacity)
            holder = WORD.unpack_from(seg.buf, slot.capacity - CONTROL + HOLDER_AT)[0]
            st = os.stat(held, follow_symlinks=False)
        except (InternalError, OSError):
            return False
        if not holder or (st.st_dev, st.st_ino) != slot.ino:
            return False
        try:
            if self._holder_alive(slot.lent_to, holder):
                return False
        except Exception:  # a corrupt or foreign record: cannot tell, so it is not over
            return False
        ret = self._names.path(self._names.returned(self._task, self._incarnation, slot.ticket))
        try:
            move_noreplace(held, ret)
        except OSError:
            return False
        if not self._take_back(slot):
            return False
        self.reclaimed += 1
        _log.info(
            "took back pool slot %d from %s (incarnation %016x), which is gone",
            slot.index,
            slot.lent_to,
            holder,
        )
        return True

    def _came_back(self, slot: Slot) -> bool:
        """Whether the consumer gave ``slot`` back through its control block (it renamed the
        file to its ``returned`` name first); if so it is free again, under that name. One
        ``fstat``: reading a page a truncation took would be a SIGBUS. A shrunk slot is
        forgotten."""
        nxt = slot.ticket + (1 << SLOT_BITS)
        seg = slot.segment
        try:
            seg.check_size(slot.capacity)
            word = WORD.unpack_from(seg.buf, slot.capacity - CONTROL)[0]
        except InternalError as e:
            _log.warning("dropping pool slot %d: %s", slot.index, e)
            self.lost += 1
            slot.state = "lost"
            # Given back already? Then its returned name is ours to remove (a held one is
            # still its consumer's).
            with contextlib.suppress(OSError):
                self._remove_returned(slot)
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
        """Rename the slot's ``returned`` name back to its ``pool`` name; whether it was there."""
        ret = self._names.path(self._names.returned(self._task, self._incarnation, slot.ticket))
        try:
            st = os.stat(ret, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as e:
            _log.warning("cannot stat returned pool slot %s: %s", ret, e)
            return False
        if (st.st_dev, st.st_ino) != slot.ino:
            # Not the file we created: planted by someone else. Never take it as ours.
            self._refuse(ret)
            return False
        ticket = slot.ticket + (1 << SLOT_BITS)  # the next lend gets names of its own
        pool_name = self._names.pool(self._task, self._incarnation, ticket)
        try:
            # Only our own uid can rename our file in the sticky /dev/shm, so it is still ours.
            # No replace: a file planted under the pool name (as root, rename would destroy
            # it) is left alone, and the slot stays free under its returned name, which
            # ``gc`` knows as well (its header names this lend).
            move_noreplace(ret, self._names.path(pool_name))
        except FileExistsError:
            self._refuse(self._names.path(pool_name))
            pool_name = self._names.returned(self._task, self._incarnation, slot.ticket)
        except FileNotFoundError:
            return False
        except OSError as e:
            _log.warning("cannot take back pool slot %s: %s", ret, e)
            return False
        self._freed_as(slot, ticket, pool_name)
        return True

    def _refuse(self, path: str) -> None:
        """A file under one of a slot's names that is not the slot: counted, warned of once."""
        self.refused += 1
        if self.refused == 1:
            _log.warning(
                "refusing %s: not the pool slot this producer created (planted by another "
                "process?); further ones are counted in stats() as pool_refused",
                path,
            )

    def _exists(self, name: str) -> bool:
        """Whether there is a file under ``name`` (a bare name, or a path)."""
        if not name:
            return False
        try:
            os.stat(self._names.path(name) if "/" not in name else name, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell: assume it is still out there
        return True

    def _forget(self, slot: Slot, unlink: bool = False) -> None:
        """Drop a slot: its mapping, its bytes, and (``unlink``) its name."""
        self._slots.pop(slot.index, None)
        self._bytes -= _counted(slot.capacity)
        self._count -= 1
        if unlink:
            slot.segment.unlink()
        slot.segment.close()

    def _evict_one(self, wanted: int) -> bool:
        """Drop one free slot of another size class to make room; False if there is none."""
        for cls, free in self._free.items():
            if cls != wanted and free:
                self._forget(free.pop(), unlink=True)
                return True
        return False

    def release(self, slot: Slot) -> None:
        """Give back an allocated slot that was not published (e.g. allocate() never sent)."""
        with self._lock:
            if self._closed:
                slot.segment.unlink()
                slot.segment.close()
                return
            slot.state = "free"
            self._free.setdefault(slot.capacity, []).append(slot)

    def lend(self, slot: Slot, name: str, consumer: str = "", *, pinned: bool = False) -> None:
        """Record that ``slot`` was published as message ``name`` for the consumer task
        ``consumer``: the consumer has it now. ``pinned``: the producer still holds an
        array over it (``allocate``'s), and the slot is not written again, once back, until
        ``unpin``."""
        with self._lock:
            slot.pinned = pinned
            slot.state = "lent"
            slot.lent_name = name
            slot.lent_to = consumer
            slot.checked_at = time.monotonic()
            self._lent.append(slot)

    @staticmethod
    def unpin(slot: Slot) -> None:
        """The producer's array over a lent ``slot`` is collected: the slot may be written
        again once back (the next ``acquire`` that looks takes it). Takes no lock: it runs
        in whichever thread collects the array, possibly inside the garbage collector."""
        slot.pinned = False

    def close(self) -> None:
        """Unlink free slots and those already returned; lent ones belong to their consumers.

        Consumers returning a slot after this see the producer gone and unlink it
        themselves (``return_slot``).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self._slots.values())
            self._free.clear()
            lent = list(self._lent)
            self._lent.clear()
        for slot in slots:
            if slot.state == "lent":
                continue
            slot.segment.unlink()
            slot.segment.close()
        for slot in lent:
            try:
                self._remove_returned(slot)
            except OSError as e:
                _log.warning("cannot remove returned pool slot %d: %s", slot.index, e)
            slot.segment.close()

    def _remove_returned(self, slot: Slot) -> None:
        """Unlink ``slot``'s ``returned`` name if it is there and still the slot's own
        inode (another user may have planted a file under it). Raises ``OSError`` but for
        a name that is not there."""
        ret = self._names.path(self._names.returned(self._task, self._incarnation, slot.ticket))
        try:
            st = os.stat(ret, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == slot.ino:
                os.unlink(ret)
        except FileNotFoundError:
            pass
