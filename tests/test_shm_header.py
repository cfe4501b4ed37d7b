"""Tests of shmrdv._shm.header: the one writer and the one checked reader, on plain buffers."""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from header_corruptions import HEADER_CORRUPTIONS, build_header, write_header
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shmrdv._errors import InternalError, InvalidArgumentError
from shmrdv._shm import header as layout
from shmrdv._shm.header import ALIGNMENT, PREFIX, VERSION, Header

KEY = (
    "/job:w/replica:0/task:0/device:CPU:0;00000000000000ff;"
    "/job:w/replica:0/task:1/device:CPU:0;edge_7_ünïcode;0:0"
)
# Byte offsets of the prefix fields, in PREFIX's order.
_FIELDS = [
    "magic",
    "version",
    "flags",
    "header_len",
    "data_offset",
    "nbytes",
    "step_id",
    "seq",
    "incarnation",
    "pid",
    "slot",
    "created_ns",
    "ndim",
    "dtype_len",
    "key_len",
]


def _header(
    dtype: Any = "<f4", shape: tuple[int, ...] = (3, 5), key: str = KEY, **kw: Any
) -> Header:
    args: dict[str, Any] = {
        "step_id": -7,
        "seq": 2**64 - 1,
        "producer_incarnation": 0xFEEDFACECAFEBEEF,
        "producer_pid": 4321,
        "slot": 3,
        "is_dead": False,
        "created_ns": 1_700_000_000_000_000_000,
    }
    args.update(kw)
    return build_header(key=key, dtype=np.dtype(dtype), shape=shape, **args)


def _segment(h: Header) -> bytearray:
    buf = bytearray(h.segment_size)
    write_header(buf, h)
    return buf


def _header_len(h: Header) -> int:
    return layout.Template(h.dtype, h.shape, len(h.key.encode())).header_len


def _with(buf: bytearray, **fields: Any) -> bytearray:
    """A copy of ``buf`` with some prefix fields replaced."""
    values = dict(zip(_FIELDS, PREFIX.unpack_from(buf, 0)))
    values.update(fields)
    out = bytearray(buf)
    PREFIX.pack_into(out, 0, *(values[f] for f in _FIELDS))
    return out


def _dtypes() -> Iterator[np.dtype[Any]]:
    for spec in [
        "<f4",
        ">f8",
        "<f2",
        "|b1",
        "<i1",
        "<u8",
        ">i2",
        "<c8",
        "<c16",
        "|S7",
        "<U5",
        ">U3",
        "|V16",
        "<M8[ns]",
        "<m8[10ms]",
        "<M8",
        "<g",
        "<G",
    ]:
        yield np.dtype(spec)
    yield np.dtype([("a", "u1"), ("b", "<i4")], align=True)
    yield np.dtype([("a", "u1"), ("b", "<f8", (2, 3)), ("c", [("x", ">i2"), ("y", "S3")])])
    yield np.dtype({"names": ["a", "b"], "formats": ["i4", "f4"], "titles": ["T1", "T2"]})
    yield np.dtype({"names": ["a"], "formats": ["i4"], "offsets": [4], "itemsize": 12})
    yield np.dtype([])


@pytest.mark.parametrize("dtype", list(_dtypes()), ids=str)
def test_pack_unpack_round_trip(dtype: np.dtype[Any]) -> None:
    for shape in [(), (0,), (4,), (2, 0, 3), (2, 3, 1, 1, 2)]:
        h = _header(dtype, shape)
        buf = _segment(h)
        assert layout.unpack(buf, len(buf)) == h
        assert layout.unpack(memoryview(buf), len(buf)) == h
        assert layout.unpack(bytes(buf), len(buf)).dtype == dtype
        assert h.data_offset % ALIGNMENT == 0
        assert _header_len(h) <= h.data_offset < _header_len(h) + ALIGNMENT
        assert h.nbytes == int(np.prod(shape)) * dtype.itemsize


def test_pack_unpack_ml_dtypes_round_trip() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        h = _header(t, (4, 4))
        assert _segment(h).count(b"ml_dtypes:" + t.__name__.encode()) == 1
        assert layout.unpack(_segment(h), h.segment_size) == h


