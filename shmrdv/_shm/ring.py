"""A single-producer, single-consumer byte ring in shared memory, for small messages.

A segment costs a dozen system calls, far more than a small tensor's bytes: a producer
worker appends records (the segment header, then the data) to a ring per consumer worker.
``tail`` is the start of the oldest record not *taken* (handed to a receive, or freed): the
producer writes over nothing after it. A record taken before an older one is marked, so
the consumer's next process, after a crash, reads exactly the records not taken.
Ordering: the producer writes a record, then stores ``head``; the consumer loads ``head``,
then reads. Each is one aligned 8-byte store or load through a ``memoryview`` cast to ``Q``
(``struct.pack_into`` zeroes its target first), and x86-64 keeps stores in order (TSO);
weaker memory models need fences Python cannot issue, so rings are used on x86-64 only.
Pure on a buffer. Not thread-safe: each side's owner serialises its calls.
"""

from __future__ import annotations

import platform
import struct
from collections import deque
from collections.abc import Iterator

from .._errors import InternalError

__all__ = ["DATA_OFFSET", "RINGS_SUPPORTED", "Ring", "describe", "ring_size"]

RINGS_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")

# The layout, little endian: the magic and the capacity (u64), then words of 8 bytes:
MAGIC = b"SHMRDVQ1"
_META = struct.Struct("<8sQ")
_U32 = struct.Struct("<I")
_HEAD, _TAIL = 64, 128  # running byte counts, on cache lines of their own
_LOST = 160  # records the producer could not append (full): to look for by name
_READ = 168  # how far the consumer has read
_READER = 176  # the incarnation of the consumer run reading it (its producer follows it)
_SPILLED = 184  # records not taken the consumer moved out: to look for by name too
_META_AT = 192  # u32 length, then the owner's description (who writes to whom), JSON
_META_MAX = 3800
# Records from here: a u32 length (of the whole record, 8-aligned), then the payload. One
# that would cross the end starts at the beginning, after a wrap mark (that length).
DATA_OFFSET = 4096
_WRAP = 0xFFFFFFFF
_TAKEN = 2  # in a length word: taken while an older record was not
# Their indexes in the words view.
_H, _T, _L, _R, _C, _S = (w // 8 for w in (_HEAD, _TAIL, _LOST, _READ, _READER, _SPILLED))
_ALIGN = 8
# A record's size from its payload's: ``(payload + _PAD) & _ROUND`` (with the length word).
_PAD, _ROUND = 4 + _ALIGN - 1, -_ALIGN
# A consumer's batch (``spans``) ends after about this many bytes: the producer gets room
# back as the consumer goes, not only once a full ring is drained.
_BATCH_BYTES = 1 << 14


def ring_size(capacity: int) -> int:
    """Bytes of segment a ring of ``capacity`` data bytes needs."""
    return DATA_OFFSET + capacity


def describe(first: bytes | bytearray | memoryview) -> tuple[bytes, bool]:
    """From a ring's first ``DATA_OFFSET`` bytes: its owner's description and whether it
    holds records not taken. Raises ``InternalError`` for bytes that are no ring's."""
    if len(first) < DATA_OFFSET or bytes(first[:8]) != MAGIC:
        raise InternalError("not a shmrdv ring")
    n = _U32.unpack_from(first, _META_AT)[0]
    if n > _META_MAX:
        raise InternalError(f"shmrdv ring corrupted: description of {n} bytes")
    words = struct.unpack_from("<Q", first, _HEAD) + struct.unpack_from("<Q", first, _TAIL)
    return bytes(first[_META_AT + 4 : _META_AT + 4 + n]), words[0] != words[1]


class Ring:
    """A ring over ``buf`` (a writable buffer of ``ring_size(capacity)`` bytes)."""

    def __init__(self, buf: memoryview) -> None:
        if len(buf) < DATA_OFFSET:
            raise InternalError(f"not a shmrdv ring: {len(buf)} bytes")
        self.buf = buf
        self._words = buf[:DATA_OFFSET].cast("Q")
        self._u32 = buf[: len(buf) & ~3].cast("I")  # the length words: cheaper than ``struct``
        magic, capacity = _META.unpack_from(buf, 0)
        if (
            magic != MAGIC
            or capacity <= 0
            or capacity % _ALIGN
            or DATA_OFFSET + capacity > len(buf)
        ):
            self._words.release()
            self._u32.release()
            raise InternalError(
                f"not a shmrdv ring: magic {magic!r}, capacity {capacity} in {len(buf)} bytes"
            )
        self.capacity: int = capacity
        self._max_record: int = capacity // 4 - 8
        self._next_head = 0
        self._tail_seen = 0  # the producer's last read of ``tail`` (``_room``)
        # The consumer's last batch (``spans``): from, to, and whether more may follow it.
        self._from = self._to = 0
        self._more = False
        self._cursor = self._words[_T]  # where the consumer reads next (``read``)
        self.held: deque[int] = deque()  # records read, not taken, oldest first (``hold``)
        self._early: set[int] = set()  # those of them taken out of order
        #: Records lost and spilled as of the last ``spans``: messages to look for by name.
        self.lost = 0
        self._end = DATA_OFFSET + capacity

    @classmethod
    def format(cls, buf: memoryview, capacity: int, meta: bytes = b"") -> Ring:
        """Write a fresh, empty ring into ``buf`` (before anyone can see it); ``meta`` says
        whose it is (for ``ls`` and a consumer that lists rings)."""
        if len(meta) > _META_MAX:
            raise InternalError(f"ring description of {len(meta)} bytes is too long")
        buf[:DATA_OFFSET] = bytes(DATA_OFFSET)
        _META.pack_into(buf, 0, MAGIC, capacity)
        _U32.pack_into(buf, _META_AT, len(meta))
        buf[_META_AT + 4 : _META_AT + 4 + len(meta)] = meta
        return cls(buf)

    def meta(self) -> bytes:
        return describe(self.buf[:DATA_OFFSET])[0]

    def reserve(self, payload: int) -> int:
        """Where a record of ``payload`` bytes (at most a quarter of the ring) goes in ``buf``,
        visible at ``commit``; -1 (nothing written) if it does not fit now."""
        if payload > self._max_record:
            return -1
        size = (payload + _PAD) & _ROUND  # the length word, 8-aligned
        words, cap = self._words, self.capacity
        head = words[_H]
        pos = head % cap
        if pos + size > cap:  # it would cross the end: a wrap mark, then from the start
            pad = cap - pos
            if not self._room(head + pad + size):
                return -1
            self._u32[(DATA_OFFSET + pos) >> 2] = _WRAP
            head += pad
            pos = 0
        elif head + size - self._tail_seen > cap and not self._room(head + size):
            return -1
        at = DATA_OFFSET + pos
        self._u32[at >> 2] = size
        self._next_head = head + size
        return at + 4

    def _room(self, end: int) -> bool:
        """Room for records up to the running count ``end``? (``tail`` only grows: it is
        read again only when the last read leaves no room.)"""
        tail = self._tail_seen = self._words[_T]
        return end - tail <= self.capacity

    def commit(self) -> int:
        """Publish the reserved record (one store of ``head``); the new ``head``."""
        head = self._words[_H] = self._next_head
        return head

    def count_lost(self) -> None:
        """A record could not be appended: the consumer looks for it by name."""
        self._words[_L] += 1

    def reader_word(self) -> memoryview:
        """The ``reader`` word as a one-u64 view (released by the caller before the ring)."""
        return self._words[_C : _C + 1]

    def pending(self) -> bool:
        """Whether records not taken are in the ring."""
        words = self._words
        return bool(words[_H] != words[_T])

    def attach(self, reader: int) -> None:
        """The consumer run of incarnation ``reader`` reads from ``tail`` on."""
        words = self._words
        self._cursor = words[_R] = words[_T]
        words[_C] = reader

    @property
    def tail(self) -> int:
        """The start of the oldest record not taken, a running byte count."""
        return int(self._words[_T])

    def release(self) -> None:
        self._words.release()
        self._u32.release()
        self.buf.release()

    def take(self) -> Iterator[memoryview]:
        """Every record's payload (a view valid until the next), each taken as the next is
        asked for."""
        while spans := self.spans():
            for i, (at, end) in enumerate(spans):
                if i:
                    self.consume(at)  # the records before this one are passed
                yield self.buf[at:end]
            if not self.consume():
                return

    def spans(self) -> list[tuple[int, int]]:
        """The next batch of records' payloads, ``(start, end)`` in ``buf`` each, skipping
        those taken before; none is taken until ``consume``. A batch ends at ``head``, after
        about ``_BATCH_BYTES`` or before a bad length (the next call raises ``InternalError``).
        ``lost`` is read after ``head``: a record lost before one of the batch is counted."""
        words = self._words
        head = words[_H]
        self.lost = words[_L] + words[_S]
        tail = self._from = self._cursor
        cap = self.capacity
        if not tail <= head <= words[_T] + cap or tail % _ALIGN:
            raise InternalError(f"shmrdv ring corrupted: head {head}, tail {tail}, capacity {cap}")
        out: list[tuple[int, int]] = []
        add = out.append
        u32 = self._u32
        more = False
        while tail < head:
            at = start = DATA_OFFSET + tail % cap
            # This run ends at ``head`` or the ring's end (``min`` would be a call).
            run = at + head - tail
            if run > self._end:
                run = self._end
            stop = at + _BATCH_BYTES
            if stop > run:
                stop = run
            # A wrap mark (odd) and a bad length fail the same test.
            while at < stop:
                size = u32[at >> 2]
                end = at + size
                if size & 7 or not size or end > run:
                    if size & 7 == _TAKEN and at < end - _TAKEN <= run:
                        at = end - _TAKEN  # taken by an earlier run of the consumer
                        continue
                    break
                add((at + 4, end))
                at = end
            tail += at - start
            if at < run:
                if at >= stop:  # the batch is full
                    if not out:
                        continue  # of records taken before: read on
                    more = True
                    break
                if size == _WRAP:  # the next record is at the start
                    tail += self._end - at
                    continue
                if out:  # a length that is no record's: the records before it first
                    more = True
                    break
                raise InternalError(
                    f"shmrdv ring corrupted: record of {size} bytes at {tail} (head {head})"
                )
        self._to = tail
        self._more = more
        return out

    @property
    def passed(self) -> bool:
        """Whether the last ``spans`` passed records taken before (for ``consume`` to record)."""
        return bool(self._to != self._from)

    def consume(self, before: int = -1) -> bool:
        """Take the records of the last ``spans`` (those before the payload at ``before``, if
        given) but those ``hold`` kept, where ``tail`` stays; whether more may follow."""
        tail = self._to if before < 0 else self.position(before)
        words = self._words
        self._cursor = words[_R] = tail
        held = self.held
        words[_T] = held[0] if held else tail
        return self._more

    def position(self, at: int) -> int:
        """The running byte count where the record of the payload at ``at`` (of the last
        ``spans``) starts."""
        # The run after a wrap starts at DATA_OFFSET and ends before the first run's start.
        cap, start = self.capacity, self._from
        pos, at = start % cap, at - 4 - DATA_OFFSET
        return start + (at - pos if at >= pos else cap - pos + at)

    def hold(self, at: int) -> int:
        """Keep ``tail`` before the record of the payload at ``at`` until ``taken``; its
        ``position``."""
        position = self.position(at)
        self.held.append(position)
        return position

    def taken(self, position: int) -> None:
        """The held record at ``position`` is taken: ``tail`` passes it (and taken ones after
        it) if it is the oldest held, else it is marked taken."""
        held = self.held
        if held[0] != position:
            self._early.add(position)
            self.mark_taken(position)
            return
        held.popleft()
        early = self._early
        while held and held[0] in early:
            early.discard(held.popleft())
        self._words[_T] = held[0] if held else self._cursor

    def record(self, position: int) -> memoryview:
        """The payload of the record at ``position``."""
        at = DATA_OFFSET + position % self.capacity
        return self.buf[at + 4 : at + (self._u32[at >> 2] & ~7)]

    def add_spilled(self, count: int) -> None:
        """The consumer moved ``count`` more records out, to be found by name."""
        self._words[_S] += count

    def mark_taken(self, position: int) -> None:
        """Mark the record at ``position`` taken while an older one is not (a later reader
        skips it)."""
        self._u32[(DATA_OFFSET + position % self.capacity) >> 2] |= _TAKEN

    @property
    def read(self) -> int:
        """Where the consumer reads next, a running byte count."""
        return int(self._cursor)
