"""How a numpy dtype is named on the wire: TensorFlow's ``DataType``, else ``shmrdv_dtype``.

Pure: no gRPC, no I/O; thread model: none needed (the tables are built at import and only
read). ``tensors`` codes a TensorProto with these codes; the stream header
(``assembly``) uses them too.

* numbers and bool go as TensorFlow sends them; float16 is ``DT_HALF``; ``ml_dtypes``
  bfloat16 and float8 kinds, when importable, have TensorFlow's codes too.
* numpy bytes arrays (``'S<n>'``) are ``DT_STRING``; the ``shmrdv_dtype`` extension
  carries ``'|S<n>'`` so a shmrdv peer gets the same width back (a TensorFlow peer gets
  the strings).
* **Dtypes TensorFlow lacks** (unicode ``'U'``, structured, datetime64/timedelta64,
  ``'V'``, other ml_dtypes kinds) are ``DT_INVALID`` with the numpy dtype in the
  ``shmrdv_dtype`` extension (TensorProto field 1001). shmrdv peers decode them
  exactly; **a TensorFlow peer cannot** and fails with "Cannot parse tensor from
  response". We chose this over refusing them because the shmrdv contract promises
  every non-object dtype on every transport. Object dtypes are always refused.
* Big-endian (non-native) dtypes travel little-endian (``wire_dtype``), as TensorFlow's
  wire is; the extension names the original byte order.

``shmrdv_dtype`` format: the dtype descriptor the segment header also uses
(``shmrdv/_values.py``): ``dtype.str`` for simple dtypes, ``json:`` + the ``.npy``
description for structured ones, ``ml_dtypes:<name>`` for ml_dtypes kinds.

Errors: ``InvalidArgumentError`` for a dtype that cannot be sent or a descriptor or code
that names none.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from enum import IntEnum
from types import MappingProxyType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._errors import InternalError, InvalidArgumentError
from .._values import decode_dtype, encode_dtype

__all__ = [
    "PLAIN_OF_TF",
    "DataType",
    "dtype_descriptor",
    "dtype_from_descriptor",
    "dtype_to_tf",
    "refuse_object",
    "resolve_dtype",
    "tf_to_dtype",
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


# A dtype descriptor longer than this is refused before it is parsed.
_MAX_DESCRIPTOR_CHARS: Final = 1 << 16

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


#: The plain number and bool dtypes by TensorFlow code: their values are ``tensor_content``
#: as it is (no descriptor, no conversion), what a receive may read without more checks.
PLAIN_OF_TF: Final[Mapping[int, np.dtype[Any]]] = MappingProxyType(
    {int(v): k for k, v in _TF_OF_NUMPY.items()}
)


# ml_dtypes kinds by attribute name; those TensorFlow names get its code. int4/uint4
# are left out of TensorFlow's codes: TensorFlow may pack them two to a byte.
_ML_TF_CODES: Final = {
    "bfloat16": DataType.DT_BFLOAT16,
    "float8_e5m2": DataType.DT_FLOAT8_E5M2,
    "float8_e4m3fn": DataType.DT_FLOAT8_E4M3FN,
    "float8_e4m3fnuz": DataType.DT_FLOAT8_E4M3FNUZ,
    "float8_e5m2fnuz": DataType.DT_FLOAT8_E5M2FNUZ,
}


_ML_CODES: Final = frozenset(int(code) for code in _ML_TF_CODES.values())
_ML_NAME_OF: dict[np.dtype[Any], str] = {}


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


# ml_dtypes (optional: bfloat16, float8, int4) costs about 0.6 s to import, so its kinds
# join the tables only when one is met: an array of one (whose owner imported it
# already) or a TensorFlow code that needs one.
_ml_lock = threading.Lock()
_ml_state = [False]  # whether the ml_dtypes kinds were looked for


def _with_ml_dtypes() -> None:
    """Add ml_dtypes' kinds to the tables, once, if it is installed."""
    with _ml_lock:
        if _ml_state[0]:
            return
        try:
            import ml_dtypes
        except ImportError:
            _ml_state[0] = True
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
                _NUMPY_OF_TF[int(_ML_TF_CODES[name])] = dt
        _ml_state[0] = True


def _is_ml(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is one of ml_dtypes' kinds (void kind, from its module)."""
    if dtype.kind != "V" or dtype.fields is not None:
        return False
    if not _ml_state[0] and dtype.type.__module__.startswith("ml_dtypes"):
        _with_ml_dtypes()
    return dtype in _ML_NAME_OF


def wire_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` in little-endian byte order (recursively for structured dtypes)."""
    if _is_ml(dtype):
        return dtype
    wire: np.dtype[Any] = dtype.newbyteorder(_LE_BYTE_ORDER)
    return wire


def refuse_object(dtype: np.dtype[Any], what: str) -> None:
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
    refuse_object(dt, "a tensor")
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
    if int(code) in _ML_CODES and not _ml_state[0]:
        _with_ml_dtypes()
        dt = _NUMPY_OF_TF.get(int(code))
        if dt is not None:
            return dt
    try:
        name = DataType(code).name
    except ValueError:
        name = f"unknown DataType {code}"
    hint = ""
    if int(code) in _ML_CODES:
        hint = " (install ml_dtypes to receive it)"
    raise InvalidArgumentError(f"no numpy dtype for TensorFlow {name}{hint}")


def dtype_descriptor(dtype: np.dtype[Any]) -> str:
    """The ``shmrdv_dtype`` string for ``dtype`` (``_dtypes.encode_dtype``)."""
    refuse_object(dtype, "a tensor")
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
        return _is_ml(dtype)
    return any(_has_ml_field(spec[0]) for spec in dtype.fields.values())


def dtype_from_descriptor(text: str) -> np.dtype[Any]:
    """Parse a ``shmrdv_dtype`` string; ``InvalidArgumentError`` if it is not one."""
    if len(text) > _MAX_DESCRIPTOR_CHARS:
        raise InvalidArgumentError(f"shmrdv_dtype is {len(text)} characters long, too long")
    try:
        return decode_dtype(text.encode("utf-8"), "shmrdv_dtype")
    except InternalError as e:
        raise InvalidArgumentError(str(e)) from e


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
