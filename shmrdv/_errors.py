"""The one error tree of shmrdv, mirroring TensorFlow's status codes, reusing builtins where
they fit (``except TimeoutError`` works), and its one map to and from ``grpc.StatusCode``."""

from __future__ import annotations

import grpc

__all__ = ["AbortedError", "CancelledError", "DeadlineExceededError", "InternalError"]
__all__ += ["InvalidArgumentError", "RendezvousError", "ResourceExhaustedError"]
__all__ += ["UnauthenticatedError", "UnavailableError", "cleanup_error", "closed_error"]
__all__ += ["code_for_error", "error_for_code", "is_closed_error"]


class RendezvousError(Exception):
    """Base class of every error shmrdv raises on purpose."""


class InvalidArgumentError(RendezvousError, ValueError):
    """A bad key, device name, value or option; nothing was sent or queued."""


class AbortedError(RendezvousError):
    """The rendezvous was aborted (``start_abort``, cleanup, close) or the peer restarted."""


class CancelledError(RendezvousError):
    """The receive was cancelled by its caller."""


class DeadlineExceededError(RendezvousError, TimeoutError):
    """A receive timed out; its waiter was removed."""


class UnavailableError(RendezvousError, ConnectionError):
    """The peer is gone or unreachable (``__cause__`` says what the OS or gRPC said)."""


class ResourceExhaustedError(RendezvousError):
    """Out of a resource: /dev/shm space, file descriptors, memory, a full window."""


class UnauthenticatedError(RendezvousError, PermissionError):
    """A gRPC peer refused the call's credentials (missing or wrong token)."""


class InternalError(RendezvousError):
    """A broken invariant inside shmrdv or a corrupted peer."""


def closed_error(task: str) -> AbortedError:
    """The error of a call on a Worker its owner closed: "you closed it", not "it broke"."""
    return AbortedError(f"Worker {task} is closed")


def cleanup_error(step: int, task: str) -> AbortedError:
    """The error of a call in a step ``Worker.cleanup`` cleaned up (TensorFlow: "Cleanup")."""
    return AbortedError(
        f"Cleanup {step}: step {step} of {task} was cleaned up (Worker.cleanup); a step id "
        "is not reused after its cleanup: give the next step a new step id"
    )


def is_closed_error(error: BaseException, task: str) -> bool:
    """Whether ``error`` is ``closed_error(task)``, not a step failing."""
    return isinstance(error, AbortedError) and str(error) == str(closed_error(task))


# The inverse map is derived from this one, so the two directions cannot drift apart.
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
