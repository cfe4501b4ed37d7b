"""Tensor coding: a numpy array as a ``TensorProto`` around its own buffer, and back.

Pure: no gRPC, no protobuf runtime, no I/O; thread model: none needed (the module
tables are built at import and only read). The fields are those of
``protos/shmrdv/tensor.proto`` (TensorFlow's field numbers); ``messages`` puts the
TensorProto into a RecvTensorResponse and ``stream`` into a chunked stream.

Encoding follows TensorFlow's ``EncodeTensorToByteBuffer``
(tensorflow/core/distributed_runtime/rpc/grpc_tensor_coding.cc): ``tensor_content`` is
the array's own buffer (``tensor_parts`` returns it beside the head and tail bytes, so
the message is one ``b"".join``), never serialised element by element. A dimension of
size 0 and an empty ``tensor_content`` are written in protobuf's canonical form.

Dtypes:

* numbers and bool go in ``tensor_content`` as TensorFlow sends them (TensorFlow never
  uses the ``*_val`` fields on RecvTensor, and this decoder refuses them);
  float16 is ``DT_HALF``; ``ml_dtypes`` bfloat16 and float8 kinds, when importable,
  have TensorFlow's codes too. A scalar has no ``tensor_shape`` field at all.
* numpy bytes arrays (``'S<n>'``) are ``DT_STRING`` in TensorFlow's layout: the
  varint32 length of every element, then all elements joined
  (``port::EncodeStringList``); the ``shmrdv_dtype`` extension carries ``'|S<n>'`` so
  a shmrdv peer gets the same width back (a TensorFlow peer gets the strings).
* **Dtypes TensorFlow lacks** (unicode ``'U'``, structured, datetime64/timedelta64,
  ``'V'``, other ml_dtypes kinds) travel as their raw little-endian buffer in
  ``tensor_content`` with ``dtype = DT_INVALID`` and the numpy dtype in the
  ``shmrdv_dtype`` extension (TensorProto field 1001). shmrdv peers decode them
  exactly; **a TensorFlow peer cannot** and fails with "Cannot parse tensor from
  response". We chose this over refusing them because the shmrdv contract promises
  every non-object dtype on every transport. Object dtypes are always refused.
* Big-endian (non-native) inputs travel little-endian, as TensorFlow's wire is; the
  extension names the original byte order and a shmrdv decoder swaps back (one copy).

``shmrdv_dtype`` format: the dtype descriptor the segment header also uses
(``shmrdv/_dtypes.py``): ``dtype.str`` for simple dtypes, ``json:`` + the ``.npy``
description for structured ones, ``ml_dtypes:<name>`` for ml_dtypes kinds.

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
from enum import IntEnum
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._dtypes import decode_dtype, encode_dtype
from .._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from .._values import as_ndarray, shape_problem
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

try:  # optional: bfloat16 and float8 kinds
    import ml_dtypes
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    ml_dtypes = None  # type: ignore[assignment]

__all__ = [
    "DataType",
    "DecodedTensor",
    "MAX_DECODED_BYTES",
    "MAX_INLINE_BYTES",
    "MAX_MESSAGE_BYTES",
    "TensorAcc",
    "TensorParts",
    "as_array",
    "check_shape",
    "contiguous_wire",
    "dtype_descriptor",
    "dtype_from_descriptor",
    "dtype_to_tf",
    "element_count",
    "empty_array",
    "raw_bytes",
    "resolve_dtype",
    "shape_bytes",
    "tensor_parts",
    "tensor_value",
    "tf_to_dtype",
    "to_dtype",
    "wire_dtype",
]


class DataType(IntEnum):
    """TensorFlow's ``DataType`` values (tensorflow/core/framework/types.proto)."""

    DT_INVALID = 0
    DT_FLOAT = 1
    DT_DOUBLE = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 5
    DT_INT8 = 6
    DT_STRING = 7
    DT_COMPLEX64 = 8
    DT_INT64 = 9
    DT_BOOL = 10
    DT_QINT8 = 11
    DT_QUINT8 = 12
    DT_QINT32 = 13
    DT_BFLOAT16 = 14
    DT_QINT16 = 15
    DT_QUINT16 = 16
    DT_UINT16 = 17
    DT_COMPLEX128 = 18
    DT_HALF = 19
    DT_RESOURCE = 20
    DT_VARIANT = 21
    DT_UINT32 = 22
    DT_UINT64 = 23
    DT_FLOAT8_E5M2 = 24
    DT_FLOAT8_E4M3FN = 25
    DT_FLOAT8_E4M3FNUZ = 26
    DT_FLOAT8_E5M2FNUZ = 28
    DT_INT4 = 29
    DT_UINT4 = 30


