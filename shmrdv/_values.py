"""Which values may be sent: numpy arrays whose dtype holds no Python objects."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import InvalidArgumentError

__all__ = ["check_value"]


def check_value(value: object, key: str) -> npt.NDArray[Any]:
    """Return ``value`` as an ndarray, or raise ``InvalidArgumentError`` saying why not.

    Accepts any ``numpy.ndarray`` (any shape, 0-d and empty included) and numpy scalars
    (as 0-d arrays). Refuses dtypes that hold Python objects, at any depth of a
    structured dtype: their bytes are pointers, meaningless in another process.
    """
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, np.generic):
        arr = np.asarray(value)
    else:
        raise InvalidArgumentError(
            f"cannot send a {type(value).__module__}.{type(value).__qualname__} under key {key!r}: "
            "only numpy arrays (or numpy scalars) are sent; wrap it with numpy.asarray(...)"
        )
    if arr.dtype.hasobject:
        raise InvalidArgumentError(
            f"cannot send an array of dtype {arr.dtype} under key {key!r}: it holds Python objects, "
            "whose bytes are pointers that mean nothing in another process; convert it to a "
            "numeric, bool, bytes (S) or unicode (U) dtype first"
        )
    return arr
