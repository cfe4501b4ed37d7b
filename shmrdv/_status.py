"""The one table between shmrdv's errors and ``grpc.StatusCode``, both ways.

Pure: no channel, no server. The server side turns an error into a status code and
message; the client side turns a status code back into the same error class, so a
``DeadlineExceededError`` raised in the producer's worker is a ``DeadlineExceededError``
in the consumer.
"""

from __future__ import annotations

import grpc

from ._errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    RendezvousError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

__all__ = ["code_for_error", "error_for_code"]

# Error class -> status code; the inverse map below is derived from it, so the two
# directions cannot drift apart.
_CODE_OF: dict[type[RendezvousError], grpc.StatusCode] = {
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    AbortedError: grpc.StatusCode.ABORTED,
    CancelledError: grpc.StatusCode.CANCELLED,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    InternalError: grpc.StatusCode.INTERNAL,
}
_ERROR_OF: dict[grpc.StatusCode, type[RendezvousError]] = {v: k for k, v in _CODE_OF.items()}
# Codes with no class of their own, folded into the nearest one.
_ERROR_OF.update(
    {
        grpc.StatusCode.PERMISSION_DENIED: UnauthenticatedError,
        grpc.StatusCode.NOT_FOUND: InvalidArgumentError,
        grpc.StatusCode.FAILED_PRECONDITION: AbortedError,
        grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
        grpc.StatusCode.ALREADY_EXISTS: AbortedError,
        grpc.StatusCode.UNIMPLEMENTED: UnavailableError,
        grpc.StatusCode.DATA_LOSS: InternalError,
        grpc.StatusCode.UNKNOWN: InternalError,
    }
)


def code_for_error(error: BaseException) -> grpc.StatusCode:
    """The status code a server answers for ``error``; unknown exceptions are ``INTERNAL``."""
    for cls in type(error).__mro__:
        code = _CODE_OF.get(cls)
        if code is not None:
            return code
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def error_for_code(code: grpc.StatusCode) -> type[RendezvousError]:
    """The error class a client raises for ``code`` (``OK`` is not an error: ``ValueError``)."""
    if code == grpc.StatusCode.OK:
        raise ValueError("grpc.StatusCode.OK is not an error")
    return _ERROR_OF.get(code, InternalError)
