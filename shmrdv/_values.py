"""Which values may be sent (numpy arrays whose dtype holds no Python objects), how a dtype
is described on the wire, and the size rules every peer's shape is checked against."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib import format as npy_format

from ._errors import InternalError, InvalidArgumentError

__all__ = ["MAX_DTYPE_BYTES", "MAX_ELEMENTS", "MAX_ZERO_ITEM_ELEMENTS", "as_ndarray", "check_value"]
__all__ += ["decode_dtype", "encode_dtype", "shape_problem"]


#: The longest descriptor written or read (a corrupted length never makes us allocate much).
MAX_DTYPE_BYTES = 1 << 20

_JSON_TAG = b"json:"
_ML_TAG = b"ml_dtypes:"
_PLAIN_RE = re.compile(rb"[<>|=][a-zA-Z][0-9]{0,10}(\[[0-9]{0,10}[a-zA-Z]{1,3}\])?")
_ML_NAME_RE = re.compile(rb"[a-z][a-z0-9_]{0,63}")


def _json_to_descr(obj: Any) -> Any:
    """Undo JSON's tuple-to-list on a ``dtype.descr`` (fields, titles, shapes)."""
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
        # numpy's dtype_to_descr form (metadata dropped, as the .npy format drops it).
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
    """The dtype of a descriptor; ``InternalError`` ("<where> corrupted") if unusable."""
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
        # Optional: only values of its types need it.
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


#: The most elements any tensor may have, checked before a peer's shape makes us allocate
#: or loop (a bound through ``nbytes`` alone lets zero-byte items through).
MAX_ELEMENTS = 1 << 40
#: Zero-byte items (``V0``, ``S0``) still cost per-element work (numpy widens ``S0`` to
#: ``S1`` when it allocates): a lower bound for them.
MAX_ZERO_ITEM_ELEMENTS = 1 << 24


# ndarray subclasses whose instance attributes only describe where the bytes live
# (np.memmap: file, offset, mode) or how numpy indexes them (np.matrix's ``_getitem``
# flag): every value is in the bytes, so they go as the plain array they view.
_VALUES_IN_BYTES: tuple[type, ...] = (np.memmap, np.matrix)
# Listed by name in a refusal, at most this many.
_MAX_NAMED_ATTRIBUTES = 5


def as_ndarray(value: object, verb: str, where: str = "") -> npt.NDArray[Any]:
    """``value`` as a plain ndarray (a numpy scalar as 0-d), else ``InvalidArgumentError``
    ("cannot <verb> a <type><where>: ..."). A subclass holding more than its bytes (a mask,
    a unit) is refused: the receiver would silently lose it."""
    if type(value) is np.ndarray:
        return value
    if isinstance(value, np.ndarray):
        return _plain(value, verb, where)
    if isinstance(value, np.generic):
        return np.asarray(value)
    raise InvalidArgumentError(
        f"cannot {verb} a {_type_name(value)}{where}: only numpy arrays (or numpy scalars) are "
        "accepted; wrap it with numpy.asarray(...)"
    )


def _type_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _plain(value: npt.NDArray[Any], verb: str, where: str) -> npt.NDArray[Any]:
    if isinstance(value, np.ma.MaskedArray):
        raise InvalidArgumentError(
            f"cannot {verb} a numpy.ma.MaskedArray{where}: only its data would travel, so the "
            "receiver would get a plain array without the mask (and whatever values lie under "
            "the masked entries); send numpy.ma.getdata(a) or a.filled(fill_value) for the "
            "values, and numpy.ma.getmaskarray(a) under a second key if the receiver needs "
            "the mask"
        )
    if not isinstance(value, _VALUES_IN_BYTES):
        state = _instance_state(value)
        if state:
            named = ", ".join(state[:_MAX_NAMED_ATTRIBUTES])
            more = ", ..." if len(state) > _MAX_NAMED_ATTRIBUTES else ""
            raise InvalidArgumentError(
                f"cannot {verb} a {_type_name(value)}{where}: this ndarray subclass holds "
                f"state its bytes do not (attributes {named}{more}), which the receiver "
                "would silently lose, getting a plain numpy.ndarray; send numpy.asarray(a) if "
                "the plain values are what you mean, and what else it holds separately"
            )
    return value.view(np.ndarray)


def _instance_state(value: npt.NDArray[Any]) -> list[str]:
    """The attributes an ndarray subclass instance holds (``__dict__`` and ``__slots__``)."""
    names = set(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                names.add(slot)
    return sorted(names)


def check_value(value: object, key: str) -> npt.NDArray[Any]:
    """``value`` as a sendable ndarray (``as_ndarray``, ``shape_problem``, no objects at
    any depth), else ``InvalidArgumentError`` saying why."""
    # A non-empty plain array has no zero dimension to count as 1: its size is the rule's.
    if type(value) is np.ndarray and 0 < value.size <= MAX_ELEMENTS and not value.dtype.hasobject:
        return value
    arr = as_ndarray(value, "send", f" under key {key!r}")
    problem = shape_problem(arr.shape, arr.dtype.itemsize)
    if problem is not None:
        raise InvalidArgumentError(f"cannot send this array under key {key!r}: {problem}")
    if arr.dtype.hasobject:
        raise InvalidArgumentError(
            f"cannot send an array of dtype {arr.dtype} under key {key!r}: it holds Python objects, "
            "whose bytes are pointers that mean nothing in another process; convert it to a "
            "numeric, bool, bytes (S) or unicode (U) dtype first"
        )
    return arr


def shape_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why an array of ``shape`` with ``itemsize``-byte items is refused, or None: the one
    rule of ``send`` and of every wire. Zero dimensions count as 1 (``(0, 2**62)`` is refused).
    """
    count = 1
    for d in shape:
        if d < 0:
            return f"negative dimension in shape {shape!r:.200}"
        count *= d if d else 1
        if count > MAX_ELEMENTS:
            return f"shape {shape!r:.200} has more than {MAX_ELEMENTS} elements"
    if itemsize == 0 and count > MAX_ZERO_ITEM_ELEMENTS:
        return (
            f"shape {shape!r:.200} of zero-byte items has more than {MAX_ZERO_ITEM_ELEMENTS} "
            "elements"
        )
    return None
