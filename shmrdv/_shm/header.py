"""The message header: a pure byte format at the start of every segment and ring record.

No I/O (STYLE.md rule 3): one writer, ``Template.write``, and one checked reader,
``Reader.read`` (``unpack_fields`` behind its cache). A message is the header, padding up to
``data_offset`` (a multiple of 64, for numpy and SIMD), then ``nbytes`` of array data in C
order. Little endian, no padding::

    magic 8s | version u16 | flags u16 | header_len u32 | data_offset u64 | nbytes u64
    step_id i64 | seq u64 | producer_incarnation u64 | producer_pid u32 | slot i64
    created_ns u64 | ndim u32 | dtype_len u32 | key_len u32          (the fixed prefix)
    shape: ndim x u64 | dtype descriptor: dtype_len bytes | key: key_len bytes (UTF-8)

``flags``: bit 0 ``is_dead``, bit 1 ``FLAG_NOTICE`` (a ring record whose data is in the
segment published under the message's name). The dtype descriptor is
``_values.encode_dtype``'s; ``slot`` the producer's pool slot ticket, or -1. A header is
hostile input: garbage gives ``InternalError("segment header corrupted: <field> ...")``,
never another exception or a large allocation.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import InternalError, InvalidArgumentError
from .._values import MAX_DTYPE_BYTES, decode_dtype, encode_dtype, shape_problem

__all__ = ["FLAG_DEAD", "FLAG_NOTICE", "MAGIC", "MAX_KEY_BYTES", "PREFIX", "Header", "Reader"]
__all__ += ["Template", "created_ns", "is_notice", "unpack", "unpack_identity"]

BufferLike = bytes | bytearray | memoryview | mmap.mmap

# The non-ASCII first byte and the newline catch text mangling, as PNG's signature does;
# a fresh, all-zero file never matches.
MAGIC = b"\x89SHMRDV\n"
VERSION = 1
ALIGNMENT = 64  # a cache line; AVX-512 loads
MAX_NDIM = 64  # numpy's NPY_MAXDIMS since 2.0
MAX_KEY_BYTES = 1 << 20  # so that a corrupted header never makes us allocate much

PREFIX = struct.Struct("<8sHHIQQqQQIqQIII")
FLAG_DEAD = 1
FLAG_NOTICE = 2
_KNOWN_FLAGS = FLAG_DEAD | FLAG_NOTICE
# Where the bytes that depend on neither the key nor the message start (ndim onwards).
_STATIC_AT = 76
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
_LEAD = MAGIC + struct.pack("<H", VERSION)
_SIZES = struct.Struct("<IQQ")  # header_len, data_offset, nbytes
# The fixed prefix with the magic as an integer (cheaper to compare than bytes).
_FIXED = struct.Struct("<QHHIQQqQQIqQIII")
_MAGIC_U64 = int.from_bytes(MAGIC, "little")
_NO_BOUND = 1 << 63  # a notice's data is in a segment, checked when that is opened
_MAX_HEADER = PREFIX.size + 8 * MAX_NDIM + MAX_DTYPE_BYTES + MAX_KEY_BYTES
_MAX_INTP = 2**63 - 1  # numpy refuses arrays of more bytes

#: What ``unpack_fields`` and ``Reader.read`` return: flags, dtype, shape, data_offset,
#: nbytes, step_id, seq, producer_incarnation, producer_pid, slot, created_ns, key.
Fields = tuple[int, np.dtype[Any], tuple[int, ...], int, int, int, int, int, int, int, int, str]


def _corrupted(what: str) -> InternalError:
    return InternalError(f"segment header corrupted: {what}")


class Template:
    """The header of every message of one (dtype, shape, key length), packed once: ``write``
    is one ``struct`` call. Raises ``InvalidArgumentError`` for an object dtype, too many
    dimensions or too long a key."""

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int, ...], key_len: int) -> None:
        if dtype.hasobject:
            raise InvalidArgumentError(f"dtype {dtype} holds Python objects: they cannot be shared")
        if key_len > MAX_KEY_BYTES:
            raise InvalidArgumentError(f"rendezvous key of {key_len} bytes is too long")
        shape = tuple(int(d) for d in shape)
        if len(shape) > MAX_NDIM:
            raise InvalidArgumentError(f"an array of {len(shape)} dimensions: at most {MAX_NDIM}")
        raw_dtype = encode_dtype(dtype)
        end = self.header_len = PREFIX.size + 8 * len(shape) + len(raw_dtype) + key_len
        self.shape = shape
        self.data_offset = -(-end // ALIGNMENT) * ALIGNMENT
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.segment_size = self.data_offset + self.nbytes
        self._sizes = _SIZES.pack(end, self.data_offset, self.nbytes)
        self._static = (
            struct.pack("<III", len(shape), len(raw_dtype), key_len)
            + _SHAPES[len(shape)].pack(*shape)
            + raw_dtype
        )
        head = f"<10sH20sqQQIqQ{len(self._static)}s{key_len}s{self.data_offset - end}x"
        self._head = struct.Struct(head).pack_into
        self._record = struct.Struct(f"{head}{self.nbytes}s").pack_into

    def write(
        self,
        buf: bytearray | memoryview | mmap.mmap,
        at: int,
        key: bytes,
        flags: int,
        step_id: int,
        seq: int,
        incarnation: int,
        pid: int,
        slot: int,
        created_ns: int,
        data: bytes | None = None,
    ) -> None:
        """Write a message's header (``data_offset`` bytes, UTF-8 ``key``) at ``buf[at:]``;
        with ``data``, the data after it (a ring record). Raises ``InternalError`` if a field
        is out of its range."""
        try:
            if data is None:
                self._head(
                    buf, at, _LEAD, flags, self._sizes, step_id, seq, incarnation, pid, slot,
                    created_ns, self._static, key,
                )  # fmt: skip
            else:
                self._record(
                    buf, at, _LEAD, flags, self._sizes, step_id, seq, incarnation, pid, slot,
                    created_ns, self._static, key, data,
                )  # fmt: skip
        except struct.error as e:
            raise InternalError(
                f"cannot pack segment header: a field is out of range (step {step_id}, "
                f"seq {seq}, slot {slot}): {e}"
            ) from e


@dataclass(frozen=True, slots=True)
class Header:
    """A segment's header, unpacked (``unpack``): the array's dtype and shape, where its
    bytes are, whose it is. ``created_ns`` is ``time.time_ns()`` at the send."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    is_dead: bool
    data_offset: int
    nbytes: int
    step_id: int
    seq: int
    producer_incarnation: int
    producer_pid: int
    slot: int
    created_ns: int
    key: str

    @property
    def segment_size(self) -> int:
        return self.data_offset + self.nbytes


