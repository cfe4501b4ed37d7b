"""shmrdv/_rpc/{wire,tensors,tf_dtypes,messages,assembly}.py against the generated protobuf classes.

Byte-for-byte: our RecvTensorResponse is TensorFlow's order (fields 2, 3, 5, then the
tensor), which equals the concatenation of two canonical serialisations, and parses to
the same message as the canonical one.
"""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shmrdv._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from shmrdv._rpc import assembly, mark_finished, messages, status, tf_dtypes, wire
from shmrdv._rpc.proto import (
    device_attributes_pb2,
    rendezvous_pb2,
    tensor_pb2,
    tensor_shape_pb2,
    worker_pb2,
)

ml_dtypes = pytest.importorskip("ml_dtypes")

# TensorFlow's codes (tensorflow/core/framework/types.proto), written out again here
# so that the table in tf_dtypes.py is checked against an independent copy.
TF_CODES: dict[str, int] = {
    "float32": 1,
    "float64": 2,
    "int32": 3,
    "uint8": 4,
    "int16": 5,
    "int8": 6,
    "complex64": 8,
    "int64": 9,
    "bool": 10,
    "uint16": 17,
    "complex128": 18,
    "float16": 19,
    "uint32": 22,
    "uint64": 23,
}
ML_CODES = {
    "bfloat16": 14,
    "float8_e5m2": 24,
    "float8_e4m3fn": 25,
    "float8_e4m3fnuz": 26,
    "float8_e5m2fnuz": 28,
}
WIRE_ERRORS = (InvalidArgumentError, InternalError)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tf_string_list(items: list[bytes]) -> bytes:
    # TensorFlow: port::EncodeStringList, varint32 lengths first, then the bytes.
    return b"".join(_varint(len(s)) for s in items) + b"".join(items)


def _le(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype if dtype.type.__module__.startswith("ml_dtypes") else dtype.newbyteorder("<")


def _expected_tensor(arr: npt.NDArray[Any]) -> tensor_pb2.TensorProto:
    """The TensorProto TensorFlow (plus the shmrdv extension) would carry for ``arr``."""
    t = tensor_pb2.TensorProto()
    dt = arr.dtype
    name = dt.name if dt.isnative or dt.byteorder == "|" else _le(dt).name
    if dt.kind == "S":
        t.dtype = 7
        t.tensor_content = _tf_string_list([bytes(x) for x in arr.reshape(-1).tolist()])
        t.shmrdv_dtype = dt.str
    else:
        code = TF_CODES.get(name, ML_CODES.get(name, 0))
        t.dtype = code  # type: ignore[assignment]
        wire_arr = np.ascontiguousarray(arr)
        if dt != _le(dt):
            wire_arr = wire_arr.astype(_le(dt))
        t.tensor_content = wire_arr.tobytes()
        if code == 0 or dt != _le(dt):
            t.shmrdv_dtype = tf_dtypes.dtype_descriptor(dt)
    for size in arr.shape:
        t.tensor_shape.dim.add(size=size)
    return t


def _expected_response(
    arr: npt.NDArray[Any], is_dead: bool, ssm: int, ack: bool
) -> tuple[bytes, bytes]:
    """(TensorFlow's order: fields 2,3,5 then 1; canonical serialisation)."""
    t = _expected_tensor(arr)
    head = worker_pb2.RecvTensorResponse(is_dead=is_dead, send_start_micros=ssm, require_ack=ack)
    full = worker_pb2.RecvTensorResponse(
        tensor=t, is_dead=is_dead, send_start_micros=ssm, require_ack=ack
    )
    tf_order = (
        head.SerializeToString() + worker_pb2.RecvTensorResponse(tensor=t).SerializeToString()
    )
    return tf_order, full.SerializeToString()


def _same(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def _sample_arrays() -> list[npt.NDArray[Any]]:
    rng = np.random.default_rng(7)
    out: list[npt.NDArray[Any]] = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.float64(-2.5),  # type: ignore[list-item]
        np.array(7, dtype=np.int64),
        np.array(True),
        np.zeros((0,), np.float32),
        np.zeros((2, 0, 3), np.int16),
        rng.integers(-128, 127, size=(5, 1, 2), dtype=np.int8),
        rng.integers(0, 2**63, size=7, dtype=np.uint64),
        rng.standard_normal(9).astype(np.complex64) * 1j,
        np.array([1 + 2j, np.nan], np.complex128),
        np.array([np.inf, -0.0, np.nan, 65504], np.float16),
        np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian input
        np.arange(5, dtype=np.uint16)[::2],  # not contiguous
        np.asfortranarray(np.arange(6, dtype=np.uint32).reshape(2, 3)),
        np.array([b"ab", b"", b"x" * 7, b"\x00z"], "S7"),
        np.array(b"scalar"),
        np.array([["hé", "ü"], ["", "x"]], "U2"),
        np.array(["big"], ">U3"),
        np.arange(4).astype("M8[ms]"),
        np.arange(3).astype(">m8[s]"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", ">f8", (2,)), ("c", "S3")]),
        np.zeros(
            3, dtype=np.dtype({"names": ["x"], "formats": ["u1"], "offsets": [2], "itemsize": 8})
        ),
        np.frombuffer(b"\x01\x02\x03\x04\x05\x06", "V3"),
        np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
        np.ones(3, ml_dtypes.float8_e4m3fn),
        np.arange(4).astype(ml_dtypes.int4),
    ]
    return out


SAMPLES = _sample_arrays()
IDS = [f"{a.dtype}-{a.shape}" for a in SAMPLES]


# ------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name,code", sorted({**TF_CODES, **ML_CODES}.items()))
def test_dtype_to_tf_uses_tensorflow_codes(name: str, code: int) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name)) if name in ML_CODES else np.dtype(name)
    assert tf_dtypes.dtype_to_tf(dtype) == code
    assert tf_dtypes.tf_to_dtype(code) == dtype
    assert (
        tf_dtypes.dtype_to_tf(dtype.newbyteorder(">") if dtype.byteorder != "|" else dtype) == code
    )


