"""The value a receive hands back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Received"]


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


def same_value(a: Received, b: Received) -> bool:
    """Equal dtype, shape, bytes and ``is_dead`` (for tests and checks; NaN-safe)."""
    return (
        a.is_dead == b.is_dead
        and a.value.dtype == b.value.dtype
        and a.value.shape == b.value.shape
        and np.ascontiguousarray(a.value).tobytes() == np.ascontiguousarray(b.value).tobytes()
    )
