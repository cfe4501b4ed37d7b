"""A single-producer, single-consumer byte ring in shared memory, for small messages.

A segment per message costs a dozen system calls (create or reuse, rename, open, map,
rename again, unmap): far more than a small message's bytes. Small tensors therefore
travel inline in a ring that one producer worker keeps for one consumer worker: the
producer appends a record (the same header as a segment's, then the data) and advances
``head``; the consumer copies records out and advances ``tail``. No system call but the doorbell's post.

Layout (little endian), at the start of the mapping: magic (8 bytes), capacity (u64);
``head`` at byte 64 and ``tail`` at byte 128 (separate cache lines), both running byte
counts; ``lost`` at byte 160, how many records the producer could not append (ring full),
so that the consumer knows when to look for messages by name; ``read`` at byte 168, how
far the consumer has read; ``reader`` at byte 176, the incarnation of the consumer run
that reads the ring (its producer follows a restarted consumer's doorbell by it);
``spilled`` at byte 184, how many records not taken the consumer moved out of the ring
to messages of their own (``Recovery.spill``: also to be looked for by name); records
from byte 4096, each ``u32 length`` (of the whole record, 8-aligned) then the payload. A
record that would cross the end is preceded by a wrap mark (length ``0xFFFFFFFF``) and
starts again at the beginning.

``tail`` is where the oldest record the consumer has not *taken* (handed to a receive,
or freed) starts: the producer writes over nothing after it. Records are read (``read``)
as they arrive and may be taken out of order (one key's before another's); one taken
while an older one is not is marked so in its length word (``mark_taken``: bit 1, which
no 8-aligned length has), and a later reader skips it. So the consumer's next process,
after a crash, reads from ``tail`` exactly the records not taken yet. The consumer keeps
the positions of the records it read and has not taken (``hold``, ``taken``). A record left
untaken while the producer needs its room is moved out of the ring by its consumer
(published under its message's name, like a message the producer sent by name) and
counted in ``spilled``: ``tail`` then passes it.

Ordering: the producer writes a record's bytes before it stores ``head``; the consumer
loads ``head`` before it reads the bytes. Each is one aligned 8-byte store or load
(through a ``memoryview`` cast to ``Q``: ``struct.pack_into`` zeroes its target before
writing, so the other side could read ``head`` or ``tail`` as 0 in between), and
x86-64 keeps stores in order (TSO), so the consumer never reads a half-written record.
Weaker memory models need fences Python cannot issue: the transport uses rings only on
x86-64 (``RINGS_SUPPORTED``) and segments everywhere else.

Pure on a buffer: no files here (the producer creates, maps and names the segment).
A ring is not thread-safe on either side; each side's owner serialises its calls.
"""

from __future__ import annotations

import platform
import struct
from collections import deque
from collections.abc import Iterator, Sequence

from .._errors import InternalError

__all__ = ["DATA_OFFSET", "RINGS_SUPPORTED", "Ring", "describe", "ring_size"]

RINGS_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")

