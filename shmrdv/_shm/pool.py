"""Pool slots: a producer's reusable, pre-faulted segments, lent to its consumers and back.

Fresh tmpfs pages cost a fault, an allocation and a zeroing each: writing a new segment
runs at a fraction of the speed of pages already faulted (research/pitfalls.md §5). So a
producer writes large messages into slots it keeps mapped (``SlotPool``): a send renames
the slot to the message's name (it belongs to the consumer then); the consumer renames it
to ``held`` while its array lives (``SlotMaps.take``) and, once the array is collected,
to ``returned`` (``give_back``), then stores the ticket of the slot's next lend in the
slot's control block (its last ``CONTROL`` bytes, outside every message's data). The
producer reads that word at its next acquire and publishes the slot again from its
``returned`` name: nothing but renames and a word cross the processes. The names stay the
truth whoever crashes: a slot is under ``m`` while published, ``h`` while held, ``r`` once
given back, ``p`` when free. A consumer notes its incarnation in the block's second word
once it holds a slot, so that a producer takes back a slot whose holder is gone.

A consumer keeps each slot's mapping from one message to the next (``SlotMaps``), found
again by inode after the renames: no page faults per message after warm-up. Each mapping
holds a descriptor, hence the caps (``DEFAULT_MAX_SLOTS``, ``KEEP_MAX``).

Only files this producer created are taken back: a ``returned`` name must still be the
slot's own inode (another user could plant a file under it, pitfalls.md §7). A slot's
names are over its *ticket* (``naming.SLOT_BITS``), whose generation grows at each lend:
a name seen vacated is never wanted again.

Thread model (docs/threads.md): ``SlotPool`` is thread-safe (its lock is never held across
a rename of a peer's file); ``SlotMaps`` runs under the consumer's lock; ``return_slot``
runs in whichever thread collects an array, possibly inside the garbage collector: it
takes no lock.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import InternalError, RendezvousError, ResourceExhaustedError
from .._rendezvous import Received, received
from .._values import shape_problem
from .files import Segment, move_noreplace, open_checked
from .header import FLAG_DEAD, Reader
from .naming import MAX_SLOT, SLOT_BITS, Names

__all__ = [
    "CONTROL",
    "ProducerAlive",
    "RunWatch",
    "Slot",
    "SlotMaps",
    "SlotPool",
    "give_back",
    "size_class",
]

_log = logging.getLogger("shmrdv.shm.pool")

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
_WORD = struct.Struct("<Q")
# The holder word, right after the return word: the incarnation of the consumer run that
# took the lend (0: not known).
_HOLDER_AT = _WORD.size


def _clear_holder(mem: mmap.mmap | bytearray) -> None:
    """Producer side, when a slot is taken for its next lend: no consumer holds it yet."""
    if len(mem) >= CONTROL:
        _WORD.pack_into(mem, len(mem) - CONTROL + _HOLDER_AT, 0)


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
    lent_key: str = field(default="")
    lent_name: str = field(default="")  # the message name it was published under
    lent_to: str = field(default="")  # the consumer task it was published for
    checked_at: float = 0.0  # time.monotonic() of the last lost check (or of the lend)
    sized: int = -1  # the acquire in which its file's size was last checked


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

    @property
    def bytes(self) -> int:
        return self._bytes

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
                # segment, which may still fit (issue 13 §5).
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
            self._drop(slot)
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
                slot.lent_key,
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
            holder = _WORD.unpack_from(seg.buf, slot.capacity - CONTROL + _HOLDER_AT)[0]
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
            word = _WORD.unpack_from(seg.buf, slot.capacity - CONTROL)[0]
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
        slot.lent_key = slot.lent_name = slot.lent_to = ""
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

    def _forget(self, slot: Slot) -> None:
        """Drop a slot whose file is gone (no name to unlink): its mapping and its bytes."""
        self._slots.pop(slot.index, None)
        self._bytes -= _counted(slot.capacity)
        self._count -= 1
        slot.segment.close()

    def _evict_one(self, wanted: int) -> bool:
        """Drop one free slot of another size class to make room; False if there is none."""
        for cls, free in self._free.items():
            if cls != wanted and free:
                slot = free.pop()
                self._drop(slot)
                return True
        return False

    def _drop(self, slot: Slot) -> None:
        self._slots.pop(slot.index, None)
        self._bytes -= _counted(slot.capacity)
        self._count -= 1
        slot.segment.unlink()
        slot.segment.close()

    def release(self, slot: Slot) -> None:
        """Give back an allocated slot that was not published (e.g. allocate() never sent)."""
        with self._lock:
            if self._closed:
                slot.segment.unlink()
                slot.segment.close()
                return
            slot.state = "free"
            self._free.setdefault(slot.capacity, []).append(slot)

    def lend(self, slot: Slot, key: str, name: str, consumer: str = "") -> None:
        """Record that ``slot`` was published as message ``name`` for the consumer task
        ``consumer``: the consumer has it now."""
        with self._lock:
            slot.state = "lent"
            slot.lent_key = key
            slot.lent_name = name
            slot.lent_to = consumer
            slot.checked_at = time.monotonic()
            self._lent.append(slot)

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


#: ``alive(producer_task, incarnation)``: is that task's live worker of that incarnation? Must
#: be lock-free (it runs inside the garbage collector) and must not block.
ProducerAlive = Callable[[str, int], bool]


class RunWatch:
    """A consumer's word about one producer run, read by ``return_slot`` without a lock.

    While ``live``, the consumer has that run's ring attached and will collect what the run
    leaves once it is over (``reaper.collect_producer``, after the ring is retired), so a
    slot given back meanwhile needs no look at the producer's liveness: if the producer
    closed before taking it, that collection frees it. The consumer clears ``live`` (under
    its lock) before the collection lists anything, and ``return_slot`` reads it after its
    rename: a rename it does not see cleared came before the listing.
    """

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True


def return_slot(
    names: Names,
    alive: ProducerAlive,
    producer_task: str,
    incarnation: int,
    slot: int,
    held_name: str,
    held_names: set[str],
    mem: mmap.mmap | None = None,
    watch: RunWatch | None = None,
    returned_path: str | None = None,
) -> None:
    """Consumer side, when the last array over a pool slot is collected: give it back
    (``held_name``: its ``held`` name, one of ``held_names``; ``returned_path``: its
    ``returned`` name's path, if computed ahead).

    ``held`` -> ``returned`` (``give_back``, with the slot's mapping ``mem`` and a ``watch``
    of its producer run when there are: then the control block tells the producer, and no
    look at its liveness is needed). Runs in whatever thread collected the array (possibly
    inside the garbage collector: it takes no lock).
    """
    held_names.discard(held_name)
    give_back(
        names,
        alive,
        producer_task,
        incarnation,
        slot,
        names.path(held_name),
        mem,
        watch,
        returned_path,
    )


def _taken_back(names: Names, alive: ProducerAlive, producer_task: str, incarnation: int) -> bool:
    """Whether the producer run will still take back what is given back to it now (called
    after the rename): its doorbell is there and its presence record is that run's, alive."""
    try:
        return os.path.lexists(names.bell_path(producer_task)) and alive(producer_task, incarnation)
    except Exception:  # a corrupt or foreign record: treat as gone
        return False


def give_back(
    names: Names,
    alive: ProducerAlive,
    producer_task: str,
    incarnation: int,
    slot: int,
    path: str,
    mem: mmap.mmap | None = None,
    watch: RunWatch | None = None,
    returned_path: str | None = None,
) -> None:
    """Rename the pool slot file at ``path`` to its ``returned`` name (``returned_path``, if
    the caller has it), for its producer; with
    its mapping ``mem``, then store the slot's next ticket in its control block (one
    ``fstat`` first: a store into a page a truncation took would be a SIGBUS).

    If the producer is no longer the live worker of that incarnation, nobody will take it
    back: unlink it instead. A missing ``path`` (removed by close or gc meanwhile) is fine.
    That look (the doorbell, the presence record and its lock) is skipped while ``watch``
    is live: its consumer will collect what the run leaves (``RunWatch``).

    No ``returned`` file outlives a closing producer: its ``close`` unlinks its doorbell
    first and then removes the ``returned`` names of its lent slots. We rename first, then
    look for the doorbell, then for its live presence record; if we see both, the doorbell
    we saw was that producer's (a successor's appears only after the record is gone), so
    our rename came before its sweep, which will find the file. (Under a live ``watch``, a
    rename after that sweep leaves the file to the consumer's collection of the run.)
    """
    ret = returned_path or names.path(names.returned(producer_task, incarnation, slot))
    try:
        move_noreplace(path, ret)
    except FileNotFoundError:
        return  # removed by close or gc meanwhile
    except OSError as e:
        _log.warning("cannot give pool slot %s back (%s); unlinking it", path, e)
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    if mem is not None:
        try:
            end = len(mem)
            if end >= CONTROL and mem.size() >= end:
                _WORD.pack_into(mem, end - CONTROL, slot + (1 << SLOT_BITS))
        except (OSError, ValueError):
            pass  # its producer finds it under its name (``SlotPool._take_back``)
    if watch is not None and watch.live:
        return
    if not _taken_back(names, alive, producer_task, incarnation):
        try:
            os.unlink(ret)
        except OSError:
            pass


# -- the consumer's side: kept mappings -------------------------------------------------

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

    def __init__(
        self, names: Names, incarnation: int, alive: ProducerAlive, limit: int = KEEP_MAX
    ) -> None:
        self._names = names
        self._inc = incarnation  # the consumer run: noted in the slots it holds
        self._alive = alive
        self._reader = Reader()
        self._limit = limit
        #: ``held`` names of slots whose arrays this consumer still has (their callbacks
        #: discard theirs); whoever closes the consumer unlinks what is left.
        self.held: set[str] = set()
        self.probes = 0
        self._kept: OrderedDict[_Ident, _Kept] = OrderedDict()  # least recently used first
        # (producer task, incarnation, slot index) -> the kept mapping of that slot
        self._by_slot: dict[tuple[str, int, int], _Ident] = {}
        self.hits = 0
        self.maps = 0

    def __len__(self) -> int:
        return len(self._kept)

    def open(self, name: str) -> tuple[Segment, SlotIdent, bool]:
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

    def take(
        self,
        task: str,
        step: int,
        key: str,
        inc: int,
        seq: int,
        slot: int = -1,
        array: tuple[Any, ...] | None = None,
        watch: RunWatch | None = None,
    ) -> Received | BaseException | None:
        """Take message ``seq`` of (step, key) of producer ``task``'s run ``inc`` from the
        segment of its name: None if there is no such name (not published yet).

        The array is a view over the mapped segment (zero copy), writable and the
        consumer's alone: the name is unlinked at once, or, for a pool slot, renamed to
        ``held`` (and this run noted in the slot's control block) while the array lives;
        its collection gives the slot back (``return_slot``). A slot its ring notice names
        (``slot``, ``array``: what the notice said) that is mapped already is taken with no
        open. A file that is not ours, or whose header does not say this message, is
        refused: the error is returned in its place.
        """
        self.probes += 1
        names = self._names
        name = names.message(step, key, inc, seq)
        path = Names.path(name)
        found = self.find(task, inc, slot) if slot >= 0 and array is not None else None
        held = ""
        if found is not None and array is not None:
            seg, ident = found
            dtype, shape, offset, nbytes, dead = array
            held = names.held(task, inc, slot)
            try:
                seg.check_size(seg.size)  # a shrunk file would be a SIGBUS
                move_noreplace(path, Names.path(held))
            except FileNotFoundError:
                return None
            except (RendezvousError, OSError):
                found = None  # the checked open below decides, and says why
        if found is None:
            try:
                seg, ident, kept = self.open(name)
            except FileNotFoundError:
                return None
            except RendezvousError as e:
                return e  # not ours, unreadable, or out of descriptors: never read
            try:
                flags, dtype, shape, offset, nbytes, got_step, got_seq, _, _, slot, _, got = (
                    self._reader.read(seg.buf, 0, seg.size, record=False)
                )
                if got != key or got_seq != seq or got_step != step:
                    raise InternalError(
                        f"segment {name} holds key {got!r} step {got_step} seq {got_seq}, "
                        f"expected {key!r} step {step} seq {seq}"
                    )
                problem = shape_problem(shape, dtype.itemsize)
                if problem is not None:
                    raise InternalError(f"segment {name} from {task}: {problem}")
            except RendezvousError as e:
                seg.unlink_quietly()
                self._let_go(seg, ident, kept)
                return e
            dead = bool(flags & FLAG_DEAD)
            held = names.held(task, inc, slot) if slot >= 0 else ""
            if held:
                try:
                    move_noreplace(path, Names.path(held))
                except OSError as e:
                    _log.warning(
                        "cannot mark %s held (%s); it will not return to its pool", name, e
                    )
                    held = ""
            if not held:
                seg.unlink_quietly()
                arr = seg.view(dtype, shape, offset, nbytes)
                self._let_go(seg, ident, kept)
                return received(arr, dead)
        # A pool slot named ``held`` now, its size checked a moment ago: this run noted in
        # its control block, then an array of its own over the kept mapping.
        seg.name = held
        if offset + nbytes > seg.size:
            seg.unlink_quietly()
            self.forget(ident)
            return InternalError(
                f"pool slot {name} of {seg.size} bytes cannot hold {nbytes} bytes at {offset}"
            )
        mem = seg.buf
        ctl = mem if isinstance(mem, mmap.mmap) and offset + nbytes <= seg.size - CONTROL else None
        if ctl is not None and self._inc:
            _WORD.pack_into(ctl, len(ctl) - CONTROL + _HOLDER_AT, self._inc)
        self.held.add(held)
        arr = seg.lend(
            dtype, shape, offset, nbytes, return_slot, names, self._alive, task, inc, slot,
            held, self.held, ctl, watch, checked=True,
        )  # fmt: skip
        self.keep(seg, ident, task, inc, slot)
        return received(arr, dead)

    def _let_go(self, seg: Segment, ident: SlotIdent, kept: bool) -> None:
        if kept:
            self.forget(ident)
        else:
            seg.close()

    def unlink_held(self) -> None:
        """Unlink the ``held`` names of arrays still alive (their mappings stay: the
        callbacks that give them back do not run at exit)."""
        while True:
            try:
                held = list(self.held)  # a callback may discard meanwhile
                break
            except RuntimeError:  # pragma: no cover - changed size during the copy
                continue
        for name in held:
            self.held.discard(name)
            try:
                os.unlink(Names.path(name))
            except OSError:
                pass

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
