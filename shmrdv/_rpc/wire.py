"""Protocol-buffer primitives, TensorFlow's dtype codes and the TensorProto coding.

Pure functions over buffers (the messages that use them are in ``messages``):

* Primitives: varints and fields; readers raise ``Malformed`` (``InvalidArgumentError``
  at the decoders' edge) and trust no length before checking it.
* Dtypes: numbers and bool as TensorFlow sends them, bytes arrays as ``DT_STRING``;
  dtypes TensorFlow lacks are ``DT_INVALID`` with the numpy dtype in TensorProto field
  1001 (``_values.encode_dtype``). Values travel little-endian.
* TensorProto: ``tensor_parts`` writes it around the array's buffer (TensorFlow's
  ``EncodeTensorToByteBuffer``); ``read_tensor`` and ``tensor_value`` read it back, every
  element count checked before anything is allocated; ``adopt`` lets it stay there.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from .._values import decode_dtype, encode_dtype, shape_problem

__all__ = [
    "DT_INVALID", "DT_STRING", "I64", "LEN", "MAX_DECODED_BYTES", "VARINT", "Buffer",
    "Malformed", "TensorHeader", "adopt", "as_buffer", "check_int64", "dtype_descriptor",
    "dtype_to_tf", "fields", "int_field", "len_field", "put_varint",
    "read_tensor", "read_utf8", "read_varint", "resolve_dtype", "signed64", "tensor_parts",
    "tensor_value", "tf_to_dtype", "varint", "wire_dtype",
]  # fmt: skip

Buffer = bytes | bytearray | memoryview

_U64: Final = (1 << 64) - 1
_I64_MAX: Final = (1 << 63) - 1
VARINT, I64, LEN, I32 = 0, 1, 2, 5
_MAX_DIMS: Final = 64  # numpy's NPY_MAXDIMS
_MAX_DESCRIPTOR_CHARS: Final = 1 << 16


class Malformed(Exception):
    """Internal: the bytes do not parse (``InvalidArgumentError`` at the API edge)."""


# -- primitives ---------------------------------------------------------------------------


def put_varint(out: bytearray, value: int) -> None:
    """Append the varint of ``value`` (a negative int64 as its 10-byte two's complement)."""
    value &= _U64
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


_ONE_BYTE: Final = [bytes((i,)) for i in range(0x80)]


def varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    put_varint(out, value)
    return bytes(out)


def int_field(number: int, value: int) -> bytes:
    """A varint field, left out when zero (proto3)."""
    return varint(number << 3) + varint(value) if value else b""


def len_field(number: int, payload: bytes) -> bytes:
    return varint((number << 3) | LEN) + varint(len(payload)) + payload


def check_int64(name: str, value: object) -> int:
    """``value`` if it is an int64, else ``InvalidArgumentError`` naming ``name``."""
    if type(value) is int and -_I64_MAX - 1 <= value <= _I64_MAX:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if not -_I64_MAX - 1 <= value <= _I64_MAX:
        raise InvalidArgumentError(f"{name}={value} does not fit in an int64")
    return value


def signed64(value: int) -> int:
    return value - (1 << 64) if value > _I64_MAX else value


def read_varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``."""
    result = shift = 0
    while True:
        if pos >= end:
            raise Malformed("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise Malformed("varint longer than 10 bytes")


def fields(buf: Buffer, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """The fields of the message in ``buf[pos:end]`` as (number, wire type, value, end):
    a varint's or fixed field's value (``end`` past it), or a LEN field's payload start
    and end."""
    while pos < end:
        tag = buf[pos]  # one-byte varints (most tags, flags and lengths) read inline
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0 or tag > 0xFFFFFFFF:
            raise Malformed(f"invalid tag {tag}")
        if wire_type == VARINT:
            if pos < end and buf[pos] < 0x80:
                value, pos = buf[pos], pos + 1
            else:
                value, pos = read_varint(buf, pos, end)
            yield number, VARINT, value, pos
        elif wire_type == LEN:
            if pos < end and buf[pos] < 0x80:
                length, pos = buf[pos], pos + 1
            else:
                length, pos = read_varint(buf, pos, end)
            if length > end - pos:
                raise Malformed(f"field {number} declares {length} bytes, {end - pos} remain")
            yield number, LEN, pos, pos + length
            pos += length
        elif wire_type in (I64, I32):
            size = 8 if wire_type == I64 else 4
            if pos + size > end:
                raise Malformed("truncated fixed-width field")
            value = int.from_bytes(buf[pos : pos + size], "little")
            pos += size
            yield number, wire_type, value, pos
        else:  # groups too: proto2's, in no message here (and TensorFlow's are proto3)
            raise Malformed(f"invalid wire type {wire_type} (field {number})")


def read_utf8(buf: Buffer, start: int, end: int, what: str) -> str:
    try:
        return bytes(buf[start:end]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise Malformed(f"{what} is not valid UTF-8") from e


def as_buffer(data: object) -> Buffer:
    if isinstance(data, bytes | bytearray):
        return data
    if isinstance(data, memoryview):
        try:
            return data.cast("B")
        except TypeError as e:
            raise InvalidArgumentError("message buffer is not C-contiguous") from e
    raise InvalidArgumentError(f"message must be bytes, got {type(data).__qualname__}")


# CPython's accessor of a bytes object's storage; elsewhere a received value is copied.
_storage: Any = None
if sys.implementation.name == "cpython":
    _storage = ctypes.pythonapi.PyBytes_AsString
    _storage.restype, _storage.argtypes = ctypes.c_void_p, [ctypes.py_object]


def adopt(message: Buffer, start: int, end: int) -> memoryview | None:
    """A writable view of ``message[start:end]``, which lives as long as the view, for a
    message nobody reads again (fresh from grpcio): a received value can live in it instead
    of in a copy. None where that cannot be done."""
    if _storage is None or type(message) is not bytes:
        return None
    face = {"data": (_storage(message) + start, False), "shape": (end - start,), "typestr": "|u1"}
    return np.asarray(SimpleNamespace(message=message, __array_interface__=face)).data


# -- dtypes -------------------------------------------------------------------------------

DT_INVALID: Final = 0
DT_STRING: Final = 7
# TensorFlow's DataType codes (tensorflow/core/framework/types.proto) of numpy's kinds.
_TF_OF_NUMPY: dict[np.dtype[Any], int] = {
    np.dtype(s): code
    for s, code in (
        ("<f4", 1), ("<f8", 2), ("<i4", 3), ("u1", 4), ("<i2", 5), ("i1", 6), ("<c8", 8),
        ("<i8", 9), ("?", 10), ("<u2", 17), ("<c16", 18), ("<f2", 19), ("<u4", 22), ("<u8", 23),
    )
}  # fmt: skip
_NUMPY_OF_TF: dict[int, np.dtype[Any]] = {v: k for k, v in _TF_OF_NUMPY.items()}
# Quantized types have no numpy kind: their storage integer (QINT8, QUINT8, QINT16,
# QUINT16, QINT32); DT_STRING's width comes from the data.
_NUMPY_OF_TF.update(
    {11: np.dtype("i1"), 12: np.dtype("u1"), 15: np.dtype("<i2"), 16: np.dtype("<u2"),
     13: np.dtype("<i4"), DT_STRING: np.dtype("S")}
)  # fmt: skip
# ml_dtypes kinds TensorFlow names (int4/uint4 left out: TensorFlow may pack them).
_ML_TF_CODES: Final = {
    "bfloat16": 14, "float8_e5m2": 24, "float8_e4m3fn": 25, "float8_e4m3fnuz": 26,
    "float8_e5m2fnuz": 28,
}  # fmt: skip
_ML_CODES: Final = frozenset(_ML_TF_CODES.values())
_ML_NAME_OF: dict[np.dtype[Any], str] = {}
# ml_dtypes costs ~0.6 s to import: its kinds join the tables when one is first met.
_ml_lock = threading.Lock()
_ml_looked = [False]


def _with_ml_dtypes() -> None:
    with _ml_lock:
        if _ml_looked[0]:
            return
        try:
            import ml_dtypes
        except ImportError:
            _ml_looked[0] = True
            return
        for name in dir(ml_dtypes):
            if name.startswith("_") or name in ("finfo", "iinfo"):
                continue
            try:
                dt = np.dtype(getattr(ml_dtypes, name))
            except TypeError:
                continue
            _ML_NAME_OF[dt] = name
            if name in _ML_TF_CODES:
                _TF_OF_NUMPY[dt] = _ML_TF_CODES[name]
                _NUMPY_OF_TF[_ML_TF_CODES[name]] = dt
        _ml_looked[0] = True


def _is_ml(dtype: np.dtype[Any]) -> bool:
    if dtype.kind != "V" or dtype.fields is not None:
        return False
    if not _ml_looked[0] and dtype.type.__module__.startswith("ml_dtypes"):
        _with_ml_dtypes()
    return dtype in _ML_NAME_OF


def wire_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` in little-endian byte order (recursively for structured dtypes)."""
    if _is_ml(dtype):
        return dtype
    wire: np.dtype[Any] = dtype.newbyteorder("<")
    return wire


def _refuse_object(dtype: np.dtype[Any]) -> None:
    if dtype.hasobject:
        raise InvalidArgumentError(
            f"cannot encode a tensor of dtype {dtype}: it holds Python objects, whose bytes "
            "are pointers that mean nothing in another process"
        )


def dtype_to_tf(dtype: npt.DTypeLike) -> int:
    """TensorFlow's ``DataType`` code of a numpy dtype, byte order ignored: ``DT_STRING``
    for ``'S'``, ``DT_INVALID`` for dtypes TensorFlow lacks. ``InvalidArgumentError`` for
    object dtypes and what numpy does not take as a dtype."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"not a numpy dtype: {dtype!r}") from e
    _refuse_object(dt)
    if dt.kind == "S":
        return DT_STRING
    return _TF_OF_NUMPY.get(wire_dtype(dt), DT_INVALID)


def tf_to_dtype(code: int) -> np.dtype[Any]:
    """The (little-endian) numpy dtype of TensorFlow's ``code``: ``np.dtype('S')`` for
    ``DT_STRING``, the storage integer of a quantized type. ``InvalidArgumentError`` for
    ``DT_INVALID``, resource, variant, ``*_REF`` and unknown codes."""
    dt = _NUMPY_OF_TF.get(code)
    if dt is None and code in _ML_CODES and not _ml_looked[0]:
        _with_ml_dtypes()
        dt = _NUMPY_OF_TF.get(code)
    if dt is not None:
        return dt
    hint = " (install ml_dtypes to receive it)" if code in _ML_CODES else ""
    raise InvalidArgumentError(f"no numpy dtype for TensorFlow DataType {code}{hint}")


def dtype_descriptor(dtype: np.dtype[Any]) -> str:
    """The ``shmrdv_dtype`` text of ``dtype``."""
    _refuse_object(dtype)
    if dtype.fields is not None and _has_ml_field(dtype):
        raise InvalidArgumentError(
            f"cannot encode structured dtype {dtype}: a field has an ml_dtypes type, which "
            "the dtype descriptor cannot name; view the field as an integer of the same size"
        )
    return encode_dtype(dtype).decode("utf-8")


def _has_ml_field(dtype: np.dtype[Any]) -> bool:
    if dtype.subdtype is not None:
        return _has_ml_field(dtype.subdtype[0])
    if dtype.fields is None:
        return _is_ml(dtype)
    return any(_has_ml_field(spec[0]) for spec in dtype.fields.values())


def resolve_dtype(code: int, ext: str) -> np.dtype[Any]:
    """The numpy dtype a tensor decodes to, from its TensorFlow code and ``shmrdv_dtype``."""
    if not ext:
        return tf_to_dtype(code)
    if len(ext) > _MAX_DESCRIPTOR_CHARS:
        raise InvalidArgumentError(f"shmrdv_dtype is {len(ext)} characters long, too long")
    try:
        dt = decode_dtype(ext.encode("utf-8"), "shmrdv_dtype")
    except InternalError as e:
        raise InvalidArgumentError(str(e)) from e
    if code != dtype_to_tf(dt):
        raise InvalidArgumentError(
            f"shmrdv_dtype {ext!r} contradicts TensorFlow dtype {code}: corrupted tensor"
        )
    return dt


# -- TensorProto --------------------------------------------------------------------------


def _default_max_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


#: No decoded tensor may be larger than this host's memory, whatever a peer declares.
MAX_DECODED_BYTES: Final = _default_max_bytes()


def _dim(size: int) -> bytes:
    return len_field(2, int_field(1, size))  # TensorShapeProto.dim: a Dim of one size


_SHAPES: dict[tuple[int, ...], bytes] = {}  # shape fields made so far (a bounded cache)
_SHAPES_KEPT: Final = 4096
# The plain number and bool dtypes (no ml_dtypes yet): ``tensor_content`` as it is.
_PLAIN_HEADS: Final = {d: int_field(1, code) for d, code in _TF_OF_NUMPY.items()}
_CONTENT_TAG: Final = b"\x22"  # field 4, LEN


def _shape_field(shape: tuple[int, ...]) -> bytes:
    """TensorProto's ``tensor_shape`` field; nothing for a scalar (TensorFlow's way)."""
    if not shape:
        return b""
    field = _SHAPES.get(shape)
    if field is None:
        if len(_SHAPES) >= _SHAPES_KEPT:
            _SHAPES.clear()
        field = _SHAPES[shape] = len_field(2, b"".join([_dim(n) for n in shape]))
    return field


def _string_list(arr: npt.NDArray[Any]) -> bytes:
    """TensorFlow's ``port::EncodeStringList``: every varint32 length, then the strings."""
    items = [bytes(x) for x in arr.reshape(-1).tolist()]
    return b"".join([*(varint(len(s)) for s in items), *items])