def test_dtype_to_tf_enum_matches_generated_enum() -> None:
    from shmrdv._rpc.proto import types_pb2

    for member in tf_dtypes.DataType:
        assert types_pb2.DataType.Value(member.name) == member.value


@pytest.mark.parametrize("dtype", ["U3", "M8[ns]", "m8", "V4", "i4,f8", "S0"])
def test_dtype_to_tf_types_tensorflow_lacks_are_invalid_or_string(dtype: str) -> None:
    expected = 7 if dtype.startswith("S") else 0
    assert tf_dtypes.dtype_to_tf(np.dtype(dtype)) == expected


def test_dtype_descriptor_structured_with_ml_dtypes_field_refused() -> None:
    dtype = np.dtype([("a", ml_dtypes.bfloat16), ("b", "<i4", (2,))])
    with pytest.raises(InvalidArgumentError, match="ml_dtypes"):
        messages.encode_response(np.zeros(2, dtype), is_dead=False)


def test_dtype_to_tf_object_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="Python objects"):
        tf_dtypes.dtype_to_tf(np.dtype(object))
    with pytest.raises(InvalidArgumentError, match="Python objects"):
        tf_dtypes.dtype_to_tf(np.dtype([("a", "i4"), ("b", "O")]))


@pytest.mark.parametrize("code", [0, 20, 21, 27, 29, 101, 1000, -1])
def test_tf_to_dtype_codes_without_numpy_kind_refused(code: int) -> None:
    with pytest.raises(InvalidArgumentError, match="no numpy dtype"):
        tf_dtypes.tf_to_dtype(code)


def test_tf_to_dtype_quantized_gives_storage_integer() -> None:
    assert tf_dtypes.tf_to_dtype(11) == np.int8
    assert tf_dtypes.tf_to_dtype(13) == np.int32


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
def test_dtype_descriptor_round_trips(arr: npt.NDArray[Any]) -> None:
    text = tf_dtypes.dtype_descriptor(arr.dtype)
    assert tf_dtypes.dtype_from_descriptor(text) == arr.dtype


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nonsense",
        "[('a', 'O')]",
        "O",
        "ml_dtypes.nope",
        "[(",
        "__import__('os')",
        "[" * 5000,
        "x" * 70000,
    ],
    ids=lambda text: repr(text[:16]),
)
def test_dtype_from_descriptor_garbage_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        tf_dtypes.dtype_from_descriptor(text)


# ---------------------------------------------------------------- encode_response


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
@pytest.mark.parametrize(
    "is_dead,ssm,ack", [(False, 0, False), (True, 1_700_000_000_123_456, True), (False, -3, False)]
)
def test_encode_response_bytes_equal_generated(
    arr: npt.NDArray[Any], is_dead: bool, ssm: int, ack: bool
) -> None:
    ours = messages.encode_response(arr, is_dead=is_dead, send_start_micros=ssm, require_ack=ack)
    tf_order, canonical = _expected_response(arr, is_dead, ssm, ack)
    assert ours == tf_order
    assert worker_pb2.RecvTensorResponse.FromString(ours).SerializeToString() == canonical


@pytest.mark.parametrize("arr", [a for a in SAMPLES if a.ndim == 0], ids=lambda a: str(a.dtype))
def test_encode_response_scalar_has_no_shape_field(arr: npt.NDArray[Any]) -> None:
    msg = worker_pb2.RecvTensorResponse.FromString(messages.encode_response(arr, is_dead=False))
    assert not msg.tensor.HasField("tensor_shape")


