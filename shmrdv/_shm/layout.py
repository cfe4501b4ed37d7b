"""The segment header: a pure byte format at the start of every shared-memory segment.

No shared memory and no I/O here (h11-style, STYLE.md rule 3): ``pack_into`` writes a
``Header`` into any writable buffer and ``unpack`` reads one back from any buffer, so
both are tested on plain ``bytearray``s. A segment is the header, padding up to
``data_offset`` (a multiple of 64, so the array data is aligned for numpy and SIMD),
then ``nbytes`` of array data in C order.

Layout, little endian, no padding::

    magic 8s | version u16 | flags u16 | header_len u32 | data_offset u64 | nbytes u64
    step_id i64 | seq u64 | producer_incarnation u64 | producer_pid u32 | slot i64
    created_ns u64 | ndim u32 | dtype_len u32 | key_len u32          (the fixed prefix)
    shape: ndim x u64 | dtype descriptor: dtype_len bytes | key: key_len bytes (UTF-8)

``flags`` bit 0 is ``is_dead``; bit 1 (``FLAG_NOTICE``, ring records only) says the record
carries no data: the array is in the segment published under this message's name. ``header_len`` is the whole header (prefix through key).

The dtype descriptor (``shmrdv/_dtypes.py``, shared with the gRPC coding) is one of:

* ``dtype.str`` for plain dtypes (``<f4``, ``|S7``, ``<U5``, ``|b1``, ``<c16``, ``<M8[ns]``);
* ``json:`` + JSON of ``numpy.lib.format.dtype_to_descr(dtype)`` for structured dtypes
  (the ``.npy`` format's description; decoded with ``descr_to_dtype``);
* ``ml_dtypes:<name>`` for ml_dtypes' types (bfloat16, float8_*), imported lazily.

``unpack`` treats the buffer as hostile (a peer may be buggy or malicious): every length
is checked against the buffer and the file before it is used, so garbage gives
``InternalError("segment header corrupted: <field> ...")`` and never another exception or a
large allocation.
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import InternalError, InvalidArgumentError
from .._values import MAX_DTYPE_BYTES, shape_problem
from .._values import decode_dtype as _decode_dtype
from .._values import encode_dtype as _encode_dtype

__all__ = [
    "ALIGNMENT",
    "MAGIC",
    "MAX_DTYPE_BYTES",
    "MAX_KEY_BYTES",
    "MAX_NDIM",
    "PREFIX",
    "VERSION",
    "Record",
    "FLAG_NOTICE",
    "LiveParts",
    "Header",
    "HeaderCache",
    "Template",
    "created_ns",
    "data_offset_for",
    "is_notice",
    "header_size",
    "pack",
    "pack_into",
    "stamp_error",
    "unpack",
    "unpack_fields",
    "unpack_identity",
]

#: Any buffer the header can be read from (``pack_into`` needs a writable one).
BufferLike = bytes | bytearray | memoryview | mmap.mmap

#: First bytes of every segment. The non-ASCII first byte and the newline catch text
#: mangling, as the PNG signature does; an all-zero (fresh, unwritten) file never matches.
MAGIC = b"\x89SHMRDV\n"
VERSION = 1
#: Data starts on a 64-byte boundary (a cache line; AVX-512 loads). numpy itself only
#: needs the dtype's alignment, which is at most 16.
ALIGNMENT = 64
#: numpy's NPY_MAXDIMS is 64 since numpy 2.0 (32 before).
MAX_NDIM = 64
#: Bounds on the declared lengths, so a corrupted header never makes us allocate much.
MAX_KEY_BYTES = 1 << 20

PREFIX = struct.Struct("<8sHHIQQqQQIqQIII")
_FLAG_DEAD = 1
FLAG_NOTICE = 2
_KNOWN_FLAGS = _FLAG_DEAD | FLAG_NOTICE
# The fields a message changes, from ``flags`` to ``created_ns`` (offsets 10-75 of PREFIX):
# a ``Template`` writes them with one pack_into.
_VARYING = struct.Struct("<HIQQqQQIqQ")
_VARYING_AT = 10
# The fields from ``step_id`` to ``created_ns``: what a live message of a known key changes
# in its header (``Template.pack_live``); flags, lengths and offsets stay the template's.
_PER_MESSAGE = struct.Struct("<qQQIqQ")
_PER_MESSAGE_AT = 32
assert _PER_MESSAGE_AT + _PER_MESSAGE.size == _VARYING_AT + _VARYING.size
#: ``Template.pack_live``: the parts of a live message's header a key keeps
#: (``Template.live_parts``: what comes before the per-message fields, what follows them).
LiveParts = tuple[bytes, bytes]
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
#: numpy refuses arrays whose element count times itemsize exceeds NPY_MAX_INTP
#: (it multiplies every non-zero dimension, even when another one is 0).
_MAX_INTP = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Header:
    """What a segment holds: the array's dtype and shape, where its bytes are, whose it is.

    ``slot`` is the producer's pool slot, or -1 for a segment that is not pooled.
    ``created_ns`` is ``time.time_ns()`` at the send. Use ``Header.build`` to compute
    ``data_offset`` and ``nbytes`` from the key, dtype and shape.
    """

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

    @classmethod
    def build(
        cls,
        *,
        key: str,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        step_id: int,
        seq: int,
        producer_incarnation: int,
        producer_pid: int,
        is_dead: bool = False,
        slot: int = -1,
        created_ns: int | None = None,
    ) -> Header:
        """A header with ``data_offset`` and ``nbytes`` filled in (``created_ns`` defaults to now).

        Raises ``InvalidArgumentError`` for an object dtype or a dtype that cannot be described.
        """
        shape = tuple(int(d) for d in shape)
        return cls(
            dtype=dtype,
            shape=shape,
            is_dead=is_dead,
            data_offset=data_offset_for(key, dtype, len(shape)),
            nbytes=_prod(shape) * dtype.itemsize,
            step_id=step_id,
            seq=seq,
            producer_incarnation=producer_incarnation,
            producer_pid=producer_pid,
            slot=slot,
            created_ns=time.time_ns() if created_ns is None else created_ns,
            key=key,
        )

    @property
    def segment_size(self) -> int:
        """Bytes the segment needs: ``data_offset + nbytes``."""
        return self.data_offset + self.nbytes


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _corrupted(what: str) -> InternalError:
    return InternalError(f"segment header corrupted: {what}")


# --- sizes ------------------------------------------------------------------------------


def _round_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _key_bytes(key: str) -> bytes:
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"rendezvous key of {len(raw)} bytes is too long: {key[:200]!r}")
    return raw


def data_offset_for(key: str, dtype: np.dtype[Any], ndim: int) -> int:
    """Where the data starts: the header's size rounded up to a multiple of ``ALIGNMENT``.

    Raises ``InvalidArgumentError`` for an object or undescribable dtype, a too long key
    or too many dimensions.
    """
    if not 0 <= ndim <= MAX_NDIM:
        raise InvalidArgumentError(f"an array of {ndim} dimensions: at most {MAX_NDIM}")
    size = PREFIX.size + 8 * ndim + len(_encode_dtype(dtype)) + len(_key_bytes(key))
    return _round_up(size)


def header_size(h: Header) -> int:
    """Bytes ``pack`` writes for ``h`` (its ``data_offset`` is at least this)."""
    return PREFIX.size + 8 * len(h.shape) + len(_encode_dtype(h.dtype)) + len(_key_bytes(h.key))


# --- pack / unpack ----------------------------------------------------------------------


def _check_fields(h: Header, size: int) -> None:
    for name, value, lo, hi in (
        ("step_id", h.step_id, _I64_MIN, _I64_MAX),
        ("seq", h.seq, 0, _U64_MAX),
        ("producer_incarnation", h.producer_incarnation, 0, _U64_MAX),
        ("producer_pid", h.producer_pid, 0, _U32_MAX),
        ("slot", h.slot, -1, _I64_MAX),
        ("created_ns", h.created_ns, 0, _U64_MAX),
        ("data_offset", h.data_offset, size, _U64_MAX),
        ("nbytes", h.nbytes, 0, _MAX_INTP),
    ):
        if not lo <= value <= hi:
            raise InternalError(f"cannot pack segment header: {name}={value!r} not in [{lo}, {hi}]")
    if h.data_offset % ALIGNMENT:
        raise InternalError(f"cannot pack segment header: data_offset={h.data_offset} unaligned")
    if len(h.shape) > MAX_NDIM or any(not 0 <= d <= _MAX_INTP for d in h.shape):
        raise InternalError(f"cannot pack segment header: bad shape {h.shape!r:.200}")
    if h.nbytes != _prod(h.shape) * h.dtype.itemsize:
        raise InternalError(
            f"cannot pack segment header: nbytes={h.nbytes} but shape {h.shape} of {h.dtype} "
            f"holds {_prod(h.shape) * h.dtype.itemsize}"
        )


def pack_into(buf: bytearray | memoryview | mmap.mmap, h: Header) -> None:
    """Write ``h`` at the start of the writable ``buf`` (bytes up to ``data_offset`` untouched
    past the header).

    Raises ``InvalidArgumentError`` for an object dtype or a too long key (the caller's
    value), ``InternalError`` for an inconsistent header or a too small buffer.
    """
    dtype_raw = _encode_dtype(h.dtype)
    key_raw = _key_bytes(h.key)
    ndim = len(h.shape)
    shape_at = PREFIX.size
    dtype_at = shape_at + 8 * ndim
    key_at = dtype_at + len(dtype_raw)
    size = key_at + len(key_raw)
    _check_fields(h, size)
    if len(buf) < size:
        raise InternalError(
            f"cannot pack segment header: {size} bytes into a {len(buf)}-byte buffer"
        )
    PREFIX.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        _FLAG_DEAD if h.is_dead else 0,
        size,
        h.data_offset,
        h.nbytes,
        h.step_id,
        h.seq,
        h.producer_incarnation,
        h.producer_pid,
        h.slot,
        h.created_ns,
        ndim,
        len(dtype_raw),
        len(key_raw),
    )
    _SHAPES[ndim].pack_into(buf, shape_at, *h.shape)
    buf[dtype_at:key_at] = dtype_raw
    buf[key_at:size] = key_raw


class Template:
    """The header of every message of one (dtype, shape, key length), packed once.

    Per message only the key's bytes and the fields that change (flags, step, seq,
    incarnation, pid, slot, created_ns) are written, the fields with one ``pack_into`` at a
    fixed offset; their ranges are checked by ``struct`` itself. ``data_offset``,
    ``nbytes`` and ``segment_size`` are the message's. Building one validates like
    ``pack_into`` (``InvalidArgumentError`` for the caller's bad dtype or too long a key).
    """

    __slots__ = (
        "_key_at",
        "_size",
        "data_offset",
        "dtype",
        "header",
        "key_len",
        "nbytes",
        "pack_live",
        "segment_size",
        "shape",
    )

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int, ...], key_len: int) -> None:
        h = Header.build(
            key="k" * key_len,
            dtype=dtype,
            shape=shape,
            step_id=0,
            seq=0,
            producer_incarnation=0,
            producer_pid=0,
            created_ns=0,
        )
        buf = bytearray(h.data_offset)
        pack_into(buf, h)
        self.header = bytes(buf)  # through data_offset (the padding is zeros)
        self._size = header_size(h)
        self._key_at = self._size - key_len
        self.key_len = key_len
        self.dtype = dtype
        self.shape = h.shape
        self.data_offset = h.data_offset
        self.nbytes = h.nbytes
        self.segment_size = h.segment_size
        #: A live message, header and data, in one C call: ``pack_live(buf, at, head,
        #: step_id, seq, incarnation, pid, slot, created_ns, tail, data)``, where ``head,
        #: tail = live_parts(key)`` and ``data`` holds ``nbytes`` bytes. The same bytes as
        #: ``write_keyed`` (flags 0) followed by the data. Raises ``struct.error`` for a
        #: field out of its range (``stamp_error`` makes the ``InternalError`` that
        #: ``write_keyed`` raises).
        self.pack_live: Callable[..., None] = struct.Struct(
            f"<{_PER_MESSAGE_AT}s{_PER_MESSAGE.format[1:]}"
            f"{self.data_offset - _STATIC_AT}s{self.nbytes}s"
        ).pack_into

    def live_parts(self, key: bytes) -> LiveParts:
        """The header with the UTF-8 ``key`` in place (``keyed``) around the per-message
        fields: what ``pack_live`` writes before them, and after them through
        ``data_offset``; made once per key."""
        keyed = self.keyed(key)
        return keyed[:_PER_MESSAGE_AT], keyed[_STATIC_AT:]

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
    ) -> None:
        """Write the header of one message, whose UTF-8 key is ``key`` (``key_len`` bytes),
        at ``buf[at:]`` (``data_offset`` bytes). Raises ``InternalError`` if a field is out
        of its range."""
        self.write_keyed(
            buf, at, self.keyed(key), flags, step_id, seq, incarnation, pid, slot, created_ns
        )

    def keyed(self, key: bytes) -> bytes:
        """The header through ``data_offset`` with the UTF-8 ``key`` (``key_len`` bytes) in
        place: what ``write_keyed`` copies, made once per key."""
        if len(key) != self.key_len:
            raise InternalError(f"a key of {len(key)} bytes for a template of {self.key_len}")
        return self.header[: self._key_at] + key + self.header[self._key_at + self.key_len :]

    def write_keyed(
        self,
        buf: bytearray | memoryview | mmap.mmap,
        at: int,
        header: bytes,
        flags: int,
        step_id: int,
        seq: int,
        incarnation: int,
        pid: int,
        slot: int,
        created_ns: int,
    ) -> None:
        """``write`` with the key already in ``header`` (``keyed``): one copy and one pack."""
        buf[at : at + self.data_offset] = header
        try:
            _VARYING.pack_into(
                buf,
                at + _VARYING_AT,
                flags,
                self._size,
                self.data_offset,
                self.nbytes,
                step_id,
                seq,
                incarnation,
                pid,
                slot,
                created_ns,
            )
        except struct.error as e:
            raise stamp_error(e, step_id, seq, slot) from e


def stamp_error(e: struct.error, step_id: int, seq: int, slot: int) -> InternalError:
    """The error of a header field out of its range (``struct.error`` ``e``)."""
    return InternalError(
        f"cannot pack segment header: a field is out of range (step {step_id}, seq {seq}, "
        f"slot {slot}): {e}"
    )


def pack(h: Header) -> bytes:
    """``h`` as bytes (the header only, without the padding up to ``data_offset``)."""
    buf = bytearray(header_size(h))
    pack_into(buf, h)
    return bytes(buf)


def unpack(buf: BufferLike, file_size: int) -> Header:
    """Read the header at the start of ``buf``, a segment whose file is ``file_size`` bytes.

    Raises ``InternalError`` for anything inconsistent (see ``unpack_fields``).
    """
    f = unpack_fields(buf, file_size)
    return Header(
        dtype=f[1],
        shape=f[2],
        is_dead=bool(f[0] & _FLAG_DEAD),
        data_offset=f[3],
        nbytes=f[4],
        step_id=f[5],
        seq=f[6],
        producer_incarnation=f[7],
        producer_pid=f[8],
        slot=f[9],
        created_ns=f[10],
        key=f[11],
    )


#: What ``unpack_fields`` returns: flags, dtype, shape, data_offset, nbytes, step_id, seq,
#: producer_incarnation, producer_pid, slot, created_ns, key.
Fields = tuple[int, np.dtype[Any], tuple[int, ...], int, int, int, int, int, int, int, int, str]


def unpack_fields(buf: BufferLike, file_size: int) -> Fields:
    """``unpack``'s checks without building a ``Header`` (the hot path of ring records).

    Reads each header byte once (a peer may be changing it). Raises ``InternalError``
    ("segment header corrupted: ...", naming the field) for anything inconsistent, and
    nothing else; allocates at most the declared header, itself bounded by ``buf``.
    """
    limit = min(len(buf), file_size)
    if limit < PREFIX.size:
        raise _corrupted(f"only {limit} bytes, the fixed header needs {PREFIX.size}")
    (
        magic,
        version,
        flags,
        size,
        data_offset,
        nbytes,
        step_id,
        seq,
        incarnation,
        pid,
        slot,
        created_ns,
        ndim,
        dtype_len,
        key_len,
    ) = PREFIX.unpack_from(buf, 0)
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
    shape_at = PREFIX.size
    dtype_at = shape_at + 8 * ndim
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
    shape = _SHAPES[ndim].unpack_from(buf, shape_at)
    dtype = _decode_dtype(bytes(buf[dtype_at:key_at]))
    # The element count is bounded whatever the item size (issue 13 §3: a |V0 shape of
    # 2**62 has nbytes 0 and passed every byte-length check, then hung numpy): one rule,
    # shared with send and the gRPC coding.
    problem = shape_problem(shape, dtype.itemsize)
    if problem is not None:
        raise _corrupted(f"{problem} ({dtype})")
    count = 1
    for d in shape:
        count *= d if d else 1
    if count * dtype.itemsize > _MAX_INTP:  # numpy multiplies every non-zero dimension
        raise _corrupted(f"shape {shape} of {dtype} is larger than numpy allows")
    if nbytes != _prod(shape) * dtype.itemsize:
        raise _corrupted(f"nbytes {nbytes} but shape {shape} of {dtype} needs other")
    try:
        key = bytes(buf[key_at:end]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _corrupted(f"key is not UTF-8 ({e})") from e
    return (
        flags,
        dtype,
        shape,
        data_offset,
        nbytes,
        step_id,
        seq,
        incarnation,
        pid,
        slot,
        created_ns,
        key,
    )


_STATIC_AT = _VARYING_AT + _VARYING.size  # where the per-message fields end: 76
_LEAD = MAGIC + struct.pack("<H", VERSION)  # the first 10 bytes of every header
_KEY_LEN = struct.Struct("<I")
_KEY_LEN_AT = PREFIX.size - 4  # key_len, the last field of the fixed prefix
_HOT = struct.Struct(PREFIX.format[:-3])  # the prefix up to ``created_ns``
# The same bytes, only the fields a ring record's check needs (incarnation, pid and
# created_ns skipped: two fewer large ints made per record drained; the magic read as an
# integer, compared with ``_MAGIC_U64``, which is cheaper than a bytes object).
_RECORD = struct.Struct("<QHHIQQqQ12xq8x")
_MAGIC_U64 = int.from_bytes(MAGIC, "little")
assert _RECORD.size == _HOT.size
# A notice record's data is in a segment: its header is checked against no file size.
_NO_FILE = 1 << 63

#: A ``HeaderCache`` entry: data offset, nbytes, dtype, shape, key, element count,
#: header length, end of the data.
_Keyed = tuple[int, int, np.dtype[Any], tuple[int, ...], str, int, int, int]

#: What ``HeaderCache.record`` returns: flags, dtype, shape, element count, data_offset,
#: step_id, seq, slot, key.
Record = tuple[int, np.dtype[Any], tuple[int, ...], int, int, int, int, int, str]

# -- a live record of a known key, checked by the drain itself (``HeaderCache.live``) --
#: Where ``header_len`` (u32) is: 4-aligned in a ring record's payload.
HEADER_LEN_AT = 12
#: Where a header's bytes that do not change per message resume, through the key.
STATIC_AT = _STATIC_AT
#: Below this many bytes a record is no header (the fixed prefix).
MIN_HEADER = PREFIX.size
# A live record's first 32 bytes (magic through nbytes: its flags are 0), step_id, seq,
# slot; then (``HeaderCache.live_readers``) the bytes from ``STATIC_AT`` through the key.
_LIVE_FIELDS = "<32sqQ12xq8x"
_LIVE_HEAD = struct.Struct("<8sHHIQQ")
assert _LIVE_HEAD.size == 32 and PREFIX.format.startswith(_LIVE_HEAD.format)
assert struct.calcsize(_LIVE_FIELDS) == _STATIC_AT
#: A ``HeaderCache.live`` entry: the header's first 32 bytes, where its data ends, the
#: shape, dtype, data offset and key.
LiveEntry = tuple[bytes, int, tuple[int, ...], np.dtype[Any], int, str]
#: A ``HeaderCache.live_readers`` entry: ``read(buf, at)`` gives a header's first 32
#: bytes, step_id, seq, slot, and its bytes from ``STATIC_AT`` through the key.
LiveReader = Callable[[BufferLike, int], tuple[bytes, int, int, int, bytes]]


class HeaderCache:
    """``unpack_fields`` memoized over the header bytes that do not change per message.

    A producer's messages of one key and one (dtype, shape) differ only in the fields from
    ``flags`` to ``created_ns``: the rest of the header (ndim, lengths, shape, dtype, key)
    is looked up by its bytes, and what ``unpack_fields`` concluded about exactly those
    bytes (their dtype, shape, decoded key, header length, data offset and nbytes) is
    reused. A key seen for the first time is still spared the dtype and shape checks when
    another key of its (dtype, shape, key length) was seen (a second table, which decodes
    the key, strict UTF-8). The changing fields are checked every time (magic, version,
    flags, data offset, nbytes, slot, the file size), so a hostile buffer gets the same
    answer as from ``unpack_fields``, which is called whenever the bytes are new. Both
    tables are bounded (emptied when full). Not thread-safe.

    ``live`` and ``live_readers`` are the ring drain's own tables, for a live record
    (flags 0) of a non-empty array whose header was seen: ``live`` maps the header's bytes
    from ``STATIC_AT`` through the key to a ``LiveEntry``, and ``live_readers`` a header
    length to the ``LiveReader`` of a header that long. A record ``buf[at:end]`` of
    ``n = end - at >= MIN_HEADER`` bytes whose ``header_len`` (the u32 at
    ``HEADER_LEN_AT``) is at most ``n`` and has a reader, whose bytes so read are a key of
    ``live``, with the entry's first 32 bytes, a ``slot >= -1`` and a data end at most
    ``n``, is what ``record`` would answer, without its call: flags 0, the entry's dtype
    and shape, its data at ``at`` + data offset, the step, seq and slot read. Any other
    record goes to ``record``. (The 32 bytes, magic, version, flags, header length, data
    offset and nbytes, are packed from the values checked when the entry was made; the
    rest of what ``unpack_fields`` checks is the slot and the record's length.)
    """

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self.live: dict[bytes, LiveEntry] = {}
        self.live_readers: dict[int, LiveReader] = {}
        # The header from ``_STATIC_AT`` through the key -> data offset, nbytes, dtype,
        # shape, key (its length fixes the header's: both end at the key), and for
        # ``record``: the element count, the header length and where the data ends.
        self._keyed: dict[bytes, _Keyed] = {}
        # The same without the key -> header length, data offset, nbytes, dtype, shape.
        self._known: dict[bytes, tuple[int, int, int, np.dtype[Any], tuple[int, ...]]] = {}

    def unpack(self, buf: BufferLike, file_size: int) -> Fields:
        """``unpack_fields(buf, file_size)``, cheaply when the header was seen before."""
        if len(buf) >= PREFIX.size:
            (magic, version, flags, size, off, nbytes, step, seq, inc, pid, slot, created) = (
                _HOT.unpack_from(buf, 0)
            )
            if (
                size <= len(buf)
                and not flags & ~_KNOWN_FLAGS
                and slot >= -1
                and off + nbytes <= file_size
                and magic == MAGIC
                and version == VERSION
            ):
                keyed = self._keyed.get(bytes(buf[_STATIC_AT:size]))
                if keyed is not None and keyed[0] == off and keyed[1] == nbytes:
                    return (
                        flags,
                        keyed[2],
                        keyed[3],
                        off,
                        nbytes,
                        step,
                        seq,
                        inc,
                        pid,
                        slot,
                        created,
                        keyed[4],
                    )
                key_at = size - _KEY_LEN.unpack_from(buf, _KEY_LEN_AT)[0]
                known = (
                    self._known.get(bytes(buf[_STATIC_AT:key_at]))
                    if PREFIX.size <= key_at <= size
                    else None
                )
                if (
                    known is not None
                    and known[0] == size
                    and known[1] == off
                    and known[2] == nbytes
                ):
                    try:
                        key = str(buf[key_at:size], "utf-8")
                    except UnicodeDecodeError as e:
                        raise _corrupted(f"key is not UTF-8 ({e})") from e
                    self._remember_key(bytes(buf[_STATIC_AT:size]), off, nbytes, known, key)
                    return (
                        flags,
                        known[3],
                        known[4],
                        off,
                        nbytes,
                        step,
                        seq,
                        inc,
                        pid,
                        slot,
                        created,
                        key,
                    )
        f = unpack_fields(buf, file_size)
        size = PREFIX.unpack_from(buf, 0)[3]
        if len(self._known) >= self._limit:
            self._known.clear()
        key_at = size - _KEY_LEN.unpack_from(buf, _KEY_LEN_AT)[0]
        known = self._known[bytes(buf[_STATIC_AT:key_at])] = (size, f[3], f[4], f[1], f[2])
        self._remember_key(bytes(buf[_STATIC_AT:size]), f[3], f[4], known, f[11])
        return f

    def _remember_key(
        self,
        keyed: bytes,
        off: int,
        nbytes: int,
        known: tuple[int, int, int, np.dtype[Any], tuple[int, ...]],
        key: str,
    ) -> None:
        if len(self._keyed) >= self._limit:
            self._keyed.clear()
            self.live.clear()
            self.live_readers.clear()
        count = nbytes // known[3].itemsize if nbytes else 0
        size = _STATIC_AT + len(keyed)
        self._keyed[keyed] = (off, nbytes, known[3], known[4], key, count, size, off + nbytes)
        if count:  # (from the checked values, not from the buffer: a peer may change it)
            head = _LIVE_HEAD.pack(MAGIC, VERSION, 0, size, off, nbytes)
            self.live[keyed] = (head, off + nbytes, known[4], known[3], off, key)
            if size not in self.live_readers:
                fmt = f"{_LIVE_FIELDS}{size - _STATIC_AT}s"
                self.live_readers[size] = struct.Struct(fmt).unpack_from

    def record(self, buf: memoryview, at: int, end: int) -> Record:
        """The header of the ring record ``buf[at:end]``, with ``unpack``'s checks: its data
        must lie within the record, unless it is a notice (``FLAG_NOTICE``: the data is the
        segment of its name, checked when that is opened); offsets in the record (the data
        offset) are from ``at``. Returns ``Record``; raises like ``unpack``. The receive
        side's hot path: one ``struct`` call and one lookup for a key seen before, without
        a view of the record.

        For such a key the bytes that do not change per message (from ``_STATIC_AT``
        through the key) are the lookup's key; the header length, data offset and nbytes
        are compared with what they were, and the changing fields are checked as
        ``unpack`` checks them."""
        n = end - at
        if n >= PREFIX.size and end <= len(buf):
            magic, version, flags, size, off, nbytes, step, seq, slot = _RECORD.unpack_from(buf, at)
            keyed = self._keyed.get(buf[at + _STATIC_AT : at + size].tobytes())
            if (
                keyed is not None
                and keyed[0] == off
                and keyed[1] == nbytes
                and keyed[6] == size
                and size <= n
                and magic == _MAGIC_U64
                and version == VERSION
                and not flags & ~_KNOWN_FLAGS
                and slot >= -1
                and (flags & FLAG_NOTICE or keyed[7] <= n)
            ):
                return flags, keyed[2], keyed[3], keyed[5], off, step, seq, slot, keyed[4]
        payload = buf[at:end]
        notice = len(payload) > _VARYING_AT and payload[_VARYING_AT] & FLAG_NOTICE
        f = self.unpack(payload, _NO_FILE if notice else len(payload))
        count = f[4] // f[1].itemsize if f[4] else 0
        return f[0], f[1], f[2], count, f[3], f[5], f[6], f[9], f[11]


_CREATED = struct.Struct("<Q")
_CREATED_AT = struct.calcsize(PREFIX.format[:-4])  # the prefix before ``created_ns``


def is_notice(buf: BufferLike) -> bool:
    """Whether the header at the start of ``buf`` is a ring notice (``FLAG_NOTICE``: its
    data is the segment published under the message's name)."""
    return len(buf) > _VARYING_AT and bool(buf[_VARYING_AT] & FLAG_NOTICE)


def created_ns(buf: BufferLike) -> int | None:
    """The ``created_ns`` of the header at the start of ``buf`` (when its producer sent
    it, ``time.time_ns()``), or None when ``buf`` starts with no header of ours. Reads the
    magic and that field only: for a sweep judging a message's age, never for data."""
    if len(buf) < PREFIX.size or bytes(buf[: len(MAGIC)]) != MAGIC:
        return None
    return int(_CREATED.unpack_from(buf, _CREATED_AT)[0])


def unpack_identity(buf: BufferLike) -> tuple[int, int, str] | None:
    """(step_id, seq, key) of a header that ``unpack`` refuses, when those three can still be
    read within ``buf`` (so the refusal can go to that key's receiver), else None."""
    if len(buf) < PREFIX.size or bytes(buf[:_VARYING_AT]) != _LEAD:
        return None
    fields = PREFIX.unpack_from(buf, 0)
    step_id, seq, ndim, dtype_len, key_len = (
        fields[6],
        fields[7],
        fields[12],
        fields[13],
        fields[14],
    )
    key_at = PREFIX.size + 8 * ndim + dtype_len
    if ndim > MAX_NDIM or key_len > MAX_KEY_BYTES or key_at + key_len > len(buf):
        return None
    try:
        return step_id, seq, bytes(buf[key_at : key_at + key_len]).decode("utf-8")
    except UnicodeDecodeError:
        return None
