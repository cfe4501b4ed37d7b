"""Tensor coding: a numpy array as a ``TensorProto`` around its own buffer, both ways.

Pure: no gRPC, no protobuf runtime, no I/O; thread model: none needed. The fields are
those of ``protos/shmrdv/tensor.proto`` (TensorFlow's field numbers); ``messages`` puts
the TensorProto into a RecvTensorResponse and ``assembly`` into a chunked stream; the
dtype codes are ``tf_dtypes``'.

Encoding follows TensorFlow's ``EncodeTensorToByteBuffer``
(tensorflow/core/distributed_runtime/rpc/grpc_tensor_coding.cc): ``tensor_content`` is
the array's own buffer (``tensor_parts`` returns it beside the head and tail bytes, so
the message is one ``b"".join``), never serialised element by element. A dimension of
size 0 and an empty ``tensor_content`` are written in protobuf's canonical form.

* numbers and bool go in ``tensor_content`` as TensorFlow sends them (TensorFlow never
  uses the ``*_val`` fields on RecvTensor, and this decoder refuses them). A scalar has
  no ``tensor_shape`` field at all.
* numpy bytes arrays (``DT_STRING``) in TensorFlow's layout: the varint32 length of
  every element, then all elements joined (``port::EncodeStringList``).
* dtypes TensorFlow lacks travel as their raw little-endian buffer in
  ``tensor_content``, named by the ``shmrdv_dtype`` extension; big-endian values travel
  little-endian and a shmrdv decoder swaps back (one copy).

Errors: values that cannot be sent raise ``InvalidArgumentError``; bytes that describe
an impossible tensor raise ``Malformed`` (the message decoders' edge turns it into
``InvalidArgumentError``); a buffer that cannot be allocated raises
``ResourceExhaustedError``. Every element count is checked (``check_shape``) before
anything is allocated or looped over.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._errors import ResourceExhaustedError
from .._values import as_ndarray, shape_problem
from .tf_dtypes import (
    PLAIN_OF_TF,
    DataType,
    dtype_descriptor,
    dtype_to_tf,
    refuse_object,
    resolve_dtype,
    wire_dtype,
)
from .wire import (
    LEN,
    VARINT,
    Buffer,
    Field,
    Malformed,
    encode_tag,
    encode_varint,
    int_field,
    iter_fields,
    len_field,
    read_utf8,
    read_varint,
    signed64,
)

__all__ = [
    "DecodedTensor",
    "MAX_DECODED_BYTES",
    "MAX_INLINE_BYTES",
    "MAX_MESSAGE_BYTES",
    "TensorAcc",
    "TensorParts",
    "as_array",
    "check_shape",
    "contiguous_wire",
    "element_count",
    "empty_array",
    "raw_bytes",
    "shape_bytes",
    "tensor_parts",
    "tensor_value",
    "to_dtype",
]


# TensorFlow: kProtoBufLimitBytes = 1 << 31 ("Cannot encode a Tensor that exceeds the
# 2GB protobuf limit"); gRPC's largest message length is INT32_MAX.
MAX_MESSAGE_BYTES: Final = (1 << 31) - 1


# The largest tensor answered in one response: the message limit less room for the
# header (fields, shape, a dtype descriptor of at most 64 Ki characters).
MAX_INLINE_BYTES: Final = MAX_MESSAGE_BYTES - (1 << 20)


# numpy's NPY_MAXDIMS (64 since numpy 2.0).
_MAX_DIMS: Final = 64


_DEFAULT_MAX_BYTES_FALLBACK: Final = 1 << 40


def _default_max_bytes() -> int:
    """This host's physical memory: a larger tensor could not be received anyway."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return _DEFAULT_MAX_BYTES_FALLBACK


# No decoded array may be larger than this, whatever a peer declares.
MAX_DECODED_BYTES: Final = _default_max_bytes()


def as_array(value: object) -> npt.NDArray[Any]:
    """``value`` as an array the wire can carry (no Python objects), else raise."""
    arr = as_ndarray(value, "encode")
    refuse_object(arr.dtype, "an array")
    return arr


