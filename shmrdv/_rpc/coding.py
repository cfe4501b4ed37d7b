"""TensorFlow's RecvTensor wire bytes, built and parsed by hand around the raw buffer.

Pure: no gRPC, no protobuf runtime, no I/O. The messages are those of
``protos/shmrdv/*.proto`` (TensorFlow's field numbers); the generated modules in
``shmrdv/_rpc/proto`` are the reference the tests compare these bytes against.

Encoding follows TensorFlow's ``EncodeTensorToByteBuffer``
(tensorflow/core/distributed_runtime/rpc/grpc_tensor_coding.cc): the response's small
fields first, then the ``tensor`` field, whose ``tensor_content`` is the array's own
buffer appended with one copy (``b"".join``), never serialised element by element.
Where TensorFlow's hand-written skeleton and protobuf's canonical form differ (an
empty ``tensor_content``, a dimension of size 0) we write the canonical form, so the
bytes equal the generated classes' ``SerializeToString`` up to the position of field
1; both parse to the same message.

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

Streaming (``shmrdv.Rendezvous/RecvTensorStream``) sends one ``TensorChunk`` with a
``TensorHeader`` (and the first data if it fits) and then raw chunks; the data is
always the raw little-endian numpy buffer of ``header.shmrdv_dtype`` (also for
``'S'``). ``StreamAssembler`` preallocates the result once and copies each chunk into
place.

Errors: bytes that do not parse, or that describe an impossible tensor, raise
``InvalidArgumentError`` (TensorFlow: ``InvalidArgument("Cannot parse tensor from
response")``); values that cannot be sent raise ``InvalidArgumentError``; a response
beyond protobuf's 2 GiB ceiling, or a buffer that cannot be allocated, raises
``ResourceExhaustedError``; misuse of a
``StreamAssembler`` by its caller raises ``InternalError``. Nothing else escapes the
decoders, whatever the input, and no declared length is allocated before it is checked
against the bytes present (or, for streams, against ``max_bytes``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._dtypes import decode_dtype, encode_dtype
from .._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from .._values import shape_problem

try:  # optional: bfloat16 and float8 kinds
    import ml_dtypes
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    ml_dtypes = None  # type: ignore[assignment]

__all__ = [
    "DataType",
    "DecodedTensor",
    "DeviceAttributes",
    "MAX_INLINE_BYTES",
    "MAX_MESSAGE_BYTES",
    "LinkReply",
    "decode_link_reply",
    "encode_link_error",
    "encode_link_fetch",
    "encode_link_value",
    "RecvRequest",
    "StreamAssembler",
    "decode_mark_recv_finished",
    "decode_request",
    "decode_response",
    "decode_status_response",
    "dtype_from_descriptor",
    "dtype_descriptor",
    "dtype_to_tf",
    "encode_mark_recv_finished",
    "encode_request",
    "encode_response",
    "encode_status_response",
    "encode_stream",
    "tf_to_dtype",
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
# Nesting limit for skipped groups; protobuf's default recursion limit is 100.
_MAX_DEPTH: Final = 64
_U64: Final = (1 << 64) - 1
_DEFAULT_MAX_BYTES_FALLBACK: Final = 1 << 40
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1

# Wire types (https://protobuf.dev/programming-guides/encoding/).
_VARINT: Final = 0
_I64: Final = 1
_LEN: Final = 2
_SGROUP: Final = 3
_EGROUP: Final = 4
_I32: Final = 5

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

_Buffer = bytes | bytearray | memoryview


def _default_max_bytes() -> int:
    """This host's physical memory: a larger tensor could not be received anyway."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return _DEFAULT_MAX_BYTES_FALLBACK


# No decoded array may be larger than this, whatever a peer declares.
_MAX_DECODED_BYTES: Final = _default_max_bytes()


class _Malformed(Exception):
    """Internal: the bytes do not parse; turned into InvalidArgumentError at the API edge."""


# --------------------------------------------------------------------------- dtypes


def _wire_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
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
    return int(_TF_OF_NUMPY.get(_wire_dtype(dt), DataType.DT_INVALID))


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


# ----------------------------------------------------------------- wire primitives


def _varint(value: int) -> bytes:
    """Unsigned varint of ``value`` (negative int64 as its 10-byte two's complement)."""
    value &= _U64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _len_field(field: int, payload: bytes) -> bytes:
    return _tag(field, _LEN) + _varint(len(payload)) + payload


def _int_field(field: int, value: int) -> bytes:
    """A varint field, left out when zero (proto3)."""
    return _tag(field, _VARINT) + _varint(value) if value else b""


