"""shmrdv/_rpc/wire.py: TensorFlow's dtype codes and the TensorProto coding, against the
generated protobuf classes (TensorFlow's field numbers)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from rpc_coding import IDS, ML_CODES, SAMPLES, TF_CODES, expected_tensor

from shmrdv._errors import InvalidArgumentError
from shmrdv._rpc import wire
from shmrdv._rpc.proto import tensor_pb2, types_pb2

ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.mark.parametrize("name,code", sorted({**TF_CODES, **ML_CODES}.items()))
def test_dtype_to_tf_uses_tensorflow_codes(name: str, code: int) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name)) if name in ML_CODES else np.dtype(name)
    assert wire.dtype_to_tf(dtype) == code
    assert wire.tf_to_dtype(code) == dtype
    swapped = dtype.newbyteorder(">") if dtype.byteorder != "|" else dtype
    assert wire.dtype_to_tf(swapped) == code
    assert types_pb2.DataType.Name(code)  # a code of TensorFlow's enum


@pytest.mark.parametrize("dtype", ["U3", "M8[ns]", "m8", "V4", "i4,f8", "S0"])
def test_dtype_to_tf_types_tensorflow_lacks_are_invalid_or_string(dtype: str) -> None:
    expected = wire.DT_STRING if dtype.startswith("S") else wire.DT_INVALID
    assert wire.dtype_to_tf(np.dtype(dtype)) == expected


def test_dtype_to_tf_object_refused() -> None:
    for dtype in (np.dtype(object), np.dtype([("a", "i4"), ("b", "O")])):
        with pytest.raises(InvalidArgumentError, match="Python objects"):
            wire.dtype_to_tf(dtype)


@pytest.mark.parametrize("code", [0, 20, 21, 27, 29, 101, 1000, -1])
def test_tf_to_dtype_codes_without_numpy_kind_refused(code: int) -> None:
    with pytest.raises(InvalidArgumentError, match="no numpy dtype"):
        wire.tf_to_dtype(code)


def test_tf_to_dtype_quantized_gives_storage_integer() -> None:
    assert wire.tf_to_dtype(11) == np.int8
    assert wire.tf_to_dtype(13) == np.int32


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
def test_dtype_descriptor_round_trips(arr: npt.NDArray[Any]) -> None:
    text = wire.dtype_descriptor(arr.dtype)
    assert wire.resolve_dtype(wire.dtype_to_tf(arr.dtype), text) == arr.dtype


def test_dtype_descriptor_structured_with_ml_dtypes_field_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="ml_dtypes"):
        wire.dtype_descriptor(np.dtype([("a", ml_dtypes.bfloat16), ("b", "<i4", (2,))]))


@pytest.mark.parametrize(
    "text",
    ["nonsense", "[('a', 'O')]", "O", "ml_dtypes.nope", "[(", "__import__('os')", "[" * 5000,
     "x" * 70000],
    ids=lambda text: repr(text[:16]),
)  # fmt: skip
def test_resolve_dtype_garbage_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        wire.resolve_dtype(0, text)


def test_resolve_dtype_contradicting_code_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="contradicts"):
        wire.resolve_dtype(1, "<U3")


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
def test_tensor_parts_bytes_equal_generated(arr: npt.NDArray[Any]) -> None:
    head, content, tail = wire.tensor_parts(arr)
    ours = b"".join([head, bytes(content), tail])
    assert tensor_pb2.TensorProto.FromString(ours) == expected_tensor(arr)


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
def test_read_tensor_gives_back_the_array(arr: npt.NDArray[Any]) -> None:
    data = expected_tensor(arr).SerializeToString()
    head = wire.TensorHeader()
    wire.read_tensor(data, 0, len(data), head)
    start, end = head.content
    got = wire.tensor_value(head, memoryview(data)[start:end], False, copy=True)
    assert got.dtype == arr.dtype and got.shape == np.asarray(arr).shape
    if arr.dtype.fields is not None:  # padding bytes are not values
        assert repr(got.tolist()) == repr(arr.tolist())
    else:
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(arr).tobytes()


def test_scalar_has_no_shape_field() -> None:
    head, content, tail = wire.tensor_parts(np.asarray(np.float32(1.5)))
    message = tensor_pb2.TensorProto.FromString(head + bytes(content) + tail)
    assert not message.HasField("tensor_shape")


def test_varint_fields_read_back_every_int64() -> None:
    for value in (0, 1, 127, 128, 300, 2**35, 2**63 - 1, -1, -(2**63)):
        data = wire.int_field(1, value)
        got = [wire.signed64(v) for _, _, v, _ in wire.fields(data, 0, len(data))]
        assert got == ([value] if value else [])


def test_fields_refuse_lengths_past_the_end() -> None:
    with pytest.raises(wire.Malformed, match="declares"):
        list(wire.fields(b"\x12\x05ab", 0, 4))
    with pytest.raises(wire.Malformed, match="truncated"):
        list(wire.fields(b"\x08\xff", 0, 2))


def test_fields_refuse_groups() -> None:
    """proto2's groups are in no message here (TensorFlow's are proto3): refused."""
    with pytest.raises(wire.Malformed, match="wire type 3"):
        list(wire.fields(b"\x0b\x08\x01\x0c", 0, 4))  # group 1 { 1: 1 }


_FRESH = """
import sys
import numpy as np
import shmrdv._rpc.transport
from shmrdv._rpc import wire
assert "ml_dtypes" not in sys.modules, "ml_dtypes imported with the gRPC transport"
assert wire.dtype_to_tf(np.float32) == 1
assert "ml_dtypes" not in sys.modules, "ml_dtypes imported by a float32 encode"
dt = wire.tf_to_dtype(14)
assert dt.type.__module__.startswith("ml_dtypes") and dt.name == "bfloat16", dt
assert wire.dtype_to_tf(dt) == 14
print("ok")
"""


def test_ml_dtypes_are_imported_only_when_a_tensor_needs_them() -> None:
    """ml_dtypes costs ~0.6 s to import: only a tensor of one of its kinds imports it
    (a TensorFlow bfloat16 arriving first included)."""
    out = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