def unpack_fields(buf: BufferLike, file_size: int) -> Fields:
    """The header at the start of ``buf`` of a message whose data must end within
    ``file_size`` bytes, every field checked, each byte read once (a peer may be changing
    it). Raises ``InternalError`` naming the field, and nothing else; allocates at most the
    declared header, itself bounded by ``buf``."""
    limit = min(len(buf), file_size)
    if limit < PREFIX.size:
        raise _corrupted(f"only {limit} bytes, the fixed header needs {PREFIX.size}")
    (magic, version, flags, size, data_offset, nbytes, step_id, seq, incarnation, pid, slot,
     created_ns, ndim, dtype_len, key_len) = PREFIX.unpack_from(buf, 0)  # fmt: skip
    if magic != MAGIC:
        raise _corrupted(f"magic {magic!r}, expected {MAGIC!r} (not a shmrdv segment)")
    if version != VERSION:
        raise _corrupted(f"version {version}, this shmrdv reads version {VERSION}")
    if flags & ~_KNOWN_FLAGS:
        raise _corrupted(f"unknown flags 0x{flags:04x}")
    if ndim > MAX_NDIM:
        raise _corrupted(f"ndim {ndim} > {MAX_NDIM}")
    if dtype_len > MAX_DTYPE_BYTES or key_len > MAX_KEY_BYTES:
        raise _corrupted(f"dtype length {dtype_len} or key length {key_len} too large")
    dtype_at = PREFIX.size + 8 * ndim
    key_at = dtype_at + dtype_len
    end = key_at + key_len
    if size != end:
        raise _corrupted(f"header length {size} but its fields take {end} bytes")
    if end > limit:
        raise _corrupted(f"header length {end} past the end of the segment ({limit} bytes)")
    if data_offset < end or data_offset % ALIGNMENT:
        raise _corrupted(f"data offset {data_offset} (header ends at {end}, alignment {ALIGNMENT})")
    if data_offset + nbytes > file_size:
        raise _corrupted(
            f"data offset {data_offset} + nbytes {nbytes} past the end of the file ({file_size})"
        )
    if slot < -1:
        raise _corrupted(f"slot {slot}")
    shape = _SHAPES[ndim].unpack_from(buf, PREFIX.size)
    dtype = decode_dtype(bytes(buf[dtype_at:key_at]))
    # The element count is bounded whatever the item size (a |V0 shape of 2**62 has nbytes 0).
    problem = shape_problem(shape, dtype.itemsize)
    if problem is not None:
        raise _corrupted(f"{problem} ({dtype})")
    if math.prod(d or 1 for d in shape) * dtype.itemsize > _MAX_INTP:  # as numpy counts
        raise _corrupted(f"shape {shape} of {dtype} is larger than numpy allows")
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise _corrupted(f"nbytes {nbytes} but shape {shape} of {dtype} needs other")
    try:
        key = bytes(buf[key_at:end]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _corrupted(f"key is not UTF-8 ({e})") from e
    return (flags, dtype, shape, data_offset, nbytes, step_id, seq, incarnation, pid, slot,
            created_ns, key)  # fmt: skip


def unpack(buf: BufferLike, file_size: int) -> Header:
    """The checked header at the start of ``buf`` as a ``Header`` (see ``unpack_fields``)."""
    f = unpack_fields(buf, file_size)
    return Header(f[1], f[2], bool(f[0] & FLAG_DEAD), *f[3:])


class Reader:
    """``unpack_fields`` with one cache, by the bytes that depend on neither the key nor the
    message (ndim, lengths, shape, dtype): a header whose such bytes were seen skips only the
    dtype and shape checks, so a new key costs what a known one does and adds no entry.
    Bounded (emptied when full); not thread-safe."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        # static bytes -> header length, data offset, nbytes, dtype, shape
        self._known: dict[bytes, tuple[int, int, int, np.dtype[Any], tuple[int, ...]]] = {}

    def read(self, buf: BufferLike, at: int, end: int, record: bool = True) -> Fields:
        """The checked header of the message ``buf[at:end]``, a ring record (``record``: its
        data within it, unless a notice's) or a segment. Raises as ``unpack_fields``."""
        n = end - at
        if n >= PREFIX.size and end <= len(buf):
            (magic, version, flags, size, off, nbytes, step, seq, inc, pid, slot, created,
             _, _, key_len) = _FIXED.unpack_from(buf, at)  # fmt: skip
            key_at = size - key_len
            bound = _NO_BOUND if record and flags & FLAG_NOTICE else n
            if (
                magic == _MAGIC_U64
                and version == VERSION
                and not flags & ~_KNOWN_FLAGS
                and slot >= -1
                and PREFIX.size <= key_at
                and size <= n
                and off + nbytes <= bound
            ):
                known = self._known.get(bytes(buf[at + _STATIC_AT : at + key_at]))
                if (
                    known is not None
                    and known[0] == size
                    and known[1] == off
                    and known[2] == nbytes
                ):
                    try:
                        key = str(buf[at + key_at : at + size], "utf-8")
                    except UnicodeDecodeError:
                        pass  # unpack_fields says so
                    else:
                        return (flags, known[3], known[4], off, nbytes, step, seq, inc, pid,
                                slot, created, key)  # fmt: skip
        # A copy of the header (bounded): what is checked is what is remembered.
        with memoryview(buf) as whole:  # (released at once: ``buf`` may be a mapping)
            size = PREFIX.unpack_from(whole, at)[3] if n >= PREFIX.size else n
            head = bytes(whole[at : at + min(max(size, PREFIX.size), n, _MAX_HEADER)])
        bound = _NO_BOUND if record and len(head) > 10 and head[10] & FLAG_NOTICE else n
        f = unpack_fields(head, bound)
        if len(self._known) >= 1024:
            self._known.clear()
        key_at = size - PREFIX.unpack_from(head, 0)[14]
        self._known[head[_STATIC_AT:key_at]] = (size, f[3], f[4], f[1], f[2])
        return f


def is_notice(buf: BufferLike) -> bool:
    """Whether the header at the start of ``buf`` is a ring notice's (``FLAG_NOTICE``)."""
    return len(buf) >= PREFIX.size and bool(PREFIX.unpack_from(buf, 0)[2] & FLAG_NOTICE)


def created_ns(buf: BufferLike) -> int | None:
    """The ``created_ns`` of the header at the start of ``buf`` (when it was sent), or None
    if ``buf`` starts with no header of ours. Checks the magic only: for judging a
    message's age, never for data."""
    if len(buf) < PREFIX.size or bytes(buf[: len(MAGIC)]) != MAGIC:
        return None
    return int(PREFIX.unpack_from(buf, 0)[11])


def unpack_identity(buf: BufferLike) -> tuple[int, int, str] | None:
    """(step_id, seq, key) of a header that ``unpack`` refuses, when those three can still be
    read within ``buf`` (so the refusal can go to that key's receiver), else None."""
    if len(buf) < PREFIX.size or bytes(buf[: len(_LEAD)]) != _LEAD:
        return None
    fields = PREFIX.unpack_from(buf, 0)
    step_id, seq = fields[6:8]
    ndim, dtype_len, key_len = fields[12:]
    key_at = PREFIX.size + 8 * ndim + dtype_len
    if ndim > MAX_NDIM or key_len > MAX_KEY_BYTES or key_at + key_len > len(buf):
        return None
    try:
        return step_id, seq, bytes(buf[key_at : key_at + key_len]).decode("utf-8")
    except UnicodeDecodeError:
        return None
