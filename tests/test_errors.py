"""The one table between shmrdv's errors and grpc.StatusCode, both ways."""

from __future__ import annotations

import grpc
import pytest

import shmrdv
from shmrdv._errors import code_for_error, error_for_code

PAIRS = [
    (shmrdv.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (shmrdv.AbortedError, grpc.StatusCode.ABORTED),
    (shmrdv.CancelledError, grpc.StatusCode.CANCELLED),
    (shmrdv.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (shmrdv.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (shmrdv.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (shmrdv.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (shmrdv.InternalError, grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("cls", "code"), PAIRS)
def test_status_round_trip_both_ways(
    cls: type[shmrdv.RendezvousError], code: grpc.StatusCode
) -> None:
    assert code_for_error(cls("x")) == code
    assert error_for_code(code) is cls


def test_status_every_code_but_ok_maps_to_a_shmrdv_error() -> None:
    for code in grpc.StatusCode:
        if code == grpc.StatusCode.OK:
            with pytest.raises(ValueError):
                error_for_code(code)
        else:
            assert issubclass(error_for_code(code), shmrdv.RendezvousError)


def test_status_foreign_exceptions() -> None:
    assert code_for_error(TimeoutError()) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert code_for_error(RuntimeError()) == grpc.StatusCode.INTERNAL

    class Sub(shmrdv.AbortedError):
        pass

    assert code_for_error(Sub()) == grpc.StatusCode.ABORTED