MAGIC = b"SHMRDVQ1"
_META = struct.Struct("<8sQ")
_U32 = struct.Struct("<I")
_HEAD, _TAIL = 64, 128
_LOST, _READ, _READER, _SPILLED = 160, 168, 176, 184
# Their indexes in the words view.
_H, _T, _L, _R, _C, _S = (w // 8 for w in (_HEAD, _TAIL, _LOST, _READ, _READER, _SPILLED))
# In a record's length word: taken by the consumer while an older record was not.
_TAKEN = 2
_META_AT = 192  # u32 length, then the owner's description (who writes to whom), JSON
_META_MAX = 3800
DATA_OFFSET = 4096
_WRAP = 0xFFFFFFFF
_ALIGN = 8
# A record's size from its payload's: ``(payload + _PAD) & _ROUND`` (the u32 length word,
# rounded up to ``_ALIGN``), in two operations.
_PAD, _ROUND = 4 + _ALIGN - 1, -_ALIGN
# A consumer's batch (``spans``) ends after about this many bytes of records: the producer
# gets the room back as the consumer goes, not only once a full ring is drained.
_BATCH_BYTES = 1 << 16


def ring_size(capacity: int) -> int:
    """Bytes of segment a ring of ``capacity`` data bytes needs."""
    return DATA_OFFSET + capacity


def describe(first: bytes | bytearray | memoryview) -> tuple[bytes, bool]:
    """From a ring's first ``DATA_OFFSET`` bytes (its words, no records): its owner's
    description (``Ring.meta``) and whether it holds records its consumer has not taken.
    Raises ``InternalError`` for bytes that are no ring's."""
    if len(first) < DATA_OFFSET or bytes(first[:8]) != MAGIC:
        raise InternalError("not a shmrdv ring")
    n = _U32.unpack_from(first, _META_AT)[0]
    if n > _META_MAX:
        raise InternalError(f"shmrdv ring corrupted: description of {n} bytes")
    head, tail = (
        struct.unpack_from("<Q", first, _HEAD)[0],
        struct.unpack_from("<Q", first, _TAIL)[0],
    )
    return bytes(first[_META_AT + 4 : _META_AT + 4 + n]), head != tail


class Ring:
    """A ring over ``buf`` (a writable buffer of ``ring_size(capacity)`` bytes)."""

    def __init__(self, buf: memoryview) -> None:
        if len(buf) < DATA_OFFSET:
            raise InternalError(f"not a shmrdv ring: {len(buf)} bytes")
        #: The whole ring: records are written into it between ``reserve`` and ``commit``.
        self.buf = buf
        self._words = buf[:DATA_OFFSET].cast("Q")
        # The records' u32 lengths, each at an 8-aligned offset: one store or load through
        # this view (a quarter of a ``struct`` call).
        self._u32 = buf[: len(buf) & ~3].cast("I")
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
        # The consumer's last batch (``spans``): where it started, where it ends, and
        # whether records may follow it; where the consumer reads next (``read``: from
        # ``tail``, what a new reader has not taken).
        self._from = self._to = 0
        self._more = False
        self._cursor = self._words[_T]
        #: The positions of the records read and not taken yet, oldest first (``hold``),
        #: and those among them taken out of order.
        self.held: deque[int] = deque()
        self._early: set[int] = set()
        #: How many records the producer could not append, and its consumer moved out, as
        #: of the last ``spans``: messages to look for by name.
        self.lost = 0
        self._end = DATA_OFFSET + capacity  # where the data ends in ``buf``

    @classmethod
    def format(cls, buf: memoryview, capacity: int, meta: bytes = b"") -> Ring:
        """Write a fresh, empty ring into ``buf`` (the producer, before anyone can see it).

        ``meta`` (at most 3800 bytes) says whose ring it is, for ``ls`` and for a consumer
        that finds the ring by listing.
        """
        if len(meta) > _META_MAX:
            raise InternalError(f"ring description of {len(meta)} bytes is too long")
        _META.pack_into(buf, 0, MAGIC, capacity)
        buf[_HEAD : _HEAD + 8] = bytes(8)
        buf[_TAIL : _TAIL + 8] = bytes(8)
        buf[_LOST : _SPILLED + 8] = bytes(_SPILLED + 8 - _LOST)
        _U32.pack_into(buf, _META_AT, len(meta))
        buf[_META_AT + 4 : _META_AT + 4 + len(meta)] = meta
        return cls(buf)

    def meta(self) -> bytes:
        """The owner's description written by ``format``."""
        n = _U32.unpack_from(self.buf, _META_AT)[0]
        if n > _META_MAX:
            raise InternalError(f"shmrdv ring corrupted: description of {n} bytes")
        return bytes(self.buf[_META_AT + 4 : _META_AT + 4 + n])

    def max_record(self) -> int:
        """The largest payload a record may carry (a quarter of the ring)."""
        return self._max_record

    # -- producer -----------------------------------------------------------------

    def reserve(self, payload: int) -> int:
        """Make room for a record of ``payload`` bytes; return where its payload goes in
        ``buf``, or -1 (nothing written) if it does not fit now. The record becomes visible
        at ``commit()``; until then the producer may write ``buf[at : at + payload]``."""
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
        """Whether the ring has room for records up to the running count ``end``: one
        read of ``tail``. ``reserve`` asks only when the last ``tail`` read leaves no room:
        ``tail`` (the consumer's) only grows, so that one bounds it from below."""
        tail = self._tail_seen = self._words[_T]
        return end - tail <= self.capacity

    def commit(self) -> int:
        """Publish the record ``reserve`` made room for: one 8-byte store of ``head``, after
        every byte of the record (see the module docstring). Returns the new ``head``."""
        head = self._words[_H] = self._next_head
        return head

    def try_put(self, parts: Sequence[bytes | memoryview]) -> bool:
        """Append one record made of ``parts``; False (nothing written) if it does not fit now."""
        at = self.reserve(sum(len(p) for p in parts))
        if at < 0:
            return False
        buf = self.buf
        for p in parts:
            n = len(p)
            buf[at : at + n] = p
            at += n
        self.commit()
        return True

    def count_lost(self) -> None:
        """Producer: a record could not be appended (the consumer looks by name then)."""
        self._words[_L] += 1

    @property
    def reader(self) -> int:
        """The incarnation of the consumer run that reads the ring (0: none yet)."""
        return int(self._words[_C])

    def reader_word(self) -> memoryview:
        """``reader`` as a view of one u64 (``view[0]``): a producer's look per message
        without a call. The caller releases it before the ring (``release``)."""
        return self._words[_C : _C + 1]

    # -- consumer -----------------------------------------------------------------

    def pending(self) -> bool:
        """Records its consumer has not taken are in the ring (``head`` is ahead of
        ``tail``)."""
        words = self._words
        return bool(words[_H] != words[_T])

    def unread(self) -> bool:
        """Records its consumer has not read are in the ring (``head`` is ahead of
        ``read``)."""
        words = self._words
        return bool(words[_H] != words[_R])

    def attach(self, reader: int) -> None:
        """The consumer run ``reader`` (its incarnation) reads the ring from now on, from
        the oldest record not taken (``tail``)."""
        words = self._words
        self._cursor = words[_R] = words[_T]
        words[_C] = reader

    @property
    def head(self) -> int:
        """Bytes appended so far (a running count; the end of the last record published)."""
        return int(self._words[_H])

    @property
    def tail(self) -> int:
        """Where the oldest record its consumer has not taken starts (a running count): the
        producer may write over everything before it."""
        return int(self._words[_T])

    def release(self) -> None:
        """Let go of the buffer (so that its mapping can be closed)."""
        self._words.release()
        self._u32.release()
        self.buf.release()

    def take(self) -> Iterator[memoryview]:
        """Yield every complete record's payload (a view valid until the next iteration):
        ``spans`` as views of ``buf``, each record taken once the caller comes back for the
        next one."""
        buf = self.buf
        while True:
            spans = self.spans()
            if not spans:
                return
            first = True
            for at, end in spans:
                if not first:
                    self.consume(at)  # the records before this one are passed
                first = False
                yield buf[at:end]
            if not self.consume():
                return

    def spans(self) -> list[tuple[int, int]]:
        """Where the next complete records' payloads are in ``buf``, ``(start, end)`` each:
        the consumer's hot loop, one call for a batch of records.

        Records taken before (``mark_taken``) are skipped. None is taken until ``consume``
        (a record is never overwritten while it is read).
        A batch ends at ``head``, or after about ``_BATCH_BYTES`` of records in a run (the
        producer gets room back batch by batch), or before a length that is no record's:
        the next call then raises ``InternalError`` (a corrupted ring: a length past the
        data written), the records before it returned first. Also reads ``lost``, after
        ``head``: a record lost before one of the batch is counted in it.
        """
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
            # The records of this run end at ``head`` or at the ring's end (a record never
            # crosses it: a wrap mark precedes it); none starts past the batch's bytes.
            # (Conditionals: ``min`` is a call.)
            run = at + head - tail
            if run > self._end:
                run = self._end
            stop = at + _BATCH_BYTES
            if stop > run:
                stop = run
            # (``at`` is 8-aligned: ``tail`` only ever advances by aligned sizes; a wrap
            # mark, 0xFFFFFFFF, is odd: one test tells it and a bad length from a record.
            # ``at < stop`` here: the loop runs at least once.)
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
        """Whether the last ``spans`` read past records (some taken before, and skipped),
        also when it found none to return: ``consume`` then records that."""
        return bool(self._to != self._from)

    def consume(self, before: int = -1) -> bool:
        """Pass the records the last ``spans`` found; with ``before``, only those before the
        record whose payload starts at ``before`` (a consumer that failed on that record: it
        is found again next time). They are taken too (the producer may write over them
        from now on), but those ``hold`` kept: ``tail`` stays at the oldest of them.
        Returns whether more records may follow that batch (then ``spans`` again)."""
        tail = self._to if before < 0 else self.position(before)
        words = self._words
        self._cursor = words[_R] = tail
        held = self.held
        words[_T] = held[0] if held else tail
        return self._more

    def position(self, at: int) -> int:
        """The running byte count at which the record whose payload starts at ``at`` (one
        of the last ``spans``) begins: what ``tail`` is set to for it to be the oldest one
        not taken (``hold``, ``mark_taken``)."""
        # Positions grow within a run; the run after a wrap starts at DATA_OFFSET and
        # ends before the first run's start (``head`` is at most ``tail + capacity``).
        cap, start = self.capacity, self._from
        pos, at = start % cap, at - 4 - DATA_OFFSET
        return start + (at - pos if at >= pos else cap - pos + at)

    def hold(self, at: int) -> int:
        """The record whose payload starts at ``at`` (one of the last ``spans``) is not
        taken yet: ``tail`` stays before it until ``taken``. Returns its ``position``."""
        position = self.position(at)
        self.held.append(position)
        return position

    def taken(self, position: int) -> None:
        """The held record at ``position`` is taken: ``tail`` passes it and the taken ones
        after it if it is the oldest held, else it is marked taken (``mark_taken``)."""
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
        """The payload of the record at ``position`` (read, not taken: its bytes stay)."""
        at = DATA_OFFSET + position % self.capacity
        return self.buf[at + 4 : at + (self._u32[at >> 2] & ~7)]

    def add_spilled(self, count: int) -> None:
        """The consumer moved ``count`` more records out of the ring (see the module
        docstring): its next reader looks for messages by name too."""
        self._words[_S] += count

    def mark_taken(self, position: int) -> None:
        """The record at ``position`` is taken while an older one is not (``tail`` stays
        before it): a later reader of the ring skips it."""
        self._u32[(DATA_OFFSET + position % self.capacity) >> 2] |= _TAKEN

    @property
    def read(self) -> int:
        """Where the consumer reads next (a running byte count)."""
        return int(self._cursor)