def test_encode_response_tensor_bytes_come_last_in_tensorflow_order() -> None:
    arr = np.arange(300, dtype=np.float64)  # > kLargeTensorBytes = 1024
    ours = messages.encode_response(arr, is_dead=True, send_start_micros=5, require_ack=True)
    # A: is_dead, send_start_micros, require_ack; B: tag 0x0a; then the tensor.
    assert ours.startswith(b"\x10\x01\x18\x05\x28\x01\x0a")
    assert ours.endswith(arr.tobytes())


def test_encode_response_dt_string_follows_tensorflow_string_list() -> None:
    arr = np.array([b"ab", b"", b"x" * 200], "S200")
    msg = worker_pb2.RecvTensorResponse.FromString(messages.encode_response(arr, is_dead=False))
    assert msg.tensor.dtype == 7
    assert msg.tensor.tensor_content == b"\x02\x00\xc8\x01" + b"ab" + b"x" * 200
    assert msg.tensor.shmrdv_dtype == "|S200"


def test_encode_response_object_array_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="Python objects"):
        messages.encode_response(np.array([1, "a"], dtype=object), is_dead=False)
    with pytest.raises(InvalidArgumentError, match="only numpy arrays"):
        messages.encode_response([1, 2], is_dead=False)  # type: ignore[arg-type]


def test_encode_response_masked_array_refused_memmap_encoded(tmp_path: Any) -> None:
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(InvalidArgumentError, match=r"cannot encode a numpy\.ma\.MaskedArray.*mask"):
        messages.encode_response(masked, is_dead=False)
    mapped = np.memmap(tmp_path / "m", dtype=np.int32, mode="w+", shape=(4, 3))
    mapped[:] = np.arange(12, dtype=np.int32).reshape(4, 3)
    got = messages.decode_response(messages.encode_response(mapped, is_dead=False)).value
    assert type(got) is np.ndarray
    assert got.dtype == np.int32 and got.tolist() == np.asarray(mapped).tolist()
    del mapped


def test_encode_response_over_2gib_refused_before_copying() -> None:
    try:
        arr = np.empty(1 << 31, np.uint8)  # never written: its pages are never touched
    except MemoryError:
        pytest.skip("cannot reserve 2 GiB of address space here")
    with pytest.raises(ResourceExhaustedError, match="2 GiB"):
        messages.encode_response(arr, is_dead=False)


# ---------------------------------------------------------------- decode_response


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
def test_decode_response_reads_generated_bytes(arr: npt.NDArray[Any]) -> None:
    _, canonical = _expected_response(arr, True, 42, True)
    got = messages.decode_response(canonical)
    assert _same(got.value, np.asarray(arr))
    assert (got.is_dead, got.send_start_micros, got.require_ack) == (True, 42, True)


def test_decode_response_numeric_is_read_only_view_of_message() -> None:
    data = messages.encode_response(np.arange(10, dtype=np.int32), is_dead=False)
    got = messages.decode_response(data)
    assert not got.value.flags.writeable
    assert np.shares_memory(got.value, np.frombuffer(data, np.uint8))


def test_decode_response_tensorflow_skeleton_with_zero_dims_and_empty_content() -> None:
    # TensorFlow's hand-written skeleton writes Dim{size: 0} as 08 00 and an empty
    # tensor_content field; canonical protobuf leaves both out.
    tensor = b"\x08\x01" + b"\x12\x08" + b"\x12\x02\x08\x02" + b"\x12\x02\x08\x00" + b"\x22\x00"
    data = b"\x18\x07" + b"\x0a" + bytes([len(tensor)]) + tensor
    got = messages.decode_response(data)
    assert got.value.dtype == np.float32 and got.value.shape == (2, 0)
    assert got.send_start_micros == 7


def test_decode_response_accepts_fields_in_any_order() -> None:
    arr = np.arange(6, dtype=np.int16).reshape(3, 2)
    msg = worker_pb2.RecvTensorResponse.FromString(
        messages.encode_response(arr, is_dead=True, send_start_micros=9, require_ack=True)
    )
    t = msg.tensor
    pieces = [
        tensor_pb2.TensorProto(tensor_content=t.tensor_content).SerializeToString(),
        tensor_pb2.TensorProto(tensor_shape=t.tensor_shape).SerializeToString(),
        tensor_pb2.TensorProto(dtype=t.dtype).SerializeToString(),
        tensor_pb2.TensorProto(version_number=1).SerializeToString(),
    ]
    fields = [
        b"\x0a" + _varint(len(b"".join(pieces))) + b"".join(pieces),
        b"\x10\x01",
        b"\x18\x09",
        b"\x28\x01",
        b"\x22\x00",  # transport_options: an empty Any
        b"\xa0\x06\x05",  # an unknown field 100
    ]
    for seed in range(5):
        random.Random(seed).shuffle(fields)
        got = messages.decode_response(b"".join(fields))
        assert _same(got.value, arr) and got.is_dead and got.require_ack
        assert got.send_start_micros == 9