# TensorFlow: kProtoBufLimitBytes = 1 << 31 ("Cannot encode a Tensor that exceeds the
# 2GB protobuf limit"); gRPC's largest message length is INT32_MAX.
MAX_MESSAGE_BYTES: Final = (1 << 31) - 1


# The largest tensor answered in one response: the message limit less room for the
# header (fields, shape, a dtype descriptor of at most _MAX_DESCRIPTOR_CHARS).
MAX_INLINE_BYTES: Final = MAX_MESSAGE_BYTES - (1 << 20)


# numpy's NPY_MAXDIMS (64 since numpy 2.0).
_MAX_DIMS: Final = 64


# A dtype descriptor longer than this is refused before it is parsed.
_MAX_DESCRIPTOR_CHARS: Final = 1 << 16


_DEFAULT_MAX_BYTES_FALLBACK: Final = 1 << 40


_LE_BYTE_ORDER: Final = "<"


_TF_OF_NUMPY: dict[np.dtype[Any], DataType] = {
    np.dtype("<f4"): DataType.DT_FLOAT,
    np.dtype("<f8"): DataType.DT_DOUBLE,
    np.dtype("<i4"): DataType.DT_INT32,
    np.dtype("u1"): DataType.DT_UINT8,
    np.dtype("<i2"): DataType.DT_INT16,
    np.dtype("i1"): DataType.DT_INT8,
    np.dtype("<c8"): DataType.DT_COMPLEX64,
    np.dtype("<i8"): DataType.DT_INT64,
    np.dtype("?"): DataType.DT_BOOL,
    np.dtype("<u2"): DataType.DT_UINT16,
    np.dtype("<c16"): DataType.DT_COMPLEX128,
    np.dtype("<f2"): DataType.DT_HALF,
    np.dtype("<u4"): DataType.DT_UINT32,
    np.dtype("<u8"): DataType.DT_UINT64,
}


# ml_dtypes kinds by attribute name; those TensorFlow names get its code. int4/uint4
# are left out of TensorFlow's codes: TensorFlow may pack them two to a byte.
_ML_TF_CODES: Final = {
    "bfloat16": DataType.DT_BFLOAT16,
    "float8_e5m2": DataType.DT_FLOAT8_E5M2,
    "float8_e4m3fn": DataType.DT_FLOAT8_E4M3FN,
    "float8_e4m3fnuz": DataType.DT_FLOAT8_E4M3FNUZ,
    "float8_e5m2fnuz": DataType.DT_FLOAT8_E5M2FNUZ,
}


_ML_NAME_OF: dict[np.dtype[Any], str] = {}


_ML_DTYPE_OF: dict[str, np.dtype[Any]] = {}


if ml_dtypes is not None:
    for _name in dir(ml_dtypes):
        if _name.startswith("_") or _name in ("finfo", "iinfo"):
            continue
        try:
            _dt = np.dtype(getattr(ml_dtypes, _name))
        except TypeError:
            continue
        _ML_NAME_OF[_dt] = _name
        _ML_DTYPE_OF[_name] = _dt
        if _name in _ML_TF_CODES:
            _TF_OF_NUMPY[_dt] = _ML_TF_CODES[_name]


_NUMPY_OF_TF: dict[int, np.dtype[Any]] = {int(v): k for k, v in _TF_OF_NUMPY.items()}


# TensorFlow's quantized types have no numpy kind; their storage is the plain integer.
_NUMPY_OF_TF.update(
    {
        DataType.DT_QINT8: np.dtype("i1"),
        DataType.DT_QUINT8: np.dtype("u1"),
        DataType.DT_QINT16: np.dtype("<i2"),
        DataType.DT_QUINT16: np.dtype("<u2"),
        DataType.DT_QINT32: np.dtype("<i4"),
        DataType.DT_STRING: np.dtype("S"),
    }
)


def _default_max_bytes() -> int:
    """This host's physical memory: a larger tensor could not be received anyway."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return _DEFAULT_MAX_BYTES_FALLBACK


# No decoded array may be larger than this, whatever a peer declares.
MAX_DECODED_BYTES: Final = _default_max_bytes()


def wire_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` in little-endian byte order (recursively for structured dtypes)."""
    if dtype in _ML_NAME_OF:
        return dtype
    wire: np.dtype[Any] = dtype.newbyteorder(_LE_BYTE_ORDER)
    return wire