def _check_int64(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if not _I64_MIN <= value <= _I64_MAX:
        raise InvalidArgumentError(f"{name}={value} does not fit in an int64")
    return value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value > _I64_MAX else value


def _read_varint(buf: _Buffer, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise _Malformed("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise _Malformed("varint longer than 10 bytes")


@dataclass(slots=True)
class _Field:
    number: int
    wire_type: int
    value: int  # varint / fixed value, or the start of a LEN payload
    end: int  # end of a LEN payload (else equal to value)


def _skip_group(buf: _Buffer, pos: int, end: int, number: int, depth: int) -> int:
    if depth > _MAX_DEPTH:
        raise _Malformed("groups nested too deeply")
    while True:
        tag, pos = _read_varint(buf, pos, end)
        wire_type = tag & 7
        if wire_type == _EGROUP:
            if tag >> 3 != number:
                raise _Malformed("mismatched end-group tag")
            return pos
        pos = _skip_value(buf, pos, end, tag, depth + 1)


def _skip_value(buf: _Buffer, pos: int, end: int, tag: int, depth: int) -> int:
    number, wire_type = tag >> 3, tag & 7
    if number == 0 or tag > 0xFFFFFFFF:
        raise _Malformed(f"invalid tag {tag}")
    if wire_type == _VARINT:
        return _read_varint(buf, pos, end)[1]
    if wire_type == _I64:
        pos += 8
    elif wire_type == _I32:
        pos += 4
    elif wire_type == _LEN:
        length, pos = _read_varint(buf, pos, end)
        pos += length
    elif wire_type == _SGROUP:
        return _skip_group(buf, pos, end, number, depth)
    else:
        raise _Malformed(f"invalid wire type {wire_type}")
    if pos > end:
        raise _Malformed("field runs past the end of its message")
    return pos


def _fields(buf: _Buffer, pos: int, end: int) -> Iterator[_Field]:
    """The fields of one message in ``buf[pos:end]``; groups are skipped (unknown)."""
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0 or tag > 0xFFFFFFFF:
            raise _Malformed(f"invalid tag {tag}")
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            yield _Field(number, wire_type, value, pos)
        elif wire_type in (_I64, _I32):
            size = 8 if wire_type == _I64 else 4
            if pos + size > end:
                raise _Malformed("truncated fixed-width field")
            value = int.from_bytes(buf[pos : pos + size], "little")
            pos += size
            yield _Field(number, wire_type, value, pos)
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if length > end - pos:
                raise _Malformed(f"field {number} declares {length} bytes, {end - pos} remain")
            yield _Field(number, wire_type, pos, pos + length)
            pos += length
        elif wire_type == _SGROUP:
            pos = _skip_group(buf, pos, end, number, 1)
        else:
            raise _Malformed(f"invalid wire type {wire_type} (field {number})")


def _utf8(buf: _Buffer, start: int, end: int, what: str) -> str:
    try:
        return bytes(buf[start:end]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Malformed(f"{what} is not valid UTF-8") from e


# A schema for messages we only validate (field -> (wire type, sub-schema | "str" | None)),
# so that whatever protobuf itself would reject is rejected here too.
_Schema = dict[int, tuple[int, Any]]
_INTERCONNECT_LINK: _Schema = {1: (_VARINT, None), 2: (_LEN, "str"), 3: (_VARINT, None)}
_LOCAL_LINKS: _Schema = {1: (_LEN, _INTERCONNECT_LINK)}
_DEVICE_LOCALITY: _Schema = {1: (_VARINT, None), 2: (_VARINT, None), 3: (_LEN, _LOCAL_LINKS)}
_ANY: _Schema = {1: (_LEN, "str"), 2: (_LEN, None)}


def _validate(buf: _Buffer, start: int, end: int, schema: _Schema) -> None:
    for f in _fields(buf, start, end):
        spec = schema.get(f.number)
        if spec is None or spec[0] != f.wire_type:
            continue  # unknown (or a known field with another wire type): skipped
        if spec[1] == "str":
            _utf8(buf, f.value, f.end, f"string field {f.number}")
        elif isinstance(spec[1], dict):
            _validate(buf, f.value, f.end, spec[1])


# ------------------------------------------------------------------------ tensors


def _as_array(value: object) -> npt.NDArray[Any]:
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, np.generic):
        arr = np.asarray(value)
    else:
        raise InvalidArgumentError(
            f"cannot encode a {type(value).__qualname__}: only numpy arrays are encoded"
        )
    _refuse_object(arr.dtype, "an array")
    return arr


def _contiguous_wire(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``arr`` C-contiguous in its little-endian dtype (copies only when needed)."""
    wire = _wire_dtype(arr.dtype)
    if arr.dtype != wire:
        converted: npt.NDArray[Any] = arr.astype(wire, order="C")
        return converted
    if arr.flags.c_contiguous:
        return arr
    copied: npt.NDArray[Any] = arr.copy(order="C")
    return copied


def _raw_bytes(arr: npt.NDArray[Any]) -> memoryview | bytes:
    """A flat byte view of a C-contiguous array (no copy)."""
    if arr.nbytes == 0:
        return b""
    flat: Any = arr.reshape(-1).view(np.uint8)  # numpy's stubs do not declare the buffer
    return memoryview(flat)


def _shape_bytes(shape: Sequence[int]) -> bytes:
    """``TensorShapeProto`` for ``shape``; empty (field left out) for a scalar."""
    return b"".join(_len_field(2, _int_field(1, size)) for size in shape)


def _string_list(arr: npt.NDArray[Any]) -> bytes:
    """TensorFlow's ``port::EncodeStringList``: every varint32 length, then every string."""
    items = [bytes(x) for x in arr.reshape(-1).tolist()]
    return b"".join([*(_varint(len(s)) for s in items), *items])


@dataclass(frozen=True, slots=True)
class _TensorParts:
    """A TensorProto as ``head + content + tail`` (content is the tensor's own buffer)."""

    head: bytes
    content: memoryview | bytes
    tail: bytes

    @property
    def size(self) -> int:
        return len(self.head) + len(self.content) + len(self.tail)


def _tensor_parts(arr: npt.NDArray[Any]) -> _TensorParts:
    dtype = arr.dtype
    code = dtype_to_tf(dtype)
    ext = ""
    content: memoryview | bytes
    if code == DataType.DT_STRING:
        content = _string_list(arr)
        ext = dtype_descriptor(dtype)
    else:
        content = _raw_bytes(_contiguous_wire(arr))
        if code == DataType.DT_INVALID or dtype != _wire_dtype(dtype):
            ext = dtype_descriptor(dtype)
    head = _int_field(1, code)
    shape = _shape_bytes(arr.shape)
    if shape:
        head += _len_field(2, shape)
    if len(content):
        head += _tag(4, _LEN) + _varint(len(content))
    tail = _len_field(1001, ext.encode()) if ext else b""
    return _TensorParts(head, content, tail)


def encode_response(
    value: npt.NDArray[Any],
    *,
    is_dead: bool,
    send_start_micros: int = 0,
    require_ack: bool = False,
    extra: bytes = b"",
) -> bytes:
    """``RecvTensorResponse`` bytes for ``value``, as TensorFlow's worker sends them.

    ``extra``: encoded extension fields to put first (``encode_link_value``).

    One copy of the tensor buffer (the final join). Raises ``InvalidArgumentError`` for
    a value that cannot be sent and ``ResourceExhaustedError`` if the message would
    exceed protobuf's 2 GiB limit (use ``encode_stream`` for that).
    """
    arr = _as_array(value)
    _check_int64("send_start_micros", send_start_micros)
    parts = _tensor_parts(arr)
    # TensorFlow writes fields 2, 3, 5 first ("A" in EncodeTensorToByteBuffer), then
    # field 1, so that the tensor bytes end the message.
    prefix = (
        extra
        + _int_field(2, int(bool(is_dead)))
        + _int_field(3, send_start_micros)
        + _int_field(5, int(bool(require_ack)))
        + _tag(1, _LEN)
        + _varint(parts.size)
        + parts.head
    )
    total = len(prefix) + len(parts.content) + len(parts.tail)
    if total > MAX_MESSAGE_BYTES:
        raise ResourceExhaustedError(
            f"cannot encode a {arr.dtype} tensor of shape {arr.shape} in one RecvTensor "
            f"response: {total} bytes exceed the 2 GiB protobuf limit (TensorFlow: "
            "kProtoBufLimitBytes); use the streaming RecvTensorStream"
        )
    return b"".join([prefix, parts.content, parts.tail])


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
class _TensorAcc:
    """A TensorProto being parsed; repeated occurrences merge as protobuf merges them."""

    dtype: int = 0
    dims: list[int] | None = None
    unknown_rank: bool = False
    content: tuple[int, int] = (0, 0)
    ext: str = ""

    def add_shape(self, buf: _Buffer, start: int, end: int) -> None:
        dims = self.dims if self.dims is not None else []
        for f in _fields(buf, start, end):
            if f.number == 2 and f.wire_type == _LEN:
                size = 0
                for g in _fields(buf, f.value, f.end):
                    if g.number == 1 and g.wire_type == _VARINT:
                        size = _signed64(g.value)
                    elif g.number == 2 and g.wire_type == _LEN:
                        _utf8(buf, g.value, g.end, "TensorShapeProto.Dim.name")
                dims.append(size)
                if len(dims) > _MAX_DIMS:
                    raise _Malformed(f"shape has more than {_MAX_DIMS} dimensions")
            elif f.number == 3 and f.wire_type == _VARINT:
                self.unknown_rank = bool(f.value)
        self.dims = dims

    def add_tensor(self, buf: _Buffer, start: int, end: int) -> None:
        for f in _fields(buf, start, end):
            if f.number == 1 and f.wire_type == _VARINT:
                self.dtype = _signed64(f.value)  # an int32 enum; negatives are 10 bytes
            elif f.number == 2 and f.wire_type == _LEN:
                self.add_shape(buf, f.value, f.end)
            elif f.number == 4 and f.wire_type == _LEN:
                self.content = (f.value, f.end)
            elif f.number == 1001 and f.wire_type == _LEN:
                self.ext = _utf8(buf, f.value, f.end, "TensorProto.shmrdv_dtype")
            elif _is_typed_value(f):
                raise _Malformed(
                    f"TensorProto.{_VAL_FIELDS[f.number]} is not supported: shmrdv reads "
                    "tensor_content, which is what TensorFlow's RecvTensor sends"
                )

    def shape(self) -> tuple[int, ...]:
        if self.unknown_rank:
            raise _Malformed("tensor shape has unknown rank")
        dims = tuple(self.dims or ())
        if any(d < 0 for d in dims):
            raise _Malformed(f"tensor shape {list(dims)} has a negative (unknown) size")
        return dims


def _is_typed_value(f: _Field) -> bool:
    """Whether ``f`` holds elements of one of TensorProto's typed ``*_val`` fields."""
    if f.number not in _VAL_FIELDS:
        return False
    if f.number == 8:
        return f.wire_type == _LEN  # one string_val element (maybe empty)
    if f.wire_type == _LEN:
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


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_shape(shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """The shared element-count rule (``_values.shape_problem``), before anything is
    allocated or looped over: zero-byte items pass every length check (issue 12 §4)."""
    problem = shape_problem(shape, dtype.itemsize)
    if problem is not None:
        raise _Malformed(f"a {dtype} tensor: {problem}")


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    try:
        return np.empty(shape, dtype)
    except (ValueError, MemoryError) as e:  # e.g. "array is too big" for a zero itemsize
        raise _Malformed(f"cannot make an empty {dtype} array of shape {shape}: {e}") from e


def _resolve_dtype(code: int, ext: str) -> np.dtype[Any]:
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
    buf: _Buffer, start: int, end: int, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> npt.NDArray[Any]:
    n = _count(shape)
    # Each string costs at least one length byte, so n is bounded by the bytes present.
    if n > end - start:
        raise _Malformed(f"DT_STRING tensor of shape {shape} cannot fit in {end - start} bytes")
    lengths = []
    pos = start
    for _ in range(n):
        length, pos = _read_varint(buf, pos, end)
        if length > 0xFFFFFFFF:
            raise _Malformed("DT_STRING length does not fit in a varint32")
        lengths.append(length)
    if sum(lengths) != end - pos:
        raise _Malformed(
            f"DT_STRING lengths add up to {sum(lengths)} bytes, the content holds {end - pos}"
        )
    width = dtype.itemsize if dtype.itemsize else max(lengths, default=1) or 1
    if lengths and max(lengths) > width:
        raise _Malformed(f"a DT_STRING element of {max(lengths)} bytes does not fit {dtype}")
    if n * width > _MAX_DECODED_BYTES:
        # The declared width, not the content, sets this size: bound it before allocating.
        raise _Malformed(f"{n} strings of width {width} exceed this host's memory")
    try:
        out = np.zeros(n, np.dtype(f"S{width}"))
    except MemoryError as e:
        raise ResourceExhaustedError(f"cannot allocate {n} strings of width {width}") from e
    for i, length in enumerate(lengths):
        out[i] = bytes(buf[pos : pos + length])
        pos += length
    return out.reshape(shape)


def _tensor_value(buf: _Buffer, acc: _TensorAcc, is_dead: bool) -> npt.NDArray[Any]:
    shape = acc.shape()
    start, end = acc.content
    if acc.dtype == DataType.DT_INVALID and not acc.ext and is_dead and start == end:
        # A dead value may come with no tensor at all. TensorFlow's default Tensor() is
        # "a 1-dimensional, 0-element float tensor" (tensor.h), so that is what we give.
        if acc.dims is None:
            return _empty((0,), np.dtype(np.float32))
        if _count(shape) == 0:
            return _empty(shape, np.dtype(np.float32))
    dtype = _resolve_dtype(acc.dtype, acc.ext)
    _check_shape(shape, dtype)
    if acc.dtype == DataType.DT_STRING:
        return _decode_strings(buf, start, end, shape, dtype)
    wire = _wire_dtype(dtype)
    need = _count(shape) * wire.itemsize
    if need != end - start:
        raise _Malformed(
            f"{dtype} tensor of shape {shape} needs {need} content bytes, got {end - start}"
        )
    if need == 0:
        value = _empty(shape, wire)
    else:
        value = np.frombuffer(buf, wire, _count(shape), start).reshape(shape)
    return _to_dtype(value, dtype)


def _to_dtype(value: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``value`` (in the little-endian wire dtype) as ``dtype``: a byte swap, or nothing."""
    if value.dtype == dtype:
        return value
    try:
        converted: npt.NDArray[Any] = value.astype(dtype)
    except (TypeError, ValueError) as e:
        raise _Malformed(f"cannot convert the received {value.dtype} to {dtype}: {e}") from e
    return converted


def decode_response(data: _Buffer) -> DecodedTensor:
    """Parse ``RecvTensorResponse`` bytes (fields in any order, unknown fields skipped).

    Raises ``InvalidArgumentError`` ("Cannot parse tensor from response: ...") for bytes
    that do not parse or describe an impossible tensor, and for the typed ``*_val``
    representations (TensorFlow's RecvTensor never sends them).
    """
    buf = _as_buffer(data)
    try:
        acc = _TensorAcc()
        is_dead = require_ack = False
        send_start_micros = 0
        for f in _fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == _LEN:
                acc.add_tensor(buf, f.value, f.end)
            elif f.number == 2 and f.wire_type == _VARINT:
                is_dead = bool(f.value)
            elif f.number == 3 and f.wire_type == _VARINT:
                send_start_micros = _signed64(f.value)
            elif f.number == 4 and f.wire_type == _LEN:
                _validate(buf, f.value, f.end, _ANY)
            elif f.number == 5 and f.wire_type == _VARINT:
                require_ack = bool(f.value)
        value = _tensor_value(buf, acc, is_dead)
    except (_Malformed, InvalidArgumentError) as e:
        raise InvalidArgumentError(f"Cannot parse tensor from response: {e}") from e
    return DecodedTensor(value, is_dead, send_start_micros, require_ack)


def _as_buffer(data: object) -> _Buffer:
    if isinstance(data, bytes | bytearray):
        return data
    if isinstance(data, memoryview):
        try:
            return data.cast("B")
        except TypeError as e:
            raise InvalidArgumentError("message buffer is not C-contiguous") from e
    raise InvalidArgumentError(f"message must be bytes, got {type(data).__qualname__}")


# ----------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class RecvRequest:
    """A decoded ``RecvTensorRequest`` (localities and transport options are dropped)."""

    step_id: int
    rendezvous_key: str
    request_id: int
    dma_ok: bool = False
    # shmrdv's extension fields (TensorFlow skips them as unknown fields):
    finished: tuple[int, ...] = ()  # 1001: request_ids whose responses arrived (acks)
    inline_max: int = -1  # 1002: largest tensor to answer inline; -1: not given
    cancel: bool = False  # 1003 (Exchange): the client gives request_id up
    wait_ms: int = -1  # 1004 (Exchange): wait at most this long for the value; -1: not given


# Extension fields of RecvTensorRequest, read by shmrdv's RecvTensorInline and Exchange.
_FINISHED_FIELD = 1001
_INLINE_MAX_FIELD = 1002
_CANCEL_FIELD = 1003
_WAIT_MS_FIELD = 1004


def encode_request(
    step_id: int,
    rendezvous_key: str,
    request_id: int,
    dma_ok: bool = False,
    *,
    finished: Sequence[int] = (),
    inline_max: int = -1,
    cancel: bool = False,
    wait_ms: int = -1,
) -> bytes:
    """``RecvTensorRequest`` bytes; ``InvalidArgumentError`` for out-of-range ints.

    ``finished`` (request_ids whose responses arrived: piggybacked acks, as many
    ``MarkRecvFinished``) and ``inline_max`` (answer tensors up to this many bytes in the
    unary response) are shmrdv extension fields 1001 and 1002, for ``RecvTensorInline``.
    """
    _check_int64("step_id", step_id)
    _check_int64("request_id", request_id)
    ext = b"".join(_int_field(_FINISHED_FIELD, _check_int64("finished", f)) for f in finished)
    if inline_max >= 0:
        ext += _tag(_INLINE_MAX_FIELD, _VARINT) + _varint(_check_int64("inline_max", inline_max))
    ext += _int_field(_CANCEL_FIELD, int(bool(cancel)))
    if wait_ms >= 0:
        ext += _tag(_WAIT_MS_FIELD, _VARINT) + _varint(_check_int64("wait_ms", wait_ms))
    if not isinstance(rendezvous_key, str):
        raise InvalidArgumentError(f"rendezvous_key must be a str, got {rendezvous_key!r}")
    try:
        key = rendezvous_key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"rendezvous_key {rendezvous_key!r} is not UTF-8") from e
    return (
        _int_field(1, step_id)
        + (_len_field(2, key) if key else b"")
        + _int_field(3, int(bool(dma_ok)))
        + _int_field(7, request_id)
        + ext
    )


def decode_request(data: _Buffer) -> RecvRequest:
    """Parse ``RecvTensorRequest`` bytes; ``InvalidArgumentError`` if they do not parse."""
    buf = _as_buffer(data)
    step_id = request_id = 0
    key = ""
    dma_ok = False
    finished: list[int] = []
    inline_max = wait_ms = -1
    cancel = False
    try:
        for f in _fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == _VARINT:
                step_id = _signed64(f.value)
            elif f.number == 2 and f.wire_type == _LEN:
                key = _utf8(buf, f.value, f.end, "rendezvous_key")
            elif f.number == 3 and f.wire_type == _VARINT:
                dma_ok = bool(f.value)
            elif f.number in (4, 5) and f.wire_type == _LEN:
                _validate(buf, f.value, f.end, _DEVICE_LOCALITY)
            elif f.number == 6 and f.wire_type == _LEN:
                _validate(buf, f.value, f.end, _ANY)
            elif f.number == 7 and f.wire_type == _VARINT:
                request_id = _signed64(f.value)
            elif f.number == _FINISHED_FIELD and f.wire_type == _VARINT:
                if len(finished) < MAX_ACKS:
                    finished.append(_signed64(f.value))
            elif f.number == _FINISHED_FIELD and f.wire_type == _LEN:
                # Packed, as a standard protobuf encoder writes a repeated int64.
                pos = f.value
                while pos < f.end:
                    v, pos = _read_varint(buf, pos, f.end)
                    if len(finished) < MAX_ACKS:
                        finished.append(_signed64(v))
            elif f.number == _INLINE_MAX_FIELD and f.wire_type == _VARINT:
                inline_max = _signed64(f.value)
            elif f.number == _CANCEL_FIELD and f.wire_type == _VARINT:
                cancel = bool(f.value)
            elif f.number == _WAIT_MS_FIELD and f.wire_type == _VARINT:
                wait_ms = _signed64(f.value)
    except _Malformed as e:
        raise InvalidArgumentError(f"Cannot parse RecvTensorRequest: {e}") from e
    return RecvRequest(
        step_id, key, request_id, dma_ok, tuple(finished), inline_max, cancel, wait_ms
    )


#: A request carries at most this many acks; more are ignored (they expire on their own),
#: so a client puts no more on one request.
MAX_ACKS = 1024


def encode_mark_recv_finished(request_id: int) -> bytes:
    """``MarkRecvFinishedRequest`` bytes (the client has the response of ``request_id``)."""
    return _int_field(1, _check_int64("request_id", request_id))


def decode_mark_recv_finished(data: _Buffer) -> int:
    """The ``request_id`` in ``MarkRecvFinishedRequest`` bytes.

    Raises ``InvalidArgumentError`` if they do not parse.
    """
    buf = _as_buffer(data)
    request_id = 0
    try:
        for f in _fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == _VARINT:
                request_id = _signed64(f.value)
    except _Malformed as e:
        raise InvalidArgumentError(f"Cannot parse MarkRecvFinishedRequest: {e}") from e
    return request_id


# ------------------------------------------------------------------------ GetStatus


@dataclass(frozen=True, slots=True)
class DeviceAttributes:
    """TensorFlow's ``DeviceAttributes`` (the fields shmrdv fills; no locality)."""

    name: str
    device_type: str
    memory_limit: int = 0
    incarnation: int = 0  # fixed64 on the wire; TensorFlow: "should never be 0"
    physical_device_desc: str = ""
    xla_global_id: int = -1  # TensorFlow: -1 if unavailable


def _device_bytes(d: DeviceAttributes) -> bytes:
    if not 0 <= d.incarnation <= _U64:
        raise InvalidArgumentError(f"incarnation {d.incarnation} is not a uint64")
    _check_int64("memory_limit", d.memory_limit)
    _check_int64("xla_global_id", d.xla_global_id)
    return b"".join(
        [
            _len_field(1, d.name.encode()) if d.name else b"",
            _len_field(2, d.device_type.encode()) if d.device_type else b"",
            _int_field(4, d.memory_limit),
            _tag(6, _I64) + d.incarnation.to_bytes(8, "little") if d.incarnation else b"",
            _len_field(7, d.physical_device_desc.encode()) if d.physical_device_desc else b"",
            _int_field(8, d.xla_global_id),
        ]
    )


def encode_status_response(devices: Sequence[DeviceAttributes]) -> bytes:
    """``GetStatusResponse`` bytes listing ``devices``."""
    return b"".join(_len_field(1, _device_bytes(d)) for d in devices)


def decode_status_response(data: _Buffer) -> tuple[DeviceAttributes, ...]:
    """Parse ``GetStatusResponse`` bytes; ``InvalidArgumentError`` if they do not parse."""
    buf = _as_buffer(data)
    out = []
    try:
        for f in _fields(buf, 0, len(buf)):
            if f.number != 1 or f.wire_type != _LEN:
                continue
            v: dict[str, Any] = {"name": "", "device_type": "", "xla_global_id": 0}
            for g in _fields(buf, f.value, f.end):
                if g.wire_type == _LEN and g.number in (1, 2, 7):
                    name = {1: "name", 2: "device_type", 7: "physical_device_desc"}[g.number]
                    v[name] = _utf8(buf, g.value, g.end, f"DeviceAttributes.{name}")
                elif g.wire_type == _VARINT and g.number in (4, 8):
                    v["memory_limit" if g.number == 4 else "xla_global_id"] = _signed64(g.value)
                elif g.wire_type == _I64 and g.number == 6:
                    v["incarnation"] = g.value
                elif g.wire_type == _LEN and g.number == 5:
                    _validate(buf, g.value, g.end, _DEVICE_LOCALITY)
            out.append(DeviceAttributes(**v))
    except _Malformed as e:
        raise InvalidArgumentError(f"Cannot parse GetStatusResponse: {e}") from e
    return tuple(out)


# ---------------------------------------------------------------------- streaming


# ----------------------------------------------------------------------- Exchange replies
# shmrdv's Exchange stream answers each request_id with one RecvTensorResponse that
# carries extension fields (TensorFlow would skip them as unknown fields): the
# request_id it answers, and instead of a tensor either an error (a grpc status code
# number and its message) or "fetch": too large for the stream, fetch it with
# RecvTensorInline under the same request_id (the server keeps it in its cache).
_LINK_REQUEST_ID_FIELD = 1001
_LINK_CODE_FIELD = 1002
_LINK_MESSAGE_FIELD = 1003
_LINK_FETCH_FIELD = 1004
_MAX_ERROR_MESSAGE = 16 << 10


@dataclass(frozen=True, slots=True)
class LinkReply:
    """The extension fields of an Exchange reply; the tensor itself is ``decode_response``."""

    request_id: int
    code: int = 0  # a grpc status code number; 0: a value (or a fetch)
    message: str = ""
    fetch: bool = False


def encode_link_value(
    request_id: int, value: npt.NDArray[Any], *, is_dead: bool, send_start_micros: int = 0
) -> bytes:
    """An Exchange reply carrying ``value`` for ``request_id`` (one copy of the tensor)."""
    return encode_response(
        value,
        is_dead=is_dead,
        send_start_micros=send_start_micros,
        require_ack=True,
        extra=_int_field(_LINK_REQUEST_ID_FIELD, _check_int64("request_id", request_id)),
    )


def encode_link_error(request_id: int, code: int, message: str) -> bytes:
    """An Exchange reply failing ``request_id`` with grpc status ``code`` (non-zero)."""
    if not 0 < code < 1 << 31:
        raise InvalidArgumentError(f"an error reply needs a non-zero status code, not {code!r}")
    text = message.encode("utf-8", "replace")[:_MAX_ERROR_MESSAGE]
    return (
        _int_field(_LINK_REQUEST_ID_FIELD, _check_int64("request_id", request_id))
        + _int_field(_LINK_CODE_FIELD, code)
        + _len_field(_LINK_MESSAGE_FIELD, text)
    )


def encode_link_fetch(request_id: int) -> bytes:
    """An Exchange reply saying: fetch ``request_id`` with RecvTensorInline."""
    return _int_field(_LINK_REQUEST_ID_FIELD, _check_int64("request_id", request_id)) + _int_field(
        _LINK_FETCH_FIELD, 1
    )


def decode_link_reply(data: _Buffer) -> LinkReply:
    """The extension fields of an Exchange reply; ``InvalidArgumentError`` if they do not
    parse or name no request_id."""
    buf = _as_buffer(data)
    request_id = code = 0
    message = ""
    fetch = False
    try:
        for f in _fields(buf, 0, len(buf)):
            if f.number == _LINK_REQUEST_ID_FIELD and f.wire_type == _VARINT:
                request_id = _signed64(f.value)
            elif f.number == _LINK_CODE_FIELD and f.wire_type == _VARINT:
                code = f.value if f.value < 1 << 31 else 2  # out of range: UNKNOWN
            elif f.number == _LINK_MESSAGE_FIELD and f.wire_type == _LEN:
                end = min(f.end, f.value + _MAX_ERROR_MESSAGE)
                message = bytes(buf[f.value : end]).decode("utf-8", "replace")
            elif f.number == _LINK_FETCH_FIELD and f.wire_type == _VARINT:
                fetch = bool(f.value)
    except _Malformed as e:
        raise InvalidArgumentError(f"Cannot parse an Exchange reply: {e}") from e
    if not request_id:
        raise InvalidArgumentError("Cannot parse an Exchange reply: it names no request_id")
    return LinkReply(request_id, code, message, fetch)


def encode_stream(
    value: npt.NDArray[Any],
    *,
    is_dead: bool,
    chunk_bytes: int,
    send_start_micros: int = 0,
) -> Iterator[bytes]:
    """``TensorChunk`` messages for ``value``: a header (with the first data), then data.

    Each message carries at most ``chunk_bytes`` of tensor data; each is one copy of
    its slice of the buffer. Raises ``InvalidArgumentError`` (at the call, before the
    first message) for a value that cannot be sent or a ``chunk_bytes`` below 1.
    """
    arr = _as_array(value)
    _check_int64("send_start_micros", send_start_micros)
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise InvalidArgumentError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    wire = _contiguous_wire(arr)
    raw = _raw_bytes(wire)
    total = len(raw)
    shape = _shape_bytes(arr.shape)
    header = b"".join(
        [
            _int_field(1, dtype_to_tf(arr.dtype)),
            _len_field(2, shape) if shape else b"",
            _int_field(3, int(bool(is_dead))),
            _int_field(4, total),
            _len_field(5, dtype_descriptor(arr.dtype).encode()),
            _int_field(6, send_start_micros),
        ]
    )
    return _chunks(_len_field(1, header), raw, total, chunk_bytes)


def _chunks(
    header: bytes, raw: memoryview | bytes, total: int, chunk_bytes: int
) -> Iterator[bytes]:
    first = min(total, chunk_bytes)
    head = header + (_tag(3, _LEN) + _varint(first) if first else b"")
    yield b"".join([head, raw[:first]])
    for offset in range(first, total, chunk_bytes):
        n = min(chunk_bytes, total - offset)
        yield b"".join([_int_field(2, offset), _tag(3, _LEN), _varint(n), raw[offset : offset + n]])


class StreamAssembler:
    """Rebuilds one tensor from the ``TensorChunk`` messages of ``encode_stream``.

    ``feed`` each message in order; ``result()`` gives the array once ``complete``. The
    buffer is allocated once, when the header arrives, after its size is checked
    against the header's dtype and shape and against ``max_bytes`` (default: this
    host's physical memory); every chunk is copied into place (one copy) after its
    offset and length are checked. Not thread-safe: one stream, one feeder.
    """

    __slots__ = (
        "_buffer",
        "_dtype",
        "_is_dead",
        "_max_bytes",
        "_received",
        "_result",
        "_send_start_micros",
        "_shape",
        "_total",
    )

    def __init__(self, *, max_bytes: int | None = None) -> None:
        self._max_bytes = _MAX_DECODED_BYTES if max_bytes is None else max_bytes
        self._buffer: npt.NDArray[np.uint8] | None = None
        self._dtype = np.dtype(np.uint8)
        self._shape: tuple[int, ...] = ()
        self._total = 0
        self._received = 0
        self._is_dead = False
        self._send_start_micros = 0
        self._result: npt.NDArray[Any] | None = None

    def __repr__(self) -> str:
        if self._buffer is None:
            return "<StreamAssembler awaiting header>"
        return (
            f"<StreamAssembler {self._dtype} {self._shape}: {self._received}/{self._total} bytes>"
        )

    @property
    def header_received(self) -> bool:
        return self._buffer is not None

    @property
    def complete(self) -> bool:
        """True once the header and every data byte it announced have arrived."""
        return self._buffer is not None and self._received == self._total

    @property
    def is_dead(self) -> bool:
        return self._is_dead

    @property
    def send_start_micros(self) -> int:
        return self._send_start_micros

    def feed(self, message: _Buffer) -> None:
        """Take one ``TensorChunk``; ``InvalidArgumentError`` if it does not fit the stream."""
        buf = _as_buffer(message)
        if self._result is not None:
            raise InternalError("StreamAssembler.feed after result(): the stream was finished")
        try:
            self._feed(buf)
        except _Malformed as e:
            raise InvalidArgumentError(f"Cannot parse tensor stream: {e}") from e

    def _feed(self, buf: _Buffer) -> None:
        header: tuple[int, int] | None = None
        data: tuple[int, int] | None = None
        offset = 0
        for f in _fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == _LEN:
                if header is not None:
                    raise _Malformed("a TensorChunk carries two headers")
                header = (f.value, f.end)
            elif f.number == 2 and f.wire_type == _VARINT:
                offset = f.value
            elif f.number == 3 and f.wire_type == _LEN:
                if data is not None:
                    raise _Malformed("a TensorChunk carries data twice")
                data = (f.value, f.end)
        if header is not None:
            if self._buffer is not None:
                raise _Malformed("a second header in one stream")
            self._start(buf, *header)
        elif self._buffer is None:
            raise _Malformed("the first TensorChunk has no header")
        if data is None:
            return
        start, end = data
        if offset != self._received:
            raise _Malformed(f"chunk at offset {offset}, expected {self._received}")
        if end - start > self._total - self._received:
            raise _Malformed(
                f"chunk of {end - start} bytes at {offset} overruns the {self._total}-byte tensor"
            )
        assert self._buffer is not None
        self._buffer[offset : offset + end - start] = np.frombuffer(
            buf, np.uint8, end - start, start
        )
        self._received += end - start

    def _start(self, buf: _Buffer, start: int, end: int) -> None:
        acc = _TensorAcc()
        total = 0
        for f in _fields(buf, start, end):
            if f.number == 1 and f.wire_type == _VARINT:
                acc.dtype = _signed64(f.value)
            elif f.number == 2 and f.wire_type == _LEN:
                acc.add_shape(buf, f.value, f.end)
            elif f.number == 3 and f.wire_type == _VARINT:
                self._is_dead = bool(f.value)
            elif f.number == 4 and f.wire_type == _VARINT:
                total = f.value
            elif f.number == 5 and f.wire_type == _LEN:
                acc.ext = _utf8(buf, f.value, f.end, "TensorHeader.shmrdv_dtype")
            elif f.number == 6 and f.wire_type == _VARINT:
                self._send_start_micros = _signed64(f.value)
        if not acc.ext:
            raise _Malformed("TensorHeader has no shmrdv_dtype")
        try:
            dtype = _resolve_dtype(acc.dtype, acc.ext)
        except InvalidArgumentError as e:
            raise _Malformed(str(e)) from e
        shape = acc.shape()
        _check_shape(shape, dtype)
        need = _count(shape) * dtype.itemsize
        if need != total:
            raise _Malformed(
                f"{dtype} tensor of shape {shape} is {need} bytes, header says {total}"
            )
        if total > self._max_bytes:
            raise _Malformed(
                f"tensor of {total} bytes exceeds this receiver's limit of {self._max_bytes}"
            )
        if total == 0:
            _empty(shape, dtype)  # checks that numpy can represent the shape
        try:
            self._buffer = np.empty(total, np.uint8)
        except MemoryError as e:
            raise ResourceExhaustedError(
                f"cannot allocate {total} bytes for a {dtype} tensor of shape {shape}"
            ) from e
        self._dtype, self._shape, self._total = dtype, shape, total

    def result(self) -> npt.NDArray[Any]:
        """The assembled array (writable, owned); ``InvalidArgumentError`` if incomplete.

        Calling it again returns the same array.
        """
        if self._result is not None:
            return self._result
        if self._buffer is None:
            raise InvalidArgumentError("tensor stream ended before its header")
        if self._received != self._total:
            raise InvalidArgumentError(
                f"tensor stream ended after {self._received} of {self._total} bytes"
            )
        dtype, shape = self._dtype, self._shape
        wire = _wire_dtype(dtype)
        value = _empty(shape, wire) if self._total == 0 else self._buffer.view(wire).reshape(shape)
        try:
            self._result = _to_dtype(value, dtype)
        except _Malformed as e:
            raise InvalidArgumentError(f"Cannot parse tensor stream: {e}") from e
        return self._result