def test_decode_response_repeated_tensor_fields_merge_like_protobuf() -> None:
    shape_a = tensor_pb2.TensorProto(dtype=1)
    shape_a.tensor_shape.dim.add(size=2)
    part2 = tensor_pb2.TensorProto(tensor_content=np.arange(6, dtype=np.float32).tobytes())
    part2.tensor_shape.dim.add(size=3)
    data = (
        worker_pb2.RecvTensorResponse(tensor=shape_a).SerializeToString()
        + worker_pb2.RecvTensorResponse(tensor=part2).SerializeToString()
    )
    reference = worker_pb2.RecvTensorResponse.FromString(data)
    assert [d.size for d in reference.tensor.tensor_shape.dim] == [2, 3]
    assert messages.decode_response(data).value.shape == (2, 3)


def test_decode_response_typed_val_fields_refused() -> None:
    t = tensor_pb2.TensorProto(dtype=1, float_val=[1.0, 2.0])
    t.tensor_shape.dim.add(size=2)
    data = worker_pb2.RecvTensorResponse(tensor=t).SerializeToString()
    with pytest.raises(InvalidArgumentError, match="float_val is not supported"):
        messages.decode_response(data)


def test_decode_response_dead_without_tensor_gives_empty_float() -> None:
    got = messages.decode_response(worker_pb2.RecvTensorResponse(is_dead=True).SerializeToString())
    assert got.is_dead and got.value.dtype == np.float32 and got.value.shape == (0,)


@pytest.mark.parametrize(
    "tensor",
    [
        tensor_pb2.TensorProto(dtype=1, tensor_content=b"\x00" * 7),  # scalar needs 4
        tensor_pb2.TensorProto(dtype=0, tensor_content=b"\x00" * 4),  # no dtype at all
        tensor_pb2.TensorProto(dtype=20),  # DT_RESOURCE
        tensor_pb2.TensorProto(dtype=1, shmrdv_dtype="<U3"),  # contradiction
        tensor_pb2.TensorProto(dtype=0, shmrdv_dtype="|O"),
        tensor_pb2.TensorProto(
            dtype=1, tensor_shape=tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
        ),
    ],
    ids=["size", "invalid", "resource", "contradiction", "object", "unknown-rank"],
)
def test_decode_response_impossible_tensor_refused(tensor: tensor_pb2.TensorProto) -> None:
    data = worker_pb2.RecvTensorResponse(tensor=tensor).SerializeToString()
    with pytest.raises(InvalidArgumentError, match="Cannot parse tensor from response"):
        messages.decode_response(data)


def test_decode_response_negative_dim_refused() -> None:
    t = tensor_pb2.TensorProto(dtype=1)
    t.tensor_shape.dim.add(size=-1)
    with pytest.raises(InvalidArgumentError, match="unknown"):
        messages.decode_response(worker_pb2.RecvTensorResponse(tensor=t).SerializeToString())


@pytest.mark.parametrize("dtype", [1, 7, 0])
def test_decode_response_huge_declared_shape_refused_without_allocating(dtype: int) -> None:
    t = tensor_pb2.TensorProto(dtype=dtype, tensor_content=b"\x01" * 16)  # type: ignore[arg-type]
    if dtype == 0:
        t.shmrdv_dtype = "|V0"  # zero itemsize: no content size to compare against
    for size in (2**30, 2**30, 2**30):
        t.tensor_shape.dim.add(size=size)
    data = worker_pb2.RecvTensorResponse(tensor=t).SerializeToString()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError):
            messages.decode_response(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_decode_response_dt_string_huge_declared_width_refused() -> None:
    t = tensor_pb2.TensorProto(dtype=7, tensor_content=b"\x00" * 64, shmrdv_dtype="|S2147483647")
    t.tensor_shape.dim.add(size=64)
    data = worker_pb2.RecvTensorResponse(tensor=t).SerializeToString()
    with pytest.raises(InvalidArgumentError, match="exceed this host's memory"):
        messages.decode_response(data)


# ----------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    "step_id,key,request_id,dma_ok",
    [
        (0, "", 0, False),
        (
            7,
            "/job:w/replica:0/task:0/device:CPU:0;0000000000000001;/job:w/replica:0/task:1/device:CPU:0;x;0:0",
            12345,
            False,
        ),
        (-1, "ключ;é", -(2**63), True),
        (2**63 - 1, "k", 2**63 - 1, True),
    ],
)
def test_encode_request_bytes_equal_generated(
    step_id: int, key: str, request_id: int, dma_ok: bool
) -> None:
    ours = messages.encode_request(step_id, key, request_id, dma_ok)
    ref = worker_pb2.RecvTensorRequest(
        step_id=step_id, rendezvous_key=key, request_id=request_id, dma_ok=dma_ok
    )
    assert ours == ref.SerializeToString()
    assert messages.decode_request(ours) == messages.RecvRequest(step_id, key, request_id, dma_ok)


_INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(
    step_id=_INT64,
    key=st.text(max_size=300),
    request_id=_INT64,
    acks=st.lists(_INT64, max_size=5),
    inline_max=st.integers(-1, 2**63 - 1),
)
def test_encode_request_varints_agree_with_wire(
    step_id: int, key: str, request_id: int, acks: list[int], inline_max: int
) -> None:
    # The request is written in one pass (issue 19 §2): its bytes must be what wire's
    # fields make, for any int64 (1- to 10-byte varints) and key length.
    ours = messages.encode_request(step_id, key, request_id, finished=acks, inline_max=inline_max)
    encoded = key.encode("utf-8")
    expected = (
        wire.int_field(1, step_id)
        + (wire.len_field(2, encoded) if encoded else b"")
        + wire.int_field(7, request_id)
        + b"".join(wire.encode_tag(1001, wire.VARINT) + wire.encode_varint(a) for a in acks)
        + (
            wire.encode_tag(1002, wire.VARINT) + wire.encode_varint(inline_max)
            if inline_max >= 0
            else b""
        )
    )
    assert ours == expected
    got = messages.decode_request(ours)
    assert (got.step_id, got.rendezvous_key, got.request_id) == (step_id, key, request_id)
    assert got.finished == tuple(acks) and got.inline_max == inline_max
    assert messages.decode_request(memoryview(ours)) == got  # the general reader agrees


@settings(max_examples=200, deadline=None)
@given(
    arr=hnp.arrays(
        st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_, np.complex64]),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=1100).filter(
            lambda shape: int(np.prod(shape)) <= 50_000
        ),
    ),
    transpose=st.booleans(),
)
def test_encode_response_plain_arrays_equal_generated(
    arr: npt.NDArray[Any], transpose: bool
) -> None:
    # Plain arrays take the short way through tensor_parts (sizes 0 and over 1024 too;
    # a transposed one is not C-contiguous and goes the general way): TensorFlow's bytes.
    arr = arr.T if transpose else arr
    ours = messages.encode_response(arr, is_dead=False, send_start_micros=7, require_ack=True)
    tf_order, canonical = _expected_response(arr, False, 7, True)
    assert ours == tf_order
    assert worker_pb2.RecvTensorResponse.FromString(ours).SerializeToString() == canonical


@pytest.mark.parametrize(
    "shape", [(1,), (127,), (128,), (16384,), (3, 70000), (2**21 + 1,), (1, 1, 300)]
)
def test_decode_received_reads_long_varints_as_the_general_decoder(
    shape: tuple[int, ...],
) -> None:
    # The usual layout is read in one pass: sizes and dims of 1 to 4 varint bytes give
    # what decode_response gives, and a truncated response is refused.
    value = np.arange(int(np.prod(shape)), dtype=np.uint8).reshape(shape)
    data = messages.encode_response(value, is_dead=False)
    got = messages.decode_received(data)
    ref = messages.decode_response(data)
    assert got.value.shape == ref.value.shape and got.value.dtype == ref.value.dtype
    assert np.array_equal(got.value, ref.value) and got.value.flags.writeable
    with pytest.raises(InvalidArgumentError):
        messages.decode_received(data[:-1])


def test_decode_request_skips_localities_and_transport_options() -> None:
    ref = worker_pb2.RecvTensorRequest(step_id=3, rendezvous_key="k", request_id=9)
    ref.client_locality.bus_id = 1
    ref.client_locality.links.link.add(device_id=2, type="NVLINK", strength=3)
    ref.server_locality.numa_node = 1
    ref.transport_options.type_url = "type.googleapis.com/x.Y"
    ref.transport_options.value = b"\x00\x01"
    got = messages.decode_request(ref.SerializeToString())
    assert got == messages.RecvRequest(3, "k", 9, False)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, True])
def test_encode_request_out_of_range_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        messages.encode_request(bad, "k", 1)


def test_decode_request_invalid_utf8_key_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="UTF-8"):
        messages.decode_request(b"\x12\x02\xff\xfe")


@pytest.mark.parametrize("request_id", [0, 1, -5, 2**63 - 1])
def test_encode_mark_recv_finished_bytes_equal_generated(request_id: int) -> None:
    ours = mark_finished.encode_mark_recv_finished(request_id)
    assert ours == worker_pb2.MarkRecvFinishedRequest(request_id=request_id).SerializeToString()
    assert mark_finished.decode_mark_recv_finished(ours) == (request_id, False)
    released = mark_finished.encode_mark_recv_finished(request_id, released=True)
    assert mark_finished.decode_mark_recv_finished(released) == (request_id, True)