def test_template_data_offset_is_aligned_and_covers_header() -> None:
    for key in ["", "k", "x" * 1000, KEY]:
        for ndim in (0, 1, 7, 64):
            off = layout.Template(np.dtype("f4"), (1,) * ndim, len(key.encode())).data_offset
            assert off % 64 == 0
            assert off >= PREFIX.size + 8 * ndim + 3 + len(key.encode())
    with pytest.raises(InvalidArgumentError):
        layout.Template(np.dtype("f4"), (1,) * 65, len(KEY))


def test_pack_object_dtype_refused() -> None:
    for dt in (np.dtype(object), np.dtype([("a", "i4"), ("o", "O")])):
        with pytest.raises(InvalidArgumentError, match="Python objects"):
            _header(dt, (2,))


def test_pack_key_too_long_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="too long"):
        _header(key="k" * (layout.MAX_KEY_BYTES + 1))


# --- corruption: every branch of unpack -------------------------------------------------


def _valid() -> tuple[Header, bytearray]:
    h = _header("<f4", (3, 5))
    return h, _segment(h)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"magic": b"NOTSHMRD"}, "magic"),
        ({"version": VERSION + 1}, "version"),
        ({"flags": 0x8000}, "flags"),
        ({"ndim": 65}, "ndim"),
        ({"key_len": layout.MAX_KEY_BYTES + 1}, "key length"),
        ({"dtype_len": 2**32 - 1}, "dtype length"),
        ({"header_len": 12}, "header length"),
        ({"key_len": 4000, "header_len": PREFIX.size + 16 + 3 + 4000}, "past the end"),
        ({"data_offset": 128}, "data offset"),  # inside the header
        ({"data_offset": 1024 + 8}, "data offset"),  # unaligned
        ({"nbytes": 10**9}, "past the end of the file"),
        ({"data_offset": 2**64 - 64}, "data offset"),
        ({"slot": -5}, "slot"),
        ({"nbytes": 56}, "nbytes"),
    ],
)
def test_unpack_corrupted_prefix_raises_internal(fields: dict[str, Any], match: str) -> None:
    _, buf = _valid()
    with pytest.raises(InternalError, match=f"segment header corrupted: .*{match}"):
        layout.unpack(_with(buf, **fields), len(buf))


def test_unpack_short_buffer_raises_internal() -> None:
    _, buf = _valid()
    for n in (0, 1, PREFIX.size - 1):
        with pytest.raises(InternalError, match="corrupted: only"):
            layout.unpack(buf[:n], n)
    with pytest.raises(InternalError, match="past the end"):
        layout.unpack(buf[: PREFIX.size + 10], len(buf))  # buffer shorter than the header
    with pytest.raises(InternalError, match="past the end"):
        layout.unpack(buf, PREFIX.size + 10)  # file shorter than the header


def test_unpack_data_past_file_raises_internal() -> None:
    h, buf = _valid()
    with pytest.raises(InternalError, match="past the end of the file"):
        layout.unpack(buf, h.segment_size - 1)


