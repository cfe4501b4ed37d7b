"""Pool slots: a producer's reusable, pre-faulted segments, lent to a consumer and back.

Fresh tmpfs pages cost a fault, an allocation and a zeroing each (research/pitfalls.md §5),
so large messages go into slots the producer keeps mapped (``SlotPool``). Publishing renames
a slot to the message's name; the consumer (``SlotMaps``) renames it ``held`` while its
array lives and keeps it mapped for the next message (found again by inode), then
``give_back`` renames it ``returned`` and stores the ticket of its next lend in the slot's
control block, which the producer reads at its next acquire: the names stay the truth
whoever crashes. A holder's incarnation in the block lets a slot whose holder is gone be
taken back. Only the slot's own file (its inode) is ever taken back.

Thread model (docs/threads.md): ``SlotPool`` is thread-safe and never holds its lock across
a call that can block; ``SlotMaps`` runs under the consumer's lock; ``give_back`` runs
wherever an array is collected, maybe inside the garbage collector: it takes no lock.
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
from dataclasses import dataclass
from typing import Any

from .._errors import InternalError, RendezvousError, ResourceExhaustedError
from .._keys import DeviceName
from .._rendezvous import Received, received
from .._transport import PeerDirectory
from .._values import shape_problem
from .files import Segment, inode, move_noreplace, open_checked
from .header import FLAG_DEAD, Reader
from .naming import MAX_SLOT, SLOT_BITS, Names

__all__ = ["CONTROL", "DEFAULT_MAX_SLOTS", "HOLDER_AT", "WORD", "ProducerAlive", "RunWatch"]
__all__ += ["Slot", "SlotMaps", "SlotPool", "give_back", "run_alive"]

_log = logging.getLogger("shmrdv.shm.pool")

#: ``alive(task, incarnation)``: is that task's live worker of that incarnation?
ProducerAlive = Callable[[str, int], bool]


def run_alive(peers: PeerDirectory) -> ProducerAlive:
    """``ProducerAlive`` over the liveness monitor. Lock-free and never blocks (it may run
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
# The next lend's ticket is this much higher (naming.SLOT_BITS); the low bits, the index.
_NEXT = 1 << SLOT_BITS
_INDEX = _NEXT - 1


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
        seg = slot.segment
        try:
            seg.check_size(slot.capacity)
            holder = WORD.unpack_from(seg.buf, slot.capacity - CONTROL + HOLDER_AT)[0]
            if not holder or inode(held) != slot.ino:
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
        nxt = slot.ticket + _NEXT
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
        ino = inode(Names.path(ret))
        if ino is None:
            return False  # not given back (yet)
        if ino != slot.ino:
            self._refuse(Names.path(ret))  # not the file we created: never take it as ours
            return False
        self._freed_as(slot, slot.ticket + _NEXT, ret)
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
        ret = self._path(self._names.returned, slot.ticket)
        if inode(ret) == slot.ino:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ret)


# A consumer keeps at most as many mappings as a pool has slots. One that lent nothing for
# ``_IDLE_S`` is checked for its slot's existence, ``_SWEEP_MAX`` per sweep (a few stats).
_IDLE_S = 2.0
_SWEEP_MAX = 8

_Ident = tuple[int, int]  # a slot file's identity across renames: (st_dev, st_ino)


