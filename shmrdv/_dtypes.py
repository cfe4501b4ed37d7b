"""The dtype descriptor: one byte format naming a numpy dtype, shared by the segment
header (``_shm/layout.py``) and the gRPC tensor coding (``_rpc/tf_dtypes.py``).

A descriptor is one of:

* ``dtype.str`` for plain dtypes (``<f4``, ``|S7``, ``<U5``, ``|b1``, ``<c16``, ``<M8[ns]``);
* ``json:`` + JSON of ``numpy.lib.format.dtype_to_descr(dtype)`` for structured dtypes
  (the ``.npy`` format's description; decoded with ``descr_to_dtype``);
* ``ml_dtypes:<name>`` for ml_dtypes' types (bfloat16, float8_*), imported lazily.

Pure functions, no I/O. A descriptor from another process is hostile: decoding checks
its form before numpy sees it and turns any failure into one ``InternalError``.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from ._errors import InternalError, InvalidArgumentError

__all__ = ["MAX_DTYPE_BYTES", "decode_dtype", "encode_dtype"]

#: The longest descriptor written or read (a corrupted length never makes us allocate much).
MAX_DTYPE_BYTES = 1 << 20

_JSON_TAG = b"json:"
_ML_TAG = b"ml_dtypes:"
_PLAIN_RE = re.compile(rb"[<>|=][a-zA-Z][0-9]{0,10}(\[[0-9]{0,10}[a-zA-Z]{1,3}\])?")
_ML_NAME_RE = re.compile(rb"[a-z][a-z0-9_]{0,63}")


def _json_to_descr(obj: Any) -> Any:
    """Undo JSON's tuple-to-list on a ``dtype_to_descr`` value (fields, titles, shapes)."""
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, list):
        raise ValueError(f"not a dtype description: {obj!r:.80}")
    fields: list[tuple[Any, ...]] = []
    for field in obj:
        if not isinstance(field, list) or len(field) not in (2, 3):
            raise ValueError(f"not a field description: {field!r:.80}")
        name = tuple(field[0]) if isinstance(field[0], list) else field[0]
        if len(field) == 2:
            fields.append((name, _json_to_descr(field[1])))
        else:
            fields.append((name, _json_to_descr(field[1]), tuple(field[2])))
    return fields


@functools.lru_cache(maxsize=256)
def encode_dtype(dtype: np.dtype[Any]) -> bytes:
    """The descriptor bytes of ``dtype``; raises ``InvalidArgumentError`` if it has none."""
    if dtype.hasobject:
        raise InvalidArgumentError(
            f"cannot describe dtype {dtype}: it holds Python objects, whose bytes are "
            "pointers that mean nothing in another process"
        )
    if dtype.type.__module__.startswith("ml_dtypes"):
        encoded = _ML_TAG + dtype.type.__name__.encode("ascii")
    elif dtype.names is None and dtype.subdtype is None:
        encoded = dtype.str.encode("ascii")
    else:
        # What numpy.lib.format.dtype_to_descr returns for a structured dtype (it also
        # warns about metadata, which we drop silently: the .npy format drops it too).
        encoded = _JSON_TAG + json.dumps(dtype.descr).encode("utf-8")
    try:
        same = decode_dtype(encoded) == dtype
    except InternalError:
        same = False
    if not same:
        raise InvalidArgumentError(
            f"cannot describe dtype {dtype!r}: its description {encoded!r:.200} does not round-trip"
        )
    if len(encoded) > MAX_DTYPE_BYTES:
        raise InvalidArgumentError(f"dtype {dtype!r:.200} is too complex to describe")
    return encoded


@functools.lru_cache(maxsize=256)
def decode_dtype(encoded: bytes, where: str = "segment header") -> np.dtype[Any]:
    """The dtype of a descriptor; raises ``InternalError`` ("<where> corrupted: dtype
    ...") for anything unusable."""
    try:
        if encoded.startswith(_JSON_TAG):
            descr = _json_to_descr(json.loads(encoded[len(_JSON_TAG) :].decode("utf-8")))
            if isinstance(descr, str):
                raise ValueError("a plain dtype in the structured form")
            dtype = npy_format.descr_to_dtype(descr)
        elif encoded.startswith(_ML_TAG):
            dtype = _ml_dtype(encoded[len(_ML_TAG) :], where)
        elif _PLAIN_RE.fullmatch(encoded):
            dtype = np.dtype(encoded.decode("ascii"))
        else:
            raise ValueError("not a dtype descriptor")
    except InternalError:
        raise
    except Exception as e:
        # Anything numpy, json or a recursion limit raises on garbage: one error for all.
        raise InternalError(
            f"{where} corrupted: dtype {encoded!r:.200} is unusable ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise InternalError(f"{where} corrupted: dtype {encoded!r:.200} holds Python objects")
    return dtype


def _ml_dtype(name: bytes, where: str) -> np.dtype[Any]:
    if _ML_NAME_RE.fullmatch(name) is None:
        raise ValueError("not an ml_dtypes type name")
    try:
        # Lazily: optional, and only values of its types need it.
        import ml_dtypes
    except ImportError as e:
        raise InternalError(
            f"a {where} names an array of ml_dtypes.{name.decode('ascii')} but ml_dtypes is "
            "not installed in this process (pip install ml_dtypes)"
        ) from e
    scalar_type = getattr(ml_dtypes, name.decode("ascii"), None)
    if not isinstance(scalar_type, type) or not scalar_type.__module__.startswith("ml_dtypes"):
        raise ValueError(f"ml_dtypes has no type {name.decode('ascii')!r}")
    return np.dtype(scalar_type)