def tensor_parts(arr: npt.NDArray[Any]) -> tuple[bytes, memoryview | bytes, bytes]:
    """The TensorProto of ``arr`` as (head, content, tail): ``content`` is the array's own
    buffer (or its little-endian copy); the message is their concatenation. The head
    ends with the ``tensor_content`` tag and length. ``InvalidArgumentError`` for an
    array the wire cannot carry."""
    dtype = arr.dtype
    head = _PLAIN_HEADS.get(dtype) if arr.flags.c_contiguous else None
    tail = b""
    if head is not None:  # a plain number or bool array as it is: the usual case
        content: memoryview | bytes = arr.reshape(-1).view(np.uint8).data
        head += _shape_field(arr.shape)
    else:
        code = dtype_to_tf(dtype)
        if code == DT_STRING:
            content = _string_list(arr)
        else:
            wire = wire_dtype(dtype)
            if dtype != wire:
                arr = arr.astype(wire, order="C")
            elif not arr.flags.c_contiguous:
                arr = arr.copy(order="C")
            content = arr.reshape(-1).view(np.uint8).data if arr.nbytes else b""
        if code in (DT_INVALID, DT_STRING) or dtype != wire_dtype(dtype):
            tail = len_field(1001, dtype_descriptor(dtype).encode())
        head = int_field(1, code) + _shape_field(arr.shape)
    if len(content):
        head += _CONTENT_TAG + varint(len(content))
    else:
        content = b""
    return head, content, tail


