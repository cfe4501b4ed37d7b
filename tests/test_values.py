"""Which values may be sent (``shmrdv._values``): the one check for send and the wire coding."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shmrdv._errors import InvalidArgumentError
from shmrdv._values import as_ndarray, check_value


class _WithUnit(np.ndarray):  # type: ignore[type-arg]
    """An ndarray subclass carrying a unit, as astropy's Quantity does."""

    unit: str

    def __array_finalize__(self, obj: Any) -> None:
        self.unit = getattr(obj, "unit", "m")


class _Tagged(np.ndarray):  # type: ignore[type-arg]
    """A subclass holding nothing of its own: every value is in its bytes."""


def test_as_ndarray_refuses_subclass_with_state_naming_it() -> None:
    value = np.arange(3.0).view(_WithUnit)
    with pytest.raises(InvalidArgumentError) as info:
        check_value(value, "k")
    text = str(info.value)
    assert "_WithUnit under key 'k'" in text
    assert "attributes unit" in text and "numpy.asarray(a)" in text


def test_as_ndarray_masked_array_refused_even_unmasked() -> None:
    # No entry masked today does not mean none tomorrow: the type is refused, not the state.
    with pytest.raises(InvalidArgumentError, match=r"numpy\.ma\.getmaskarray"):
        as_ndarray(np.ma.masked_array([1, 2]), "send")


def test_as_ndarray_stateless_subclass_is_a_plain_view() -> None:
    base = np.arange(6, dtype=np.int8).reshape(2, 3)
    for value in (base.view(_Tagged), base.view(np.recarray), base.view(np.matrix)):
        got = as_ndarray(value, "send")
        assert type(got) is np.ndarray
        assert np.shares_memory(got, base) and got.tolist() == base.tolist()


def test_as_ndarray_plain_array_is_returned_itself() -> None:
    value = np.zeros(3)
    assert as_ndarray(value, "send") is value
