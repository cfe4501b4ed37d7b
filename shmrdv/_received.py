"""The value a receive hands back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Received", "received"]


@dataclass(frozen=True, slots=True)
class Received:
    """A received tensor: ``value`` and TensorFlow's ``is_dead`` flag.

    ``is_dead`` is set for values of untaken control-flow branches; the value still has
    the sender's dtype and shape. Unpacks as ``value, is_dead = rdv.recv(key)``.
    """

    value: npt.NDArray[Any]
    is_dead: bool = False

    def __iter__(self) -> Any:
        return iter((self.value, self.is_dead))

    def __repr__(self) -> str:
        v = self.value
        return f"Received(value=<ndarray {v.dtype} {v.shape}>, is_dead={self.is_dead})"


# ``Received``'s slots, set directly: a frozen dataclass's ``__init__`` goes through
# ``object.__setattr__`` per field, which doubles the cost of building one.
_slots: Any = Received
_new = object.__new__
_set_value = _slots.value.__set__
_set_is_dead = _slots.is_dead.__set__


def received(value: npt.NDArray[Any], is_dead: bool) -> Received:
    """``Received(value, is_dead)``, built at half the cost: for the receive side's hot
    loop (one per message arriving). ``is_dead`` must be a ``bool``."""
    r: Received = _new(Received)
    _set_value(r, value)
    _set_is_dead(r, is_dead)
    return r


def same_value(a: Received, b: Received) -> bool:
    """Equal dtype, shape, bytes and ``is_dead`` (for tests and checks; NaN-safe)."""
    return (
        a.is_dead == b.is_dead
        and a.value.dtype == b.value.dtype
        and a.value.shape == b.value.shape
        and np.ascontiguousarray(a.value).tobytes() == np.ascontiguousarray(b.value).tobytes()
    )