@FUZZ
@given(data=st.binary(max_size=40))
def test_decode_mark_recv_finished_fuzz_raises_only_shmrdv_errors(data: bytes) -> None:
    try:
        got = mark_finished.decode_mark_recv_finished(data)
    except WIRE_ERRORS:
        return
    assert worker_pb2.MarkRecvFinishedRequest.FromString(data).request_id == got[0]


# ---------------------------------------------------------------------- GetStatus


def test_encode_status_response_bytes_equal_generated() -> None:
    devices = [
        status.DeviceAttributes(
            "/job:w/replica:0/task:0/device:CPU:0", "CPU", 1 << 30, 2**64 - 1, "host", -1
        ),
        status.DeviceAttributes(
            "/job:w/replica:0/task:0/device:CPU:1", "CPU", incarnation=5, xla_global_id=3
        ),
    ]
    ref = worker_pb2.GetStatusResponse(
        device_attributes=[
            device_attributes_pb2.DeviceAttributes(
                name=d.name,
                device_type=d.device_type,
                memory_limit=d.memory_limit,
                incarnation=d.incarnation,
                physical_device_desc=d.physical_device_desc,
                xla_global_id=d.xla_global_id,
            )
            for d in devices
        ]
    )
    ours = status.encode_status_response(devices)
    assert ours == ref.SerializeToString()
    assert status.decode_status_response(ours) == tuple(devices)


# ---------------------------------------------------------------------- streaming


def _assemble(chunks: list[bytes], **kw: Any) -> assembly.StreamAssembler:
    asm = assembly.StreamAssembler(**kw)
    for m in chunks:
        asm.feed(m)
    return asm


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
@pytest.mark.parametrize("chunk_bytes", [1, 3, 64, 1 << 20])
def test_encode_stream_round_trips_through_assembler(
    arr: npt.NDArray[Any], chunk_bytes: int
) -> None:
    chunks = list(
        assembly.encode_stream(arr, is_dead=True, chunk_bytes=chunk_bytes, send_start_micros=11)
    )
    asm = _assemble(chunks)
    assert asm.complete and asm.is_dead and asm.send_start_micros == 11
    value = asm.result()
    assert _same(value, np.asarray(arr))
    assert value.flags.writeable
    assert asm.result() is value


def test_encode_stream_messages_match_generated_tensor_chunks() -> None:
    arr = np.arange(10, dtype=">f8").reshape(2, 5)  # 80 bytes, chunk boundary inside elements
    chunks = list(assembly.encode_stream(arr, is_dead=False, chunk_bytes=12, send_start_micros=-4))
    assert len(chunks) == 7
    first = rendezvous_pb2.TensorChunk.FromString(chunks[0])
    h = first.header
    assert (h.dtype, [d.size for d in h.tensor_shape.dim], h.total_bytes) == (2, [2, 5], 80)
    assert (h.shmrdv_dtype, h.send_start_micros, h.is_dead) == (">f8", -4, False)
    assert chunks[0] == first.SerializeToString()
    data = b"".join(rendezvous_pb2.TensorChunk.FromString(m).data for m in chunks)
    assert data == arr.astype("<f8").tobytes()
    for i, m in enumerate(chunks[1:], start=1):
        chunk = rendezvous_pb2.TensorChunk.FromString(m)
        assert not chunk.HasField("header") and chunk.offset == 12 * i
        assert m == chunk.SerializeToString()


def test_encode_stream_empty_tensor_is_one_header() -> None:
    chunks = list(assembly.encode_stream(np.zeros((3, 0), "U4"), is_dead=False, chunk_bytes=8))
    assert len(chunks) == 1
    assert _assemble(chunks).result().shape == (3, 0)


def test_encode_stream_bad_chunk_size_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="chunk_bytes"):
        assembly.encode_stream(np.zeros(3), is_dead=False, chunk_bytes=0)


def _stream(arr: npt.NDArray[Any], chunk: int = 8) -> list[bytes]:
    return list(assembly.encode_stream(arr, is_dead=False, chunk_bytes=chunk))


