"""What a cross-process transport offers the Worker's per-step router.

The router (``_router.py``) decides, per key, which transport carries it; a transport
only moves values for keys it was handed. Both ends in one worker never reach a
transport: they stay in the step's in-process ``LocalRendezvous``.

Thread model: every method may be called from any thread. ``done`` callbacks are
called exactly once (unless the canceller returned ``True``), never under a lock.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy.typing as npt

from ._callbacks import DoneCallback
from ._keys import ParsedKey
from ._rendezvous import Canceller

__all__ = ["Transport"]


class Transport(Protocol):
    """One cross-process transport of a Worker (shared memory or gRPC)."""

    name: str

    def send(self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool) -> None:
        """Hand ``value`` to the consumer of ``key`` (another worker). Never blocks on the consumer."""

    def start_recv(self, step_id: int, key: ParsedKey, done: DoneCallback, copy: bool) -> Canceller:
        """Receive the next value of ``key`` from its producer (another worker)."""

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """Memory the consumer of ``key`` will see without a copy (or a plain array)."""

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Fail every pending receive of the step with ``error``; later ones fail at once."""

    def cleanup_step(self, step_id: int) -> None:
        """Free what the step still holds (called after ``abort_step``)."""

    def close(self) -> None:
        """Release every resource; idempotent."""

    def stats(self) -> dict[str, int]:
        """Counters: bytes, messages, pending, live segments."""