class TensorHeader:
    """What a TensorProto says of its tensor: dtype code, dims, ``shmrdv_dtype`` and where
    its ``tensor_content`` is in the buffer (a later occurrence of a field wins, and dims
    add up, as protobuf merges repeated messages)."""

    __slots__ = ("code", "content", "dims", "ext", "unknown_rank")

    def __init__(self) -> None:
        self.code = DT_INVALID
        self.dims: list[int] | None = None
        self.unknown_rank = False
        self.content = (0, 0)
        self.ext = ""

    def shape(self) -> tuple[int, ...]:
        if self.unknown_rank:
            raise Malformed("tensor shape has unknown rank")
        dims = tuple(self.dims or ())
        if any(d < 0 for d in dims):
            raise Malformed(f"tensor shape {list(dims)} has a negative (unknown) size")
        return dims

    def dtype(self) -> np.dtype[Any]:
        try:
            return resolve_dtype(self.code, self.ext)
        except InvalidArgumentError as e:
            raise Malformed(str(e)) from e


# TensorProto's typed value fields: TensorFlow's RecvTensor never sends them.
_VAL_FIELDS: Final = {
    5: "float_val", 6: "double_val", 7: "int_val", 8: "string_val", 9: "scomplex_val",
    10: "int64_val", 11: "bool_val", 12: "dcomplex_val", 13: "half_val", 16: "uint32_val",
    17: "uint64_val",
}  # fmt: skip


