"""The errors a gRPC receive ends with, and when a producer counts as gone.

Pure decisions over a failed call's status (no I/O, no state but ``PeerWatch``'s clock):
``call_error`` maps a status to the receive's error, ``timeout_error`` says why a
receive ran out of time between attempts, ``out_of_files`` recognises a client that ran
out of descriptors, and ``PeerWatch`` tells a producer still starting (wait for it) from
one that was reached and went away (fail soon, issue 19 bug 3a). Every message names the
key, the step and the producer's address (``where``).

Thread model (``docs/threads.md``): none of its own; ``PeerWatch`` belongs to one receive,
used under its lock or by the one thread that handles its failed call.
"""

from __future__ import annotations

import time

import grpc

from .._errors import (
    DeadlineExceededError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
    error_for_code,
)
from .methods import SERVER_STOPPING
from .rpc_errors import error_code, error_details

__all__ = ["GONE_GRACE", "PeerWatch", "call_error", "out_of_files", "timeout_error"]

# A producer that was reached and then went away (its server stopped, the connection
# lost) has this long to come back before its receives fail with UnavailableError: the
# time shared memory takes to see a dead producer's presence record go.
GONE_GRACE = 1.0
# grpcio's words for a connection never made (nobody listening yet): a starting peer.
_NEVER_CONNECTED = "failed to connect"


def call_error(
    code: grpc.StatusCode,
    e: grpc.RpcError,
    where: str,
    timeout: float | None,
    *,
    receiving: bool,
) -> RendezvousError:
    """The receive's error for a call that failed with ``code`` (``receiving``: data
    had started to flow)."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        after = "" if timeout is None else f" after {timeout:g}s"
        return DeadlineExceededError(f"Timed out{after} receiving {where}: {error_details(e)}")
    if receiving and code == grpc.StatusCode.ABORTED:
        # A mid-stream retry found the value gone from the server's cache.
        return UnavailableError(
            f"lost the connection while receiving {where} and could not get the "
            f"value again: {error_details(e)}"
        )
    error = error_for_code(code)(f"RecvTensor of {where} failed: {error_details(e)}")
    error.__cause__ = e
    return error


def timeout_error(
    timeout: float | None, where: str, last_unavailable: grpc.RpcError | None, why: str = ""
) -> DeadlineExceededError:
    """The caller's timeout expired between attempts (the peer kept being unavailable)."""
    why = error_details(last_unavailable) if last_unavailable is not None else why
    return DeadlineExceededError(
        f"Timed out after {timeout:g}s receiving {where}"
        + (f"; the peer was unavailable: {why}" if why else "")
    )


def out_of_files(e: grpc.RpcError, where: str) -> ResourceExhaustedError | None:
    """The error of a call that could not connect for lack of descriptors, else None.

    Not transient the way a restarting peer is: the caller fails the receive and drops
    the channel, so that the next one, once descriptors are back, connects afresh
    instead of inheriting its reconnect backoff."""
    details = error_details(e)
    if error_code(e) != grpc.StatusCode.UNAVAILABLE or "Too many open files" not in details:
        return None
    return ResourceExhaustedError(
        f"cannot connect for {where}: too many open files (ulimit -n): {details}"
    )


class PeerWatch:
    """Whether one receive's producer has gone away, from its calls' UNAVAILABLE statuses.

    A peer not reachable yet (no connection ever made: still starting) is waited for
    until the receive's timeout. One whose server says it is stopping is gone at once;
    one that was reached and went away otherwise (the connection lost: it died) gets
    ``GONE_GRACE`` to come back, as shared memory gives a producer whose presence record
    is gone.
    """

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since: float | None = None  # when the peer was first seen to go away

    def reset(self) -> None:
        """The producer was found again (at a new address)."""
        self._since = None

    def gone(self, error: grpc.RpcError, producer: str, where: str) -> UnavailableError | None:
        """The receive's error once the producer is gone, else None (retry): it names
        the producer, the key and address (``where``) and the gRPC status."""
        details = error_details(error)
        now = time.monotonic()
        if self._since is None:
            if _NEVER_CONNECTED in details.lower():
                return None
            self._since = now
        if now - self._since < GONE_GRACE and SERVER_STOPPING not in details:
            return None
        return UnavailableError(
            f"producer {producer} went away while receiving {where}: "
            f"gRPC {error_code(error).name}: {details}"
        )

    def pause(self, pause: float) -> float:
        """``pause`` before the next retry, cut short so that a producer gone is known
        within the grace, not a backoff later."""
        if self._since is None:
            return pause
        return min(pause, max(0.0, self._since + GONE_GRACE - time.monotonic()))
