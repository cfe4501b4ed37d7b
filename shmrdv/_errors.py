"""The one error tree of shmrdv, mirroring TensorFlow's status codes.

Builtins are reused where they fit, so ``except TimeoutError`` or ``except ValueError``
keeps working for users who do not know shmrdv's names. Errors are translated only at
the edge where they arise (an ``OSError`` in the segment code, a ``grpc.RpcError`` in the
RPC client) and chained with ``raise ... from``; ``_status.py`` maps them to and from
``grpc.StatusCode``.
"""

from __future__ import annotations

__all__ = [
    "AbortedError",
    "CancelledError",
    "DeadlineExceededError",
    "InternalError",
    "InvalidArgumentError",
    "RendezvousError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "closed_error",
    "is_closed_error",
]


class RendezvousError(Exception):
    """Base class of every error shmrdv raises on purpose."""


class InvalidArgumentError(RendezvousError, ValueError):
    """The caller passed something wrong: a bad key, device name, value or option.

    TensorFlow: ``INVALID_ARGUMENT``. Nothing was sent or queued.
    """


class AbortedError(RendezvousError):
    """The rendezvous was aborted (``start_abort``, step cleanup, close) or the peer restarted.

    TensorFlow: ``ABORTED`` ("Cleanup <step_id>", "... different device incarnation ...").
    """


class CancelledError(RendezvousError):
    """The receive was cancelled by its caller. TensorFlow: ``CANCELLED``."""


class DeadlineExceededError(RendezvousError, TimeoutError):
    """A receive did not complete before its timeout; its waiter has been removed.

    TensorFlow: ``DEADLINE_EXCEEDED``.
    """


class UnavailableError(RendezvousError, ConnectionError):
    """The peer is gone or unreachable (its process died, the network failed).

    TensorFlow: ``UNAVAILABLE``. See ``__cause__`` for what the OS or gRPC said.
    """


class ResourceExhaustedError(RendezvousError):
    """Out of a resource: /dev/shm space, file descriptors, memory. TensorFlow: ``RESOURCE_EXHAUSTED``."""


class UnauthenticatedError(RendezvousError, PermissionError):
    """A gRPC peer refused the call's credentials (missing or wrong token). gRPC: ``UNAUTHENTICATED``."""


class InternalError(RendezvousError):
    """A broken invariant inside shmrdv or a corrupted peer. TensorFlow: ``INTERNAL``."""


def closed_error(task: str) -> AbortedError:
    """The one error for a call on (or pending in) a Worker its owner closed.

    "Closed by you", as opposed to a peer that broke (``UnavailableError``).
    """
    return AbortedError(f"Worker {task} is closed")


def is_closed_error(error: BaseException, task: str) -> bool:
    """Whether ``error`` is ``closed_error(task)``: the worker is closing, not a step
    failing (a transport tells its remote peers that the producer went away)."""
    return isinstance(error, AbortedError) and str(error) == str(closed_error(task))
