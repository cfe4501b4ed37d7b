"""What the wire tests share: sample arrays of every kind, and what TensorFlow's (and
shmrdv's) messages must hold for them, built with the generated protobuf classes."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from shmrdv._rpc import wire
from shmrdv._rpc.proto import rendezvous_pb2, tensor_pb2, worker_pb2

# TensorFlow's codes (tensorflow/core/framework/types.proto), written out again here so
# that the table in wire.py is checked against an independent copy.
TF_CODES: dict[str, int] = {
    "float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "complex64": 8,
    "int64": 9, "bool": 10, "uint16": 17, "complex128": 18, "float16": 19, "uint32": 22,
    "uint64": 23,
}  # fmt: skip
ML_CODES = {
    "bfloat16": 14, "float8_e5m2": 24, "float8_e4m3fn": 25, "float8_e4m3fnuz": 26,
    "float8_e5m2fnuz": 28,
}  # fmt: skip


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _le(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype if dtype.type.__module__.startswith("ml_dtypes") else dtype.newbyteorder("<")


def expected_tensor(arr: npt.NDArray[Any]) -> tensor_pb2.TensorProto:
    """The TensorProto TensorFlow (plus the shmrdv extension) would carry for ``arr``."""
    t = tensor_pb2.TensorProto()
    dt = arr.dtype
    name = dt.name if dt.isnative or dt.byteorder == "|" else _le(dt).name
    if dt.kind == "S":
        t.dtype = 7  # type: ignore[assignment]
        items = [bytes(x) for x in arr.reshape(-1).tolist()]
        t.tensor_content = b"".join(varint(len(s)) for s in items) + b"".join(items)
        t.shmrdv_dtype = dt.str
    else:
        import ml_dtypes  # noqa: F401  (names its kinds)

        code = TF_CODES.get(name, ML_CODES.get(name, 0))
        t.dtype = code  # type: ignore[assignment]
        wire_arr = np.ascontiguousarray(arr)
        if dt != _le(dt):
            wire_arr = wire_arr.astype(_le(dt))
        t.tensor_content = wire_arr.tobytes()
        if code == 0 or dt != _le(dt):
            t.shmrdv_dtype = wire.dtype_descriptor(dt)
    for size in arr.shape:
        t.tensor_shape.dim.add(size=size)
    return t


def expected_response(arr: npt.NDArray[Any], is_dead: bool, ssm: int) -> tuple[bytes, bytes]:
    """(TensorFlow's order: fields 2, 3, 5, then 1; the canonical serialisation), with
    ``require_ack`` set, as a shmrdv producer answers."""
    t = expected_tensor(arr)
    head = worker_pb2.RecvTensorResponse(is_dead=is_dead, send_start_micros=ssm, require_ack=True)
    full = worker_pb2.RecvTensorResponse(
        tensor=t, is_dead=is_dead, send_start_micros=ssm, require_ack=True
    )
    tf_order = (
        head.SerializeToString() + worker_pb2.RecvTensorResponse(tensor=t).SerializeToString()
    )
    return tf_order, full.SerializeToString()


def same(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def sample_arrays() -> list[npt.NDArray[Any]]:
    import ml_dtypes

    rng = np.random.default_rng(7)
    return [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asarray(np.float64(-2.5)),
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


try:
    SAMPLES = sample_arrays()
except ImportError:  # pragma: no cover - ml_dtypes is a test requirement
    SAMPLES = []
IDS = [f"{a.dtype}-{a.shape}" for a in SAMPLES]

__all__ = [
    "IDS", "ML_CODES", "SAMPLES", "TF_CODES", "expected_response", "expected_tensor",
    "rendezvous_pb2", "same", "varint",
]  # fmt: skip