def _refuse_object(dtype: np.dtype[Any], what: str) -> None:
    if dtype.hasobject:
        raise InvalidArgumentError(
            f"cannot encode {what} of dtype {dtype}: it holds Python objects, whose bytes "
            "are pointers that mean nothing in another process"
        )


def dtype_to_tf(dtype: npt.DTypeLike) -> int:
    """TensorFlow's ``DataType`` code for a numpy dtype, byte order ignored.

    ``'S'`` dtypes give ``DT_STRING``; dtypes TensorFlow lacks give ``DT_INVALID`` (they
    travel with the ``shmrdv_dtype`` extension). Raises ``InvalidArgumentError`` for
    object-holding dtypes and for what numpy does not accept as a dtype.
    """
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"not a numpy dtype: {dtype!r}") from e
    _refuse_object(dt, "a tensor")
    if dt.kind == "S":
        return int(DataType.DT_STRING)
    return int(_TF_OF_NUMPY.get(wire_dtype(dt), DataType.DT_INVALID))


def tf_to_dtype(code: int) -> np.dtype[Any]:
    """The numpy dtype TensorFlow's ``DataType`` ``code`` decodes to (little-endian).

    ``DT_STRING`` gives the flexible ``np.dtype('S')`` (the width comes from the data);
    quantized types give their storage integer; bfloat16/float8 need ``ml_dtypes``.
    Raises ``InvalidArgumentError`` for ``DT_INVALID``, resource/variant, ``*_REF`` and
    unknown codes.
    """
    dt = _NUMPY_OF_TF.get(int(code))
    if dt is not None:
        return dt
    try:
        name = DataType(code).name
    except ValueError:
        name = f"unknown DataType {code}"
    hint = ""
    if int(code) in _ML_TF_CODES.values():
        hint = " (install ml_dtypes to receive it)"
    raise InvalidArgumentError(f"no numpy dtype for TensorFlow {name}{hint}")


def dtype_descriptor(dtype: np.dtype[Any]) -> str:
    """The ``shmrdv_dtype`` string for ``dtype`` (``_dtypes.encode_dtype``)."""
    _refuse_object(dtype, "a tensor")
    if dtype.fields is not None and _has_ml_field(dtype):
        # numpy's descr writes an ml_dtypes field as raw void ('<V2'): refuse rather
        # than hand back another dtype.
        raise InvalidArgumentError(
            f"cannot encode structured dtype {dtype}: a field has an ml_dtypes type, "
            "which the dtype descriptor cannot name; view the field as an integer of "
            "the same size"
        )
    return encode_dtype(dtype).decode("utf-8")


def _has_ml_field(dtype: np.dtype[Any]) -> bool:
    if dtype.subdtype is not None:
        return _has_ml_field(dtype.subdtype[0])
    if dtype.fields is None:
        return dtype in _ML_NAME_OF
    return any(_has_ml_field(spec[0]) for spec in dtype.fields.values())


def dtype_from_descriptor(text: str) -> np.dtype[Any]:
    """Parse a ``shmrdv_dtype`` string; ``InvalidArgumentError`` if it is not one."""
    if len(text) > _MAX_DESCRIPTOR_CHARS:
        raise InvalidArgumentError(f"shmrdv_dtype is {len(text)} characters long, too long")
    try:
        return decode_dtype(text.encode("utf-8"), "shmrdv_dtype")
    except InternalError as e:
        raise InvalidArgumentError(str(e)) from e


def as_array(value: object) -> npt.NDArray[Any]:
    """``value`` as an array the wire can carry (no Python objects), else raise."""
    arr = as_ndarray(value, "encode")
    _refuse_object(arr.dtype, "an array")
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
    return b"".join(len_field(2, int_field(1, size)) for size in shape)


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


def tensor_parts(arr: npt.NDArray[Any]) -> TensorParts:
    dtype = arr.dtype
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


def resolve_dtype(code: int, ext: str) -> np.dtype[Any]:
    """The numpy dtype a tensor decodes to, from its TF code and the shmrdv extension."""
    if not ext:
        if code == DataType.DT_STRING:
            return np.dtype("S")
        return tf_to_dtype(code)
    dt = dtype_from_descriptor(ext)
    if code != dtype_to_tf(dt):
        raise InvalidArgumentError(
            f"shmrdv_dtype {ext!r} contradicts TensorFlow dtype {code}: corrupted tensor"
        )
    return dt


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