class RunWatch:
    """A consumer's word about one producer run, read by ``give_back`` without a lock: while
    ``live``, the consumer has that run's ring attached and will collect what the run leaves
    (``reaper.after_producer``). It is cleared before that collection lists anything and
    read after the rename: a rename that does not see it cleared came before the listing."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True


def give_back(
    names: Names,
    alive: ProducerAlive,
    producer_task: str,
    incarnation: int,
    slot: int,
    path: str,
    mem: mmap.mmap | None = None,
    watch: RunWatch | None = None,
    held: set[str] | None = None,
) -> None:
    """Rename the pool slot at ``path`` to its ``returned`` name, then store its next ticket
    in its control block (``mem``, after an ``fstat``: a truncated page is a SIGBUS). Takes
    no lock: it may run inside the garbage collector.

    A producer run that is over takes nothing back: the file is unlinked. Its ``close``
    unlinks its doorbell, then its ``returned`` names; we rename, then look for the doorbell
    and its live record: seeing both, our rename came first. Skipped while ``watch`` is live
    (the consumer collects what the run leaves)."""
    if held is not None:
        held.discard(os.path.basename(path))
    ret = names.path(names.returned(producer_task, incarnation, slot))
    try:
        move_noreplace(path, ret)
    except FileNotFoundError:
        return
    except OSError as e:
        _log.warning("cannot give pool slot %s back (%s); unlinking it", path, e)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    if mem is not None:
        try:
            end = len(mem)
            if end >= CONTROL and mem.size() >= end:
                WORD.pack_into(mem, end - CONTROL, slot + _NEXT)
        except (OSError, ValueError):
            pass  # its producer finds it under its name (``SlotPool._take_back``)
    if watch is not None and watch.live:
        return
    try:
        taken_back = os.path.lexists(names.bell_path(producer_task)) and alive(
            producer_task, incarnation
        )
    except Exception:  # a corrupt or foreign record: treat as gone
        taken_back = False
    if not taken_back:
        with contextlib.suppress(OSError):
            os.unlink(ret)


@dataclass(eq=False)
class _Kept:
    segment: Segment
    size: int
    task: str  # the producer run's task and incarnation
    incarnation: int
    slot: int  # the ticket of its last lend
    used_at: float


class SlotMaps:
    """The kept mappings of one consumer (see the module docstring)."""

    def __init__(self, names: Names, incarnation: int, alive: ProducerAlive) -> None:
        self._names = names
        self._inc = incarnation  # the consumer run: noted in the slots it holds
        self._alive = alive
        self._reader = Reader()
        #: ``held`` names of slots whose arrays are alive (``give_back`` discards each).
        self.held: set[str] = set()
        self._kept: OrderedDict[_Ident, _Kept] = OrderedDict()  # least recently used first
        # (producer task, incarnation, slot index) -> the kept mapping of that slot
        self._by_slot: dict[tuple[str, int, int], _Ident] = {}
        self.probes = self.hits = 0

    def __len__(self) -> int:
        return len(self._kept)

    def _used(self, ident: _Ident, kept: _Kept) -> Segment:
        kept.used_at = time.monotonic()
        self._kept.move_to_end(ident)
        self.hits += 1
        return kept.segment

    def _find(self, task: str, incarnation: int, ticket: int) -> tuple[Segment, _Ident] | None:
        ident = self._by_slot.get((task, incarnation, ticket & _INDEX))
        if ident is None:
            return None
        kept = self._kept.get(ident)
        if kept is None or kept.segment.closed:
            return None
        return self._used(ident, kept), ident

    def _open(self, name: str) -> tuple[Segment, _Ident, bool]:
        """Open segment ``name``: the segment, its identity, whether it is a kept mapping.
        Raises what ``Segment.attach`` raises."""
        fd, st = open_checked(self._names.path(name), os.O_RDWR, "segment")
        ident = (st.st_dev, st.st_ino)
        kept = self._kept.get(ident)
        if kept is not None:
            if kept.size == st.st_size and not kept.segment.closed:
                os.close(fd)
                kept.segment.name = name
                return self._used(ident, kept), ident, True
            self._drop(ident)  # resized: not the mapping to use any more
        return Segment.map_fd(self._names, name, fd, st), ident, False

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
        """Message ``seq`` of (step, key) of ``task``'s run ``inc``, from the segment of its
        name: None if there is none (yet), the error for a file not ours or not this
        message. The array is a writable view, the consumer's alone (the name unlinked, or a
        slot's renamed ``held``). A slot a notice names that is mapped already needs no open."""
        self.probes += 1
        names = self._names
        name = names.message(step, key, inc, seq)
        path = Names.path(name)
        found = self._find(task, inc, slot) if slot >= 0 and array is not None else None
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
                seg, ident, is_kept = self._open(name)
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
                self._let_go(seg, ident, is_kept)
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
                self._let_go(seg, ident, is_kept)
                return received(arr, dead)
        # A pool slot named ``held`` now, its size checked a moment ago: this run noted in
        # its control block, then an array of its own over the kept mapping.
        seg.name = held
        if offset + nbytes > seg.size:
            seg.unlink_quietly()
            self._drop(ident)
            return InternalError(
                f"pool slot {name} of {seg.size} bytes cannot hold {nbytes} bytes at {offset}"
            )
        mem = seg.buf
        ctl = mem if isinstance(mem, mmap.mmap) and offset + nbytes <= seg.size - CONTROL else None
        if ctl is not None and self._inc:
            WORD.pack_into(ctl, len(ctl) - CONTROL + HOLDER_AT, self._inc)
        self.held.add(held)
        arr = seg.lend(
            dtype, shape, offset, nbytes, give_back, names, self._alive, task, inc, slot,
            Names.path(held), ctl, watch, self.held, checked=True,
        )  # fmt: skip
        self._keep(seg, ident, task, inc, slot)
        return received(arr, dead)

    def _let_go(self, seg: Segment, ident: _Ident, kept: bool) -> None:
        if kept:
            self._drop(ident)
        else:
            seg.close()

    def unlink_held(self) -> None:
        """Unlink the ``held`` names of arrays still alive (at close: their callbacks do not
        run at exit)."""
        held = self.held
        while held:
            with contextlib.suppress(KeyError, OSError):  # (a callback may discard meanwhile)
                os.unlink(Names.path(held.pop()))

    def _keep(self, seg: Segment, ident: _Ident, task: str, incarnation: int, slot: int) -> None:
        kept = self._kept.get(ident)
        if kept is not None:
            kept.slot = slot
            return
        if len(self._kept) >= DEFAULT_MAX_SLOTS:
            idle = next((i for i, k in self._kept.items() if not k.segment.lent), None)
            if idle is None:
                seg.close()  # every kept mapping lends an array: this one is not kept
                return
            self._drop(idle)
        self._kept[ident] = _Kept(seg, seg.size, task, incarnation, slot, time.monotonic())
        self._by_slot[(task, incarnation, slot & _INDEX)] = ident

    def _drop(self, ident: _Ident) -> None:
        kept = self._kept.pop(ident, None)
        if kept is None:
            return
        at = (kept.task, kept.incarnation, kept.slot & _INDEX)
        if self._by_slot.get(at) == ident:
            del self._by_slot[at]
        kept.segment.close()  # unmapped now, or when its last lent array is collected

    def sweep(self) -> None:
        """Drop idle mappings whose slot is gone (a few ``stat`` calls; once per tick)."""
        now = time.monotonic()
        names, looked = self._names, 0
        for ident, kept in list(self._kept.items()):
            if looked >= _SWEEP_MAX:
                return
            if now - kept.used_at < _IDLE_S or kept.segment.lent:
                continue
            looked += 1
            kept.used_at = now
            task, inc, ticket = kept.task, kept.incarnation, kept.slot
            for name in (  # is one of the slot's names still this file?
                names.pool(task, inc, ticket + _NEXT),  # taken back: free under the next ticket
                names.returned(task, inc, ticket),
                names.held(task, inc, ticket),
            ):
                if inode(names.path(name)) == ident:
                    break
            else:
                self._drop(ident)

    def close(self) -> None:
        """Drop every kept mapping (arrays still lent keep theirs until collected)."""
        while self._kept:
            self._drop(next(iter(self._kept)))
