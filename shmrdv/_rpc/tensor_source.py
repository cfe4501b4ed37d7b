"""TensorSource: what the gRPC server pulls values from (the producer's outbox).

The interface between the server (``waits``, which calls it on the event loop) and the
producer's side (``outbox.Outbox``, and the tests' own source), declared once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._keys import ParsedKey
from .._rendezvous import DoneCallback, Received

__all__ = ["TensorSource"]


class TensorSource(Protocol):
    """What the server pulls values from (the producer's outbox).

    ``task`` is the canonical task name (``/job:w/replica:0/task:0``), ``incarnation`` the
    worker's incarnation, ``max_inflight_bytes`` each consumer's window (None: none),
    which a series' acks keep ahead of. ``serve_recv`` raises ``AbortedError`` at once for a step that
    was cleaned up; otherwise it calls ``done(error, Received)`` exactly once, in any
    thread (in the caller's when the value is already there), unless the canceller it
    returned answered ``True``.

    A value it gave is the service's until the service calls ``done_with`` for it (with
    its ``methods.counted_bytes``, or a sum of them), exactly once: the call that carried it has ended, or the service dropped it, or is about to
    hand it back with ``requeue`` (to the head of its key: it was taken for a call that
    went away before it was delivered, and no retry can claim it).
    """

    task: str
    incarnation: int
    max_inflight_bytes: int | None

    def serve_recv(
        self, step_id: int, key: ParsedKey, done: DoneCallback
    ) -> Callable[[], bool]: ...

    def done_with(self, step_id: int, key: ParsedKey, nbytes: int) -> None: ...

    def requeue(self, step_id: int, key: ParsedKey, received: Received) -> None: ...
