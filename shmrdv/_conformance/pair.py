"""What a conformance check runs on: a ``RendezvousPair`` (a producer, a consumer in this
process), with the bounds every check's waits keep (``shmrdv.testing`` re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy.typing as npt

from .._rendezvous import Rendezvous

__all__ = ["EXPIRE_S", "PROMPT_S", "SETTLE_S", "WAIT_S", "Producer", "RendezvousPair"]

#: Longest wait for something that must happen (a value arriving, a callback firing).
WAIT_S = 5.0
#: Timeout given to receives that are meant to expire.
EXPIRE_S = 0.2
#: How soon "at once" must be: an expired timeout raising, an abort reaching a waiter.
PROMPT_S = 2.0
#: Pause that lets a receive get queued before the send that completes it. Correctness
#: never depends on it: a check passes either way round, it only makes "recv before send"
#: the likely order.
SETTLE_S = 0.05


class Producer(Protocol):
    """The sending side of a pair; may be a proxy for a rendezvous in another process."""

    def send(self, key: str, value: npt.NDArray[Any], *, is_dead: bool = False) -> None: ...


def _no_settle() -> None:
    """Default ``settle``: in-process sends have landed when ``send`` returns."""


@dataclass
class RendezvousPair:
    """A producer, a consumer in this process, and how to name keys between them.

    ``make_key(edge_name)`` returns a full rendezvous key from the producer's device to
    the consumer's device. ``settle()`` returns once every send made so far has been
    delivered to the consumer's side (e.g. a proxy's flush); checks call it before
    asserting that nothing (more) is pending.
    """

    producer: Producer
    consumer: Rendezvous
    make_key: Callable[[str], str]
    settle: Callable[[], None] = field(default=_no_settle)