def contiguous_wire(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``arr`` C-contiguous in its little-endian dtype (copies only when needed)."""
    wire = wire_dtype(arr.dtype)
    if arr.dtype != wire:
        converted: npt.NDArray[Any] = arr.astype(wire, order="C")
        return converted
    if arr.flags.c_contiguous:
        return arr
    copied: npt.NDArray[Any] = arr.copy(order="C")
    return copied


def raw_bytes(arr: npt.NDArray[Any]) -> memoryview | bytes:
    """A flat byte view of a C-contiguous array (no copy)."""
    if arr.nbytes == 0:
        return b""
    flat: Any = arr.reshape(-1).view(np.uint8)  # numpy's stubs do not declare the buffer
    return memoryview(flat)


def shape_bytes(shape: Sequence[int]) -> bytes:
    """``TensorShapeProto`` for ``shape``; empty (field left out) for a scalar."""
    return b"".join([_DIMS.get(size) or _dim(size) for size in shape])


def _string_list(arr: npt.NDArray[Any]) -> bytes:
    """TensorFlow's ``port::EncodeStringList``: every varint32 length, then every string."""
    items = [bytes(x) for x in arr.reshape(-1).tolist()]
    return b"".join([*(encode_varint(len(s)) for s in items), *items])


@dataclass(frozen=True, slots=True)
class TensorParts:
    """A TensorProto as ``head + content + tail`` (content is the tensor's own buffer)."""

    head: bytes
    content: memoryview | bytes
    tail: bytes

    @property
    def size(self) -> int:
        return len(self.head) + len(self.content) + len(self.tail)


# The plain dtypes (in their wire byte order) with their ``dtype`` field; their arrays are
# sent as they are, with no descriptor (``tf_dtypes.PLAIN_OF_TF`` turned around).
_PLAIN_HEADS: Final[dict[np.dtype[Any], bytes]] = {
    d: int_field(1, code) for code, d in PLAIN_OF_TF.items()
}
_CONTENT_TAG: Final = encode_tag(4, LEN)


def _dim(size: int) -> bytes:
    """One dimension of a ``TensorShapeProto`` (field 2: a message of its size)."""
    return len_field(2, int_field(1, size))


_DIMS: Final = {n: _dim(n) for n in range(1025)}  # the sizes most shapes are made of


def tensor_parts(arr: npt.NDArray[Any]) -> TensorParts:
    dtype = arr.dtype
    head = _PLAIN_HEADS.get(dtype) if arr.flags.c_contiguous else None
    if head is not None:  # a plain number or bool array as it is: the usual case, cheaper
        if arr.shape:
            head += len_field(2, shape_bytes(arr.shape))
        nbytes = arr.nbytes
        if not nbytes:
            return TensorParts(head, b"", b"")
        head += _CONTENT_TAG + encode_varint(nbytes)
        flat: Any = arr.reshape(-1).view(np.uint8)
        return TensorParts(head, memoryview(flat), b"")
    code = dtype_to_tf(dtype)
    ext = ""
    content: memoryview | bytes
    if code == DataType.DT_STRING:
        content = _string_list(arr)
        ext = dtype_descriptor(dtype)
    else:
        content = raw_bytes(contiguous_wire(arr))
        if code == DataType.DT_INVALID or dtype != wire_dtype(dtype):
            ext = dtype_descriptor(dtype)
    head = int_field(1, code)
    shape = shape_bytes(arr.shape)
    if shape:
        head += len_field(2, shape)
    if len(content):
        head += encode_tag(4, LEN) + encode_varint(len(content))
    tail = len_field(1001, ext.encode()) if ext else b""
    return TensorParts(head, content, tail)


@dataclass(frozen=True, slots=True)
class DecodedTensor:
    """A decoded ``RecvTensorResponse``.

    ``value`` is read-only and shares the response bytes when no conversion was needed
    (``np.frombuffer``); ``DT_STRING`` and byte-swapped values are fresh arrays.
    """

    value: npt.NDArray[Any]
    is_dead: bool
    send_start_micros: int
    require_ack: bool = False


@dataclass(slots=True)
class TensorAcc:
    """A TensorProto being parsed; repeated occurrences merge as protobuf merges them."""

    dtype: int = 0
    dims: list[int] | None = None
    unknown_rank: bool = False
    content: tuple[int, int] = (0, 0)
    ext: str = ""

    def add_shape(self, buf: Buffer, start: int, end: int) -> None:
        dims = self.dims if self.dims is not None else []
        for f in iter_fields(buf, start, end):
            if f.number == 2 and f.wire_type == LEN:
                size = 0
                for g in iter_fields(buf, f.value, f.end):
                    if g.number == 1 and g.wire_type == VARINT:
                        size = signed64(g.value)
                    elif g.number == 2 and g.wire_type == LEN:
                        read_utf8(buf, g.value, g.end, "TensorShapeProto.Dim.name")
                dims.append(size)
                if len(dims) > _MAX_DIMS:
                    raise Malformed(f"shape has more than {_MAX_DIMS} dimensions")
            elif f.number == 3 and f.wire_type == VARINT:
                self.unknown_rank = bool(f.value)
        self.dims = dims

    def add_tensor(self, buf: Buffer, start: int, end: int) -> None:
        for f in iter_fields(buf, start, end):
            if f.number == 1 and f.wire_type == VARINT:
                self.dtype = signed64(f.value)  # an int32 enum; negatives are 10 bytes
            elif f.number == 2 and f.wire_type == LEN:
                self.add_shape(buf, f.value, f.end)
            elif f.number == 4 and f.wire_type == LEN:
                self.content = (f.value, f.end)
            elif f.number == 1001 and f.wire_type == LEN:
                self.ext = read_utf8(buf, f.value, f.end, "TensorProto.shmrdv_dtype")
            elif _is_typed_value(f):
                raise Malformed(
                    f"TensorProto.{_VAL_FIELDS[f.number]} is not supported: shmrdv reads "
                    "tensor_content, which is what TensorFlow's RecvTensor sends"
                )

    def shape(self) -> tuple[int, ...]:
        if self.unknown_rank:
            raise Malformed("tensor shape has unknown rank")
        dims = tuple(self.dims or ())
        if any(d < 0 for d in dims):
            raise Malformed(f"tensor shape {list(dims)} has a negative (unknown) size")
        return dims


def _is_typed_value(f: Field) -> bool:
    """Whether ``f`` holds elements of one of TensorProto's typed ``*_val`` fields."""
    if f.number not in _VAL_FIELDS:
        return False
    if f.number == 8:
        return f.wire_type == LEN  # one string_val element (maybe empty)
    if f.wire_type == LEN:
        return f.end > f.value  # packed elements
    return True  # one unpacked numeric element


_VAL_FIELDS: Final = {
    5: "float_val",
    6: "double_val",
    7: "int_val",
    8: "string_val",
    9: "scomplex_val",
    10: "int64_val",
    11: "bool_val",
    12: "dcomplex_val",
    13: "half_val",
    16: "uint32_val",
    17: "uint64_val",
}


def element_count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_shape(shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """The shared element-count rule (``_values.shape_problem``), before anything is
    allocated or looped over: zero-byte items pass every length check (issue 12 §4)."""
    problem = shape_problem(shape, dtype.itemsize)
    if problem is not None:
        raise Malformed(f"a {dtype} tensor: {problem}")


def empty_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    try:
        return np.empty(shape, dtype)
    except (ValueError, MemoryError) as e:  # e.g. "array is too big" for a zero itemsize
        raise Malformed(f"cannot make an empty {dtype} array of shape {shape}: {e}") from e


def _decode_strings(
    buf: Buffer, start: int, end: int, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> npt.NDArray[Any]:
    n = element_count(shape)
    # Each string costs at least one length byte, so n is bounded by the bytes present.
    if n > end - start:
        raise Malformed(f"DT_STRING tensor of shape {shape} cannot fit in {end - start} bytes")
    lengths = []
    pos = start
    for _ in range(n):
        length, pos = read_varint(buf, pos, end)
        if length > 0xFFFFFFFF:
            raise Malformed("DT_STRING length does not fit in a varint32")
        lengths.append(length)
    if sum(lengths) != end - pos:
        raise Malformed(
            f"DT_STRING lengths add up to {sum(lengths)} bytes, the content holds {end - pos}"
        )
    width = dtype.itemsize if dtype.itemsize else max(lengths, default=1) or 1
    if lengths and max(lengths) > width:
        raise Malformed(f"a DT_STRING element of {max(lengths)} bytes does not fit {dtype}")
    if n * width > MAX_DECODED_BYTES:
        # The declared width, not the content, sets this size: bound it before allocating.
        raise Malformed(f"{n} strings of width {width} exceed this host's memory")
    try:
        out = np.zeros(n, np.dtype(f"S{width}"))
    except MemoryError as e:
        raise ResourceExhaustedError(f"cannot allocate {n} strings of width {width}") from e
    for i, length in enumerate(lengths):
        out[i] = bytes(buf[pos : pos + length])
        pos += length
    return out.reshape(shape)


def tensor_value(buf: Buffer, acc: TensorAcc, is_dead: bool) -> npt.NDArray[Any]:
    shape = acc.shape()
    start, end = acc.content
    if acc.dtype == DataType.DT_INVALID and not acc.ext and is_dead and start == end:
        # A dead value may come with no tensor at all. TensorFlow's default Tensor() is
        # "a 1-dimensional, 0-element float tensor" (tensor.h), so that is what we give.
        if acc.dims is None:
            return empty_array((0,), np.dtype(np.float32))
        if element_count(shape) == 0:
            return empty_array(shape, np.dtype(np.float32))
    dtype = resolve_dtype(acc.dtype, acc.ext)
    check_shape(shape, dtype)
    if acc.dtype == DataType.DT_STRING:
        return _decode_strings(buf, start, end, shape, dtype)
    wire = wire_dtype(dtype)
    need = element_count(shape) * wire.itemsize
    if need != end - start:
        raise Malformed(
            f"{dtype} tensor of shape {shape} needs {need} content bytes, got {end - start}"
        )
    if need == 0:
        value = empty_array(shape, wire)
    else:
        value = np.frombuffer(buf, wire, element_count(shape), start).reshape(shape)
    return to_dtype(value, dtype)


def to_dtype(value: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``value`` (in the little-endian wire dtype) as ``dtype``: a byte swap, or nothing."""
    if value.dtype == dtype:
        return value
    try:
        converted: npt.NDArray[Any] = value.astype(dtype)
    except (TypeError, ValueError) as e:
        raise Malformed(f"cannot convert the received {value.dtype} to {dtype}: {e}") from e
    return converted