def test_stream_assembler_first_message_without_header_refused() -> None:
    chunks = _stream(np.arange(8, dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match="no header"):
        _assemble(chunks[1:])


def test_stream_assembler_out_of_order_chunk_refused() -> None:
    chunks = _stream(np.arange(8, dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match="offset 16, expected 8"):
        _assemble([chunks[0], chunks[2]])


def test_stream_assembler_second_header_refused() -> None:
    chunks = _stream(np.arange(8, dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match="second header"):
        _assemble([chunks[0], chunks[0]])


def test_stream_assembler_overrun_refused() -> None:
    chunks = _stream(np.arange(2, dtype=np.int32))
    extra = rendezvous_pb2.TensorChunk(offset=8, data=b"\x00").SerializeToString()
    with pytest.raises(InvalidArgumentError, match="overruns"):
        _assemble([*chunks, extra])


def test_stream_assembler_truncated_stream_refused() -> None:
    chunks = _stream(np.arange(8, dtype=np.int32))
    asm = _assemble(chunks[:-1])
    assert not asm.complete
    with pytest.raises(InvalidArgumentError, match="ended after 24 of 32 bytes"):
        asm.result()
    with pytest.raises(InvalidArgumentError, match="before its header"):
        assembly.StreamAssembler().result()


def test_stream_assembler_feed_after_result_is_internal_error() -> None:
    asm = _assemble(_stream(np.arange(2, dtype=np.int32)))
    asm.result()
    with pytest.raises(InternalError):
        asm.feed(b"")


def test_stream_assembler_header_size_mismatch_refused() -> None:
    header = rendezvous_pb2.TensorHeader(dtype=1, total_bytes=12, shmrdv_dtype="<f4")
    header.tensor_shape.dim.add(size=2)
    with pytest.raises(InvalidArgumentError, match="header says 12"):
        _assemble([rendezvous_pb2.TensorChunk(header=header).SerializeToString()])


def test_stream_assembler_declared_size_over_limit_refused_before_allocating() -> None:
    header = rendezvous_pb2.TensorHeader(dtype=4, total_bytes=1 << 30, shmrdv_dtype="|u1")
    header.tensor_shape.dim.add(size=1 << 30)
    huge = rendezvous_pb2.TensorChunk(header=header).SerializeToString()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError, match="exceeds this receiver's limit"):
            _assemble([huge], max_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    header.total_bytes = 1 << 60
    header.tensor_shape.dim[0].size = 1 << 60
    with pytest.raises(InvalidArgumentError, match=r"limit|more than .* elements"):
        _assemble([rendezvous_pb2.TensorChunk(header=header).SerializeToString()])


# ------------------------------------------------------------ property round trips

_DTYPES = st.one_of(
    hnp.scalar_dtypes(),
    hnp.byte_string_dtypes(min_len=1, max_len=6),
    hnp.unicode_string_dtypes(min_len=1, max_len=4),
    hnp.nested_dtypes(max_itemsize=64),
)
_ARRAYS = _DTYPES.flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arr=_ARRAYS,
    is_dead=st.booleans(),
    ssm=st.integers(-(2**63), 2**63 - 1),
    chunk=st.integers(1, 40),
)
@pytest.mark.slow
def test_round_trip_response_and_stream_property(
    arr: npt.NDArray[Any], is_dead: bool, ssm: int, chunk: int
) -> None:
    data = messages.encode_response(arr, is_dead=is_dead, send_start_micros=ssm)
    got = messages.decode_response(data)
    assert _same(got.value, arr) and got.is_dead == is_dead and got.send_start_micros == ssm
    ref = worker_pb2.RecvTensorResponse.FromString(data)
    assert [d.size for d in ref.tensor.tensor_shape.dim] == list(arr.shape)
    assert ref.tensor.dtype == tf_dtypes.dtype_to_tf(arr.dtype)
    asm = _assemble(
        list(assembly.encode_stream(arr, is_dead=is_dead, chunk_bytes=chunk, send_start_micros=ssm))
    )
    assert _same(asm.result(), arr) and asm.is_dead == is_dead


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(
        [
            "bfloat16",
            "float8_e5m2",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "int4",
            "uint4",
            "float8_e4m3b11fnuz",
        ]
    ),
    raw=st.binary(min_size=0, max_size=24),
)
def test_round_trip_ml_dtypes_property(name: str, raw: bytes) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name))
    arr = np.frombuffer(raw, dtype, len(raw) // dtype.itemsize)
    assert _same(messages.decode_response(messages.encode_response(arr, is_dead=False)).value, arr)
    assert _same(_assemble(_stream(arr, 5)).result(), arr)


# ----------------------------------------------------------------------- fuzzing


def _mutations(seed_messages: list[bytes]) -> st.SearchStrategy[bytes]:
    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(st.sampled_from(seed_messages)))
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
            pos = draw(st.integers(0, max(len(data) - 1, 0)))
            if op == "flip" and data:
                data[pos] ^= 1 << draw(st.integers(0, 7))
            elif op == "set" and data:
                data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x22]))
            elif op == "insert":
                data[pos:pos] = draw(st.binary(min_size=1, max_size=12))
            elif op == "delete":
                del data[pos : pos + draw(st.integers(1, 8))]
            elif op == "truncate":
                del data[pos:]
        return bytes(data)

    return mutate()


_RESPONSES = [
    messages.encode_response(a, is_dead=i % 2 == 0, send_start_micros=i)
    for i, a in enumerate(SAMPLES)
]
_REQUESTS = [
    messages.encode_request(5, "a;0000000000000001;b;edge;0:0", 77, True),
    worker_pb2.RecvTensorRequest(
        step_id=1,
        rendezvous_key="k",
        client_locality=device_attributes_pb2.DeviceLocality(bus_id=1),
    ).SerializeToString(),
]
_STREAMS = [_stream(a, 7) for a in SAMPLES]
_RESPONSE_INPUTS = st.one_of(st.binary(max_size=200), _mutations(_RESPONSES))


