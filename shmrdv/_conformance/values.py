"""The values every transport must carry exactly, and the one comparison of what arrived
with what was sent (``shmrdv.testing`` re-exports both).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["assert_same", "expect", "sample_values"]


def expect(condition: bool, message: str) -> None:
    # Not ``assert``: this module is imported by users' code, which may run with -O.
    if not condition:
        raise AssertionError(message)


def assert_same(actual: object, expected: npt.NDArray[Any], what: str = "value") -> None:
    """Raise ``AssertionError`` unless ``actual`` is an ndarray of the same dtype, shape and bytes.

    Bytes are compared in C order, so layout (strides, Fortran order) may differ, and
    NaN payloads, signed zeros and padding-free structured records compare exactly.
    """
    expect(
        isinstance(actual, np.ndarray),
        f"{what}: expected a numpy.ndarray, got {type(actual).__name__}",
    )
    assert isinstance(actual, np.ndarray)  # for mypy; checked just above
    expect(
        actual.dtype == expected.dtype,
        f"{what}: dtype {actual.dtype!r} != expected {expected.dtype!r}",
    )
    expect(
        actual.shape == expected.shape,
        f"{what}: shape {actual.shape} != expected {expected.shape}",
    )
    got = np.ascontiguousarray(actual).tobytes()
    want = np.ascontiguousarray(expected).tobytes()
    if got != want:
        if len(got) == len(want):
            diff = np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8)
            first = int(np.flatnonzero(diff)[0])
        else:  # pragma: no cover - equal dtype and shape imply equal sizes
            first = min(len(got), len(want))
        raise AssertionError(
            f"{what}: {expected.dtype} {expected.shape} contents differ "
            f"(first differing byte at offset {first} of {len(want)})"
        )


def sample_values() -> dict[str, npt.NDArray[Any]]:
    """One array per kind of value a transport must carry exactly (DESIGN.md "Values").

    Includes NaN, infinities, signed zero, integer extremes, non-ASCII text, a
    structured dtype, a strided view, Fortran order, 0-d and empty arrays, and bfloat16
    when ``ml_dtypes`` is importable.
    """
    values: dict[str, npt.NDArray[Any]] = {}
    for name in ("float16", "float32", "float64"):
        values[name] = np.array([0.0, -0.0, 1.5, np.nan, np.inf, -np.inf, 1e-7], dtype=name)
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(name)
        values[name] = np.array([info.min, 0, 1, info.max], dtype=name).reshape(2, 2)
    values["bool"] = np.array([[True, False, True]])
    for name in ("complex64", "complex128"):
        values[name] = np.array([1 + 2j, complex(np.nan, -0.0), -3j], dtype=name)
    values["bytes_S7"] = np.array([b"abc", b"\x00\xff\x01xyz7", b""], dtype="S7")
    values["unicode_U5"] = np.array(["héllo", "", "\U0001f642ab"], dtype="U5")
    values["structured"] = np.array(
        [(1, (0.5, -2.0), b"ab"), (-7, (np.nan, 3.25), b"xyz")],
        dtype=[("a", "<i4"), ("b", "<f8", (2,)), ("c", "S3")],
    )
    values["strided_view"] = np.arange(60, dtype=np.int32).reshape(6, 10)[::2, 1::3]
    values["fortran_order"] = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    values["zero_d"] = np.array(3.25, dtype=np.float32)
    values["empty_0x3"] = np.zeros((0, 3), dtype=np.float32)
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        values["bfloat16"] = np.array([1.0, -2.5, np.inf, 0.0], dtype=ml_dtypes.bfloat16)
    return values
