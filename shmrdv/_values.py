"""Which values may be sent: numpy arrays whose dtype holds no Python objects."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import InvalidArgumentError

__all__ = [
    "MAX_ELEMENTS",
    "MAX_ZERO_ITEM_ELEMENTS",
    "as_ndarray",
    "check_value",
    "shape_problem",
]

#: The most elements any tensor may have, whatever its item size (2**40: 4 TiB of float32).
#: A peer's header or wire message is checked against it before anything is allocated or
#: looped over: a count bounded only through ``nbytes`` lets zero-byte items through.
MAX_ELEMENTS = 1 << 40
#: Zero-byte items (``V0``, ``S0``, ``U0``) carry no data but still cost per-element work
#: (numpy even widens ``S0`` to ``S1`` when it allocates): a much lower bound for them.
MAX_ZERO_ITEM_ELEMENTS = 1 << 24


# ndarray subclasses whose instance attributes only describe where the bytes live
# (np.memmap: file, offset, mode) or how numpy indexes them (np.matrix's ``_getitem``
# flag): every value is in the bytes, so they go as the plain array they view.
_VALUES_IN_BYTES: tuple[type, ...] = (np.memmap, np.matrix)
# Listed by name in a refusal, at most this many.
_MAX_NAMED_ATTRIBUTES = 5


def as_ndarray(value: object, verb: str, where: str = "") -> npt.NDArray[Any]:
    """``value`` as a plain ndarray (a numpy scalar as a 0-d array); else raise.

    An ndarray subclass whose instances hold nothing beyond their bytes (``np.memmap``,
    ``np.matrix``, ``np.recarray``, any subclass without instance attributes) is returned
    as a plain ``numpy.ndarray`` view of the same memory: that is what a receiver gets.
    One that holds more (a masked array's mask, a unit, ...) is refused, since the receiver
    would silently lose it. The ``InvalidArgumentError`` reads "cannot <verb> a
    <type><where>: ...".
    """
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
    """The plain-ndarray view of a subclass instance whose values are all in its bytes."""
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
    """The names of the attributes an ndarray subclass instance holds (``__dict__`` and
    ``__slots__``), sorted."""
    names = set(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                names.add(slot)
    return sorted(names)


def check_value(value: object, key: str) -> npt.NDArray[Any]:
    """Return ``value`` as an ndarray, or raise ``InvalidArgumentError`` saying why not.

    Accepts any ``numpy.ndarray`` (any shape, 0-d and empty included) and numpy scalars
    (as 0-d arrays). Refuses dtypes that hold Python objects, at any depth of a
    structured dtype: their bytes are pointers, meaningless in another process.
    """
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
    """Why an array of ``shape`` with ``itemsize``-byte items is refused, or None.

    The one rule shared by ``send`` (the caller's value), the segment header, the ring
    record and the gRPC coding (a peer's bytes): every dimension >= 0, at most
    ``MAX_ELEMENTS`` elements (``MAX_ZERO_ITEM_ELEMENTS`` for zero-byte items), counted
    with zero dimensions taken as 1 so that ``(0, 2**62)`` is refused too.
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
