"""A producer's pool of reusable, pre-faulted shared-memory slots.

Fresh tmpfs pages cost a fault, an allocation and a zeroing each: writing a new
segment runs at ~2 GB/s here against 7–14 GB/s for pages already faulted
(research/pitfalls.md §5). So a producer writes into slots it keeps: a slot is a
segment file the producer created, fallocated and keeps mapped. A send renames the
slot to the message's name (it then belongs to the consumer); the consumer renames it
to ``held`` while its array lives and to ``returned`` when the array is collected; the
producer renames ``returned`` back to a free ``pool`` name and writes into the same,
already faulted, pages again. Nothing but renames crosses the processes.

Size classes are powers of two from 4 KiB, so a slot serves messages between half and
all of its size; the pool holds at most ``limit_bytes`` of slots.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field

from .naming import Names
from .segment import Segment

__all__ = ["Slot", "SlotPool"]

_log = logging.getLogger("shmrdv.shm.pool")

_MIN_CLASS = 4096
# A lent slot is checked for its return at most this many times per acquire, oldest first.
_RECLAIM_SCAN = 32


def size_class(nbytes: int) -> int:
    """The slot size serving a segment of ``nbytes``: the next power of two, >= 4 KiB."""
    n = max(nbytes, _MIN_CLASS)
    return 1 << (n - 1).bit_length()


@dataclass(eq=False)
class Slot:
    """One pool slot: its index, its mapping in the producer, its state."""

    index: int
    capacity: int
    segment: Segment
    state: str = "free"  # free | allocated | lent
    lent_key: str = field(default="")


class SlotPool:
    """The producer side of the slot protocol. Thread-safe."""

    def __init__(self, names: Names, incarnation: int, limit_bytes: int) -> None:
        self._names = names
        self._incarnation = incarnation
        self._limit = limit_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[Slot]] = {}  # size class -> free slots
        self._lent: deque[Slot] = deque()
        self._slots: dict[int, Slot] = {}
        self._next_index = 0
        self._bytes = 0
        self._closed = False
        self.reused = 0
        self.created = 0

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
            }

    def acquire(self, nbytes: int) -> Slot | None:
        """A free slot for a segment of ``nbytes`` (its state becomes ``allocated``), or None.

        None means the pool cannot serve it (too big for the limit, or full of lent
        slots): the caller writes a one-off segment instead.
        """
        cls = size_class(nbytes)
        if self._limit <= 0 or cls > self._limit:
            return None
        with self._lock:
            if self._closed:
                return None
            slot = self._take_free(cls)
            if slot is None:
                self._reclaim()
                slot = self._take_free(cls)
            if slot is not None:
                self.reused += 1
                return slot
            while self._bytes + cls > self._limit and self._evict_one(cls):
                pass
            if self._bytes + cls > self._limit:
                return None
            index = self._next_index
            self._next_index += 1
            self._bytes += cls  # reserve before leaving the lock
        try:
            seg = Segment.create(self._names, cls, self._names.pool(self._incarnation, index))
        except BaseException:
            with self._lock:
                self._bytes -= cls
            raise
        slot = Slot(index=index, capacity=cls, segment=seg, state="allocated")
        with self._lock:
            self._slots[index] = slot
            self.created += 1
        return slot

    def _take_free(self, cls: int) -> Slot | None:
        free = self._free.get(cls)
        if free:
            slot = free.pop()
            slot.state = "allocated"
            return slot
        return None

    def _reclaim(self) -> None:
        """Take back slots their consumers have returned (``r`` name -> ``p`` name)."""
        for _ in range(min(len(self._lent), _RECLAIM_SCAN)):
            slot = self._lent.popleft()
            ret = self._names.returned(self._incarnation, slot.index)
            try:
                os.rename(self._names.path(ret), self._names.path(self._names.pool(self._incarnation, slot.index)))
            except FileNotFoundError:
                self._lent.append(slot)  # still with its consumer
                continue
            slot.segment.name = self._names.pool(self._incarnation, slot.index)
            slot.state = "free"
            self._free.setdefault(slot.capacity, []).append(slot)

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
        self._bytes -= slot.capacity
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

    def lend(self, slot: Slot, key: str) -> None:
        """Record that ``slot`` was published (renamed away): the consumer has it now."""
        with self._lock:
            slot.state = "lent"
            slot.lent_key = key
            self._lent.append(slot)

    def close(self) -> None:
        """Unlink free slots and those already returned; lent ones belong to their consumers.

        Consumers returning a slot after this see the producer gone and unlink it
        themselves (``transport._return_slot``).
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
                os.unlink(self._names.path(self._names.returned(self._incarnation, slot.index)))
            except FileNotFoundError:
                pass
            slot.segment.close()
