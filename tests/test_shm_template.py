"""Header templates and the header cache (layout.py's hot path), on plain buffers."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from header_corruptions import HEADER_CORRUPTIONS

from shmrdv._errors import InternalError
from shmrdv._shm import layout

KEY = "/job:w/replica:0/task:0/device:CPU:0;0000000000000001;/job:w/replica:0/task:1/device:CPU:0;e;0:0"


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.dtype("<f4"), (16,)), (np.dtype("|S3"), (2, 0, 5)), (np.dtype([("a", "<i2")]), ())],
)
def test_template_write_equals_pack_into(dtype: np.dtype, shape: tuple[int, ...]) -> None:
    t = layout.Template(dtype, shape, len(KEY.encode()))
    got = bytearray(t.data_offset)
    t.write(got, 0, KEY.encode(), 1, -7, 3, 2**64 - 1, 42, 5, 123)
    h = layout.Header.build(
        key=KEY,
        dtype=dtype,
        shape=shape,
        step_id=-7,
        seq=3,
        producer_incarnation=2**64 - 1,
        producer_pid=42,
        is_dead=True,
        slot=5,
        created_ns=123,
    )
    want = bytearray(h.data_offset)
    layout.pack_into(want, h)
    assert got == want
    assert layout.unpack(got, h.segment_size) == h


def test_template_field_out_of_range_refused() -> None:
    t = layout.Template(np.dtype("<f8"), (2,), len(KEY))
    buf = bytearray(t.data_offset)
    with pytest.raises(InternalError, match="out of range"):
        t.write(buf, 0, KEY.encode(), 0, 2**63, 0, 1, 1, -1, 0)
    with pytest.raises(InternalError, match="out of range"):
        t.write(buf, 0, KEY.encode(), 0, 1, -1, 1, 1, -1, 0)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.dtype("<f4"), (16,)), (np.dtype("|S3"), (2, 0, 5)), (np.dtype([("a", "<i2")]), ())],
)
def test_template_pack_live_equals_write_then_data(dtype: np.dtype, shape: tuple[int, ...]) -> None:
    # A small live send packs the key's header around its per-message fields, then the
    # data, in one call (``pack_live``): the same bytes as ``write`` followed by the data,
    # for every message of the key (each pack replaces every per-message field).
    t = layout.Template(dtype, shape, len(KEY.encode()))
    head, tail = t.live_parts(KEY.encode())
    data = bytes(range(256)) * (t.nbytes // 256) + bytes(range(t.nbytes % 256))
    record = bytearray(8 + t.data_offset + t.nbytes)  # written at 8, as in a ring record
    for step, seq, inc, pid, slot, created in [(-7, 3, 2**64 - 1, 42, 5, 123), (9, 0, 1, 7, -1, 0)]:
        t.pack_live(record, 8, head, step, seq, inc, pid, slot, created, tail, data)
        want = bytearray(t.data_offset)
        t.write(want, 0, KEY.encode(), 0, step, seq, inc, pid, slot, created)
        assert record[8:] == want + data
        h = layout.unpack(record[8:], t.segment_size)
        assert (h.step_id, h.seq, h.producer_incarnation, h.slot, h.is_dead) == (
            step,
            seq,
            inc,
            slot,
            False,
        )
    with pytest.raises(struct.error) as e:
        t.pack_live(record, 8, head, 2**63, 0, 1, 1, -1, 0, tail, data)
    err = layout.stamp_error(e.value, 2**63, 0, -1)
    assert isinstance(err, InternalError) and "out of range (step 9223372036854775808" in str(err)


def _record(seq: int, flags: int = 0, key: bytes = KEY.encode()) -> bytearray:
    t = layout.Template(np.dtype("<f4"), (16,), len(key))
    buf = bytearray(t.data_offset + 64)
    t.write(buf, 0, key, flags, 1, seq, 9, 9, -1, 0)
    return buf


def test_header_cache_answers_as_unpack_fields() -> None:
    cache = layout.HeaderCache()
    for seq in range(3):
        rec = _record(seq)
        assert cache.unpack(rec, len(rec)) == layout.unpack_fields(rec, len(rec))


def test_header_cache_decodes_each_key_and_refuses_a_bad_one() -> None:
    """New keys of a known (dtype, shape, key length) hit the cache; each key is decoded."""
    cache = layout.HeaderCache()
    for name in ("a", "b", "c"):
        key = KEY.replace(";e;", f";{name};").encode()
        rec = _record(0, key=key)
        got = cache.unpack(rec, len(rec))
        assert got == layout.unpack_fields(rec, len(rec))
        assert got[11] == key.decode()
    bad = _record(1, key=KEY.replace(";e;", ";\xff;").encode("latin-1"))
    with pytest.raises(InternalError, match="UTF-8"):
        cache.unpack(bad, len(bad))


def test_header_cache_still_checks_the_changing_fields() -> None:
    cache = layout.HeaderCache()
    rec = _record(0)
    cache.unpack(rec, len(rec))  # now known
    bad_flags = _record(1, flags=0x80)
    with pytest.raises(InternalError, match="flags"):
        cache.unpack(bad_flags, len(bad_flags))
    short = _record(2)
    with pytest.raises(InternalError, match="past the end"):
        cache.unpack(short, len(short) - 8)  # the data would run past the record
    moved = _record(3)
    moved[16:24] = (64).to_bytes(8, "little")  # data_offset 256 -> 64: inside the header
    with pytest.raises(InternalError, match="data offset"):
        cache.unpack(moved, len(moved))


def test_unpack_identity_names_a_refused_record() -> None:
    rec = _record(4)
    rec[76:80] = (65).to_bytes(4, "little")  # ndim 65: unpack refuses it
    with pytest.raises(InternalError):
        layout.unpack_fields(rec, len(rec))
    assert layout.unpack_identity(rec) is None  # the key cannot be located past a bad ndim
    rec = _record(5)
    rec[24:32] = (1).to_bytes(8, "little")  # nbytes 1: inconsistent with the shape
    with pytest.raises(InternalError):
        layout.unpack_fields(rec, len(rec))
    assert layout.unpack_identity(rec) == (1, 5, KEY)


def test_header_cache_record_checks_inline_data_but_not_a_notices() -> None:
    """``record``: a ring record's header; an inline record's data must lie in it, a
    notice's (``FLAG_NOTICE``) is in a segment, so only its header must."""
    cache = layout.HeaderCache()
    for _ in range(2):  # new, then from the cache
        rec = _record(3)
        f = layout.unpack_fields(rec, len(rec))
        got = _span(cache, rec)
        assert got == (f[0], f[1], f[2], 16, f[3], f[5], f[6], f[9], f[11])
        notice = _record(4, flags=layout.FLAG_NOTICE)[: f[3]]  # the header only
        got = _span(cache, notice)
        assert got[0] == layout.FLAG_NOTICE and got[3] == 16 and got[6] == 4
        with pytest.raises(InternalError, match="past the end"):
            _span(cache, _record(5)[: f[3]])  # inline, but its data is cut off
        # A span ending inside the header: the bytes after it (here the rest of the very
        # same header) are not read as the record's.
        size = int.from_bytes(notice[12:16], "little")
        with pytest.raises(InternalError, match="past the end"):
            cache.record(memoryview(notice), 0, size - 8)


def _span(cache: layout.HeaderCache, rec: bytearray) -> layout.Record:
    """``cache.record`` of ``rec`` placed, as in a ring, after 64 bytes and before others."""
    ring = bytearray(64) + rec + b"\xff" * 64
    return cache.record(memoryview(ring), 64, 64 + len(rec))


@pytest.mark.parametrize(("at", "raw", "match"), HEADER_CORRUPTIONS)
def test_header_cache_record_checks_every_field_of_a_known_key(
    at: int, raw: bytes, match: str
) -> None:
    """A corrupted record of a key the cache knows gets ``unpack_fields``' refusal."""
    cache = layout.HeaderCache()
    rec = _record(0)
    rec.extend(bytes(256))  # room for a moved data offset, so only the named check fails
    _span(cache, rec)  # now known
    bad = bytearray(rec)
    bad[at : at + len(raw)] = raw
    with pytest.raises(InternalError, match=match):
        _span(cache, bad)
    with pytest.raises(InternalError, match=match):
        layout.unpack_fields(bad, len(bad))
    assert _span(cache, rec)[6] == 0  # the intact one is still answered