def read_tensor(buf: Buffer, start: int, end: int, into: TensorHeader) -> None:
    """Read the TensorProto in ``buf[start:end]`` into ``into``."""
    for number, wire_type, value, stop in fields(buf, start, end):
        if number == 1 and wire_type == VARINT:
            into.code = signed64(value)
        elif number == 2 and wire_type == LEN:
            dims = into.dims if into.dims is not None else []
            for n, w, v, e in fields(buf, value, stop):
                if n == 2 and w == LEN:
                    size = 0
                    for n2, w2, v2, e2 in fields(buf, v, e):
                        if n2 == 1 and w2 == VARINT:
                            size = signed64(v2)
                        elif n2 == 2 and w2 == LEN:
                            read_utf8(buf, v2, e2, "TensorShapeProto.Dim.name")
                    dims.append(size)
                    if len(dims) > _MAX_DIMS:
                        raise Malformed(f"shape has more than {_MAX_DIMS} dimensions")
                elif n == 3 and w == VARINT:
                    into.unknown_rank = bool(v)
            into.dims = dims
        elif number == 4 and wire_type == LEN:
            into.content = (value, stop)
        elif number == 1001 and wire_type == LEN:
            into.ext = read_utf8(buf, value, stop, "TensorProto.shmrdv_dtype")
        elif number in _VAL_FIELDS and (wire_type != LEN or stop > value or number == 8):
            raise Malformed(
                f"TensorProto.{_VAL_FIELDS[number]} is not supported: shmrdv reads "
                "tensor_content, which is what TensorFlow's RecvTensor sends"
            )