def _replace_dtype(buf: bytearray, h: Header, descr: bytes) -> bytearray:
    """``buf`` with its dtype descriptor replaced (key moved, lengths fixed)."""
    ndim = len(h.shape)
    key = h.key.encode()
    end = PREFIX.size + 8 * ndim + len(descr) + len(key)
    out = bytearray(max(len(buf), -(-end // 64) * 64 + h.nbytes))
    out[: PREFIX.size + 8 * ndim] = buf[: PREFIX.size + 8 * ndim]
    out[PREFIX.size + 8 * ndim : end] = descr + key
    offset = -(-end // 64) * 64
    return _with(out, dtype_len=len(descr), header_len=end, data_offset=offset)


@pytest.mark.parametrize(
    "descr",
    [
        b"<zz",
        b"\xff\xfe",
        b"",
        b"|O8",  # object
        b'json:[["a", "|O8"]]',  # object field
        b'json:"<f4"',  # the structured tag on a plain dtype
        b"json:[[",
        b"json:" + b"[" * 5000 + b"]" * 5000,  # recursion
        b'json:{"a": 1}',
        b'json:[["a"]]',
        b"ml_dtypes:Nope",
        b"ml_dtypes:no_such_type",
        b"ml_dtypes:__name__",
        b"<f4; import os",
    ],
)
def test_unpack_bad_dtype_raises_internal(descr: bytes) -> None:
    import gc

    h, buf = _valid()
    bad = _replace_dtype(buf, h, descr)
    # No collection inside the 5,000-deep parse: an earlier test's garbage finalized at
    # that depth made pytest's unraisable hook itself hit the recursion limit (seen in CI).
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(InternalError, match="segment header corrupted: dtype"):
            layout.unpack(bad, len(bad))
    finally:
        gc.enable()


def test_unpack_dtype_of_wrong_size_raises_internal() -> None:
    h, buf = _valid()
    bad = _replace_dtype(buf, h, b"<f8")  # nbytes stays that of float32
    with pytest.raises(InternalError, match="nbytes"):
        layout.unpack(bad, len(bad))


def test_unpack_shape_too_large_for_numpy_raises_internal() -> None:
    _, buf = _valid()
    bad = bytearray(buf)
    struct.pack_into("<2Q", bad, PREFIX.size, 0, 2**62)  # 0 elements, but numpy refuses it
    bad = _with(bad, nbytes=0)
    with pytest.raises(InternalError, match="more than 1099511627776 elements"):
        layout.unpack(bad, len(bad))


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("|V0", (2**62,)), ("|S0", (2**40,)), ("<U0", (2**25,)), ("|V0", (2**31, 2**31))],
)
def test_unpack_zero_itemsize_huge_shape_raises_internal(
    dtype: str, shape: tuple[int, ...]
) -> None:
    """Issue 13 §3: nbytes is 0, so only an element bound independent of the item size
    (``_values.shape_problem``) refuses it; numpy would hang or raise MemoryError."""
    h = _header(dtype=dtype, shape=shape)
    assert h.nbytes == 0
    buf = _segment(h)
    with pytest.raises(InternalError, match=r"segment header corrupted: shape .* elements"):
        layout.unpack(buf, len(buf))


def test_unpack_zero_itemsize_within_bound_round_trips() -> None:
    h = _header(dtype="|V0", shape=(1000, 3))
    buf = _segment(h)
    assert layout.unpack(buf, len(buf)) == h


def test_unpack_key_not_utf8_raises_internal() -> None:
    _, buf = _valid()
    bad = bytearray(buf)
    key_at = PREFIX.size + 16 + 3
    bad[key_at : key_at + 2] = b"\xc3\x28"
    with pytest.raises(InternalError, match="key is not UTF-8"):
        layout.unpack(bad, len(bad))


def test_unpack_ml_dtypes_missing_raises_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ml_dtypes")
    h = _header("<f4", (2,))
    buf = _replace_dtype(_segment(h), h, b"ml_dtypes:bfloat16")
    buf = _with(buf, nbytes=4)
    layout.decode_dtype.cache_clear()
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` fail
    try:
        with pytest.raises(InternalError, match="ml_dtypes is not installed"):
            layout.unpack(buf, len(buf))
    finally:
        layout.decode_dtype.cache_clear()


# --- property tests ---------------------------------------------------------------------

_scalar = hnp.scalar_dtypes() | hnp.byte_string_dtypes() | hnp.unicode_string_dtypes()
_any_dtype = _scalar | hnp.nested_dtypes(_scalar, max_leaves=5) | hnp.array_dtypes(_scalar)


@settings(max_examples=300, deadline=None)
@given(
    dtype=_any_dtype,
    shape=hnp.array_shapes(min_dims=0, max_dims=6, min_side=0, max_side=4),
    key=st.text(max_size=200),
    step_id=st.integers(-(2**63), 2**63 - 1),
    seq=st.integers(0, 2**64 - 1),
    inc=st.integers(0, 2**64 - 1),
    pid=st.integers(0, 2**32 - 1),
    slot=st.integers(-1, 2**63 - 1),
    dead=st.booleans(),
)
def test_pack_unpack_round_trip_fuzz(
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    key: str,
    step_id: int,
    seq: int,
    inc: int,
    pid: int,
    slot: int,
    dead: bool,
) -> None:
    h = build_header(
        key=key,
        dtype=dtype,
        shape=shape,
        step_id=step_id,
        seq=seq,
        producer_incarnation=inc,
        producer_pid=pid,
        slot=slot,
        is_dead=dead,
    )
    buf = _segment(h)
    got = layout.unpack(buf, len(buf))
    assert got == h
    arr = np.ndarray(got.shape, got.dtype, buffer=buf, offset=got.data_offset)
    assert arr.nbytes == got.nbytes


def _check_garbage(data: bytes, file_size: int) -> None:
    try:
        h = layout.unpack(data, file_size)
    except InternalError as e:
        assert str(e).startswith("segment header corrupted") or "ml_dtypes" in str(e)
        return
    # Whatever passes is usable: numpy can build the array over a file of that size.
    assert h.data_offset + h.nbytes <= file_size
    np.ndarray(h.shape, h.dtype, buffer=bytearray(file_size), offset=h.data_offset)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 4096))
def test_unpack_fuzz_random_bytes_only_internal(data: bytes, file_size: int) -> None:
    _check_garbage(data, file_size)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(["<f4", "|S3", "<U2", "json", "<c16"]),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(-8, 8),
)
def test_unpack_fuzz_mutated_header_only_internal(
    kind: str, flips: list[tuple[int, int]], size_delta: int
) -> None:
    dtype = np.dtype([("a", "<i2"), ("b", "<f4", (2,))]) if kind == "json" else np.dtype(kind)
    buf = _segment(_header(dtype, (2, 3)))
    for at, value in flips:
        if at < len(buf):
            buf[at] = value
    _check_garbage(bytes(buf), max(0, len(buf) + size_delta))


# --- Template: the one writer -------------------------------------------------------------

TKEY = "/job:w/replica:0/task:0/device:CPU:0;0000000000000001;/job:w/replica:0/task:1/device:CPU:0;e;0:0"


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.dtype("<f4"), (16,)), (np.dtype("|S3"), (2, 0, 5)), (np.dtype([("a", "<i2")]), ())],
)
def test_template_write_round_trips_every_field(
    dtype: np.dtype[Any], shape: tuple[int, ...]
) -> None:
    t = layout.Template(dtype, shape, len(TKEY.encode()))
    got = bytearray(t.data_offset)
    t.write(got, 0, TKEY.encode(), 1, -7, 3, 2**64 - 1, 42, 5, 123)
    h = build_header(
        key=TKEY,
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
    assert layout.unpack(got, h.segment_size) == h


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.dtype("<f4"), (16,)), (np.dtype("|S3"), (2, 0, 5)), (np.dtype([("a", "<i2")]), ())],
)
def test_template_record_is_the_header_then_the_data(
    dtype: np.dtype[Any], shape: tuple[int, ...]
) -> None:
    t = layout.Template(dtype, shape, len(TKEY.encode()))
    data = bytes(range(256)) * (t.nbytes // 256) + bytes(range(t.nbytes % 256))
    record = bytearray(8 + t.data_offset + t.nbytes)  # written at 8, as in a ring record
    for step, seq, inc, pid, slot, created in [(-7, 3, 2**64 - 1, 42, 5, 123), (9, 0, 1, 7, -1, 0)]:
        t.write(record, 8, TKEY.encode(), 0, step, seq, inc, pid, slot, created, data)
        want = bytearray(t.data_offset)
        t.write(want, 0, TKEY.encode(), 0, step, seq, inc, pid, slot, created)
        assert record[8:] == want + data
        h = layout.unpack(record[8:], t.segment_size)
        assert (h.step_id, h.seq, h.producer_incarnation, h.slot, h.is_dead) == (
            step,
            seq,
            inc,
            slot,
            False,
        )


def test_template_field_out_of_range_refused() -> None:
    t = layout.Template(np.dtype("<f8"), (2,), len(TKEY))
    buf = bytearray(t.data_offset + t.nbytes)
    with pytest.raises(InternalError, match="out of range"):
        t.write(buf, 0, TKEY.encode(), 0, 2**63, 0, 1, 1, -1, 0)
    with pytest.raises(InternalError, match="out of range"):
        t.write(buf, 0, TKEY.encode(), 0, 1, -1, 1, 1, -1, 0, bytes(t.nbytes))


# --- Reader: the one checked reader, with its one cache ------------------------------------


def _record(seq: int, flags: int = 0, key: bytes = TKEY.encode()) -> bytearray:
    t = layout.Template(np.dtype("<f4"), (16,), len(key))
    buf = bytearray(t.data_offset + 64)
    t.write(buf, 0, key, flags, 1, seq, 9, 9, -1, 0)
    return buf


def _span(reader: layout.Reader, rec: bytearray) -> layout.Fields:
    """``reader.read`` of ``rec`` placed, as in a ring, after 64 bytes and before others."""
    ring = bytearray(64) + rec + b"\xff" * 64
    return reader.read(memoryview(ring), 64, 64 + len(rec))


def test_reader_answers_as_unpack_fields() -> None:
    reader = layout.Reader()
    for seq in range(3):
        rec = _record(seq)
        assert _span(reader, rec) == layout.unpack_fields(rec, len(rec))
        assert reader.read(rec, 0, len(rec), record=False) == layout.unpack_fields(rec, len(rec))


def test_reader_decodes_each_key_and_refuses_a_bad_one() -> None:
    """New keys of a known (dtype, shape, key length) are answered from the cache (one
    entry for them all); each key is decoded."""
    reader = layout.Reader()
    for name in ("a", "b", "c"):
        key = TKEY.replace(";e;", f";{name};").encode()
        rec = _record(0, key=key)
        got = _span(reader, rec)
        assert got == layout.unpack_fields(rec, len(rec))
        assert got[11] == key.decode()
    assert len(reader._known) == 1
    bad = _record(1, key=TKEY.replace(";e;", ";\xff;").encode("latin-1"))
    with pytest.raises(InternalError, match="UTF-8"):
        _span(reader, bad)


def test_reader_still_checks_the_changing_fields() -> None:
    reader = layout.Reader()
    _span(reader, _record(0))  # now known
    with pytest.raises(InternalError, match="flags"):
        _span(reader, _record(1, flags=0x80))
    short = _record(2)
    with pytest.raises(InternalError, match="past the end"):
        _span(reader, short[:-8])  # the data would run past the record
    moved = _record(3)
    moved[16:24] = (64).to_bytes(8, "little")  # data_offset 256 -> 64: inside the header
    with pytest.raises(InternalError, match="data offset"):
        _span(reader, moved)


def test_reader_checks_inline_data_but_not_a_notices() -> None:
    """A ring record's data must lie in it, a notice's (``FLAG_NOTICE``) is in a segment,
    so only its header must."""
    reader = layout.Reader()
    for _ in range(2):  # new, then from the cache
        rec = _record(3)
        f = layout.unpack_fields(rec, len(rec))
        assert _span(reader, rec) == f
        notice = _record(4, flags=layout.FLAG_NOTICE)[: f[3]]  # the header only
        got = _span(reader, notice)
        assert got[0] == layout.FLAG_NOTICE and got[4] == 64 and got[6] == 4
        with pytest.raises(InternalError, match="past the end"):
            _span(reader, _record(5)[: f[3]])  # inline, but its data is cut off
        # A span ending inside the header: the bytes after it are not read as the record's.
        size = int.from_bytes(notice[12:16], "little")
        with pytest.raises(InternalError, match="past the end"):
            reader.read(memoryview(notice), 0, size - 8)


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
    assert layout.unpack_identity(rec) == (1, 5, TKEY)


@pytest.mark.parametrize(("at", "raw", "match"), HEADER_CORRUPTIONS)
def test_reader_checks_every_field_of_a_known_key(at: int, raw: bytes, match: str) -> None:
    """A corrupted record of a (dtype, shape) the reader knows gets ``unpack_fields``'
    refusal."""
    reader = layout.Reader()
    rec = _record(0)
    rec.extend(bytes(256))  # room for a moved data offset, so only the named check fails
    _span(reader, rec)  # now known
    bad = bytearray(rec)
    bad[at : at + len(raw)] = raw
    with pytest.raises(InternalError, match=match):
        _span(reader, bad)
    with pytest.raises(InternalError, match=match):
        layout.unpack_fields(bad, len(bad))
    assert _span(reader, rec)[6] == 0  # the intact one is still answered