@FUZZ
@given(data=_RESPONSE_INPUTS)
def test_decode_response_fuzz_raises_only_shmrdv_errors(data: bytes) -> None:
    try:
        got = messages.decode_response(data)
    except WIRE_ERRORS:
        return
    # What we accept, protobuf accepts too, and reads the same way.
    ref = worker_pb2.RecvTensorResponse.FromString(data)
    assert (ref.is_dead, ref.send_start_micros, ref.require_ack) == (
        got.is_dead,
        got.send_start_micros,
        got.require_ack,
    )
    if ref.HasField("tensor") and (ref.tensor.dtype != 0 or ref.tensor.shmrdv_dtype):
        assert tuple(d.size for d in ref.tensor.tensor_shape.dim) == got.value.shape


@FUZZ
@given(data=st.one_of(st.binary(max_size=120), _mutations(_REQUESTS)))
def test_decode_request_fuzz_raises_only_shmrdv_errors(data: bytes) -> None:
    try:
        got = messages.decode_request(data)
    except WIRE_ERRORS:
        return
    ref = worker_pb2.RecvTensorRequest.FromString(data)
    assert (ref.step_id, ref.rendezvous_key, ref.request_id, ref.dma_ok) == (
        got.step_id,
        got.rendezvous_key,
        got.request_id,
        got.dma_ok,
    )


@FUZZ
@given(
    stream=st.sampled_from(_STREAMS),
    index=st.integers(0, 50),
    data=st.data(),
)
@pytest.mark.slow
def test_stream_assembler_fuzz_raises_only_shmrdv_errors(
    stream: list[bytes], index: int, data: st.DataObject
) -> None:
    chunks = list(stream)
    i = index % len(chunks)
    chunks[i] = data.draw(st.one_of(st.binary(max_size=80), _mutations([chunks[i]])))
    asm = assembly.StreamAssembler(max_bytes=1 << 24)
    try:
        for m in chunks:
            asm.feed(m)
        asm.result()
    except WIRE_ERRORS:
        pass


@FUZZ
@given(data=st.binary(max_size=200))
def test_decode_status_response_fuzz_raises_only_shmrdv_errors(data: bytes) -> None:
    try:
        status.decode_status_response(data)
    except WIRE_ERRORS:
        pass


def test_request_acks_unpacked_and_packed_decode_alike() -> None:
    """Field 1001 (acks) as shmrdv writes it (one varint each) and packed, as a standard
    protobuf encoder writes a repeated int64; both give the same ids, capped at MAX_ACKS."""
    acks = [1, 2**40, 2**63 - 1, 7]
    plain = messages.encode_request(3, "k", 9, finished=acks)
    got = messages.decode_request(plain)
    assert list(got.finished) == acks
    base = messages.encode_request(3, "k", 9)
    payload = b"".join(wire.encode_varint(a) for a in acks)
    packed = base + wire.encode_tag(1001, 2) + wire.encode_varint(len(payload)) + payload
    assert list(messages.decode_request(packed).finished) == acks
    many = list(range(1, messages.MAX_ACKS + 50))
    payload = b"".join(wire.encode_varint(a) for a in many)
    packed = base + wire.encode_tag(1001, 2) + wire.encode_varint(len(payload)) + payload
    assert list(messages.decode_request(packed).finished) == many[: messages.MAX_ACKS]


def test_truncated_packed_acks_are_refused() -> None:
    base = messages.encode_request(3, "k", 9)
    bad = base + wire.encode_tag(1001, 2) + wire.encode_varint(2) + b"\xff\xff"  # varint never ends
    with pytest.raises(InvalidArgumentError):
        messages.decode_request(bad)


_FRESH = """
import sys
import numpy as np
import shmrdv._rpc.transport
from shmrdv._rpc import tf_dtypes
assert "ml_dtypes" not in sys.modules, "ml_dtypes imported with the gRPC transport"
assert tf_dtypes.dtype_to_tf(np.float32) == tf_dtypes.DataType.DT_FLOAT
assert "ml_dtypes" not in sys.modules, "ml_dtypes imported by a float32 encode"
dt = tf_dtypes.tf_to_dtype(tf_dtypes.DataType.DT_BFLOAT16)
assert dt.type.__module__.startswith("ml_dtypes") and dt.name == "bfloat16", dt
assert tf_dtypes.dtype_to_tf(dt) == tf_dtypes.DataType.DT_BFLOAT16
print("ok")
"""


def test_ml_dtypes_are_imported_only_when_a_tensor_needs_them() -> None:
    """ml_dtypes costs ~0.6 s to import: the gRPC transport imports it only for a tensor
    of one of its kinds (a TensorFlow bfloat16 arriving first included)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