def check_shape(shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    """The element-count rule every decoded tensor passes before anything is allocated."""
    problem = shape_problem(shape, dtype.itemsize)
    if problem is not None:
        raise Malformed(f"a {dtype} tensor: {problem}")


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    try:
        return np.empty(shape, dtype)
    except (ValueError, MemoryError) as e:  # e.g. "array is too big" for a zero itemsize
        raise Malformed(f"cannot make an empty {dtype} array of shape {shape}: {e}") from e


def tensor_value(
    head: TensorHeader, content: Buffer, is_dead: bool, *, copy: bool
) -> npt.NDArray[Any]:
    """The array a TensorProto (``head``; its ``content`` bytes) describes. ``copy``: a
    private, writable array (the one copy); else a read-only view where no conversion
    is needed."""
    shape = head.shape()
    if (
        head.code == DT_INVALID
        and not head.ext
        and is_dead
        and not len(content)
        and (head.dims is None or 0 in shape)
    ):
        # A dead value may come with no tensor: TensorFlow's default Tensor() is "a
        # 1-dimensional, 0-element float tensor" (tensor.h).
        return _empty((0,) if head.dims is None else shape, np.dtype(np.float32))
    dtype = head.dtype()
    check_shape(shape, dtype)
    count = 1
    for d in shape:
        count *= d
    if head.code == DT_STRING:
        return _strings(content, count, shape, dtype)
    wire = wire_dtype(dtype)
    if count * wire.itemsize != len(content):
        raise Malformed(
            f"{dtype} tensor of shape {shape} needs {count * wire.itemsize} content bytes, "
            f"got {len(content)}"
        )
    if not len(content):
        value = _empty(shape, wire)
    else:
        value = np.frombuffer(content, wire, count).reshape(shape)
        if copy and wire == dtype:
            private: npt.NDArray[Any] = value.copy()
            return private
    if value.dtype == dtype:
        return value
    try:
        converted: npt.NDArray[Any] = value.astype(dtype)
    except (TypeError, ValueError) as e:
        raise Malformed(f"cannot convert the received {value.dtype} to {dtype}: {e}") from e
    return converted


def _strings(buf: Buffer, n: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    end = len(buf)
    if n > end:  # each string costs at least one length byte
        raise Malformed(f"DT_STRING tensor of shape {shape} cannot fit in {end} bytes")
    lengths = []
    pos = 0
    for _ in range(n):
        length, pos = read_varint(buf, pos, end)
        if length > 0xFFFFFFFF:
            raise Malformed("DT_STRING length does not fit in a varint32")
        lengths.append(length)
    if sum(lengths) != end - pos:
        raise Malformed(
            f"DT_STRING lengths add up to {sum(lengths)} bytes, the content holds {end - pos}"
        )
    width = dtype.itemsize or max(lengths, default=1) or 1
    if lengths and max(lengths) > width:
        raise Malformed(f"a DT_STRING element of {max(lengths)} bytes does not fit {dtype}")
    if n * width > MAX_DECODED_BYTES:
        raise Malformed(f"{n} strings of width {width} exceed this host's memory")
    try:
        out = np.zeros(n, np.dtype(f"S{width}"))
    except MemoryError as e:
        raise ResourceExhaustedError(f"cannot allocate {n} strings of width {width}") from e
    for i, length in enumerate(lengths):
        out[i] = bytes(buf[pos : pos + length])
        pos += length
    return out.reshape(shape)
