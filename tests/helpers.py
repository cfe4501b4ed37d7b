"""Helpers shared by the project's tests (fixtures live in conftest.py).

``make_key`` (a key between two tasks' CPUs), ``wait_for`` (poll a condition, bounded),
``free_port`` (a loopback port nobody listens on right now).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import shmrdv

PRODUCER = "/job:worker/replica:0/task:0"
CONSUMER = "/job:worker/replica:0/task:1"


def make_key(edge: str, *, src: str = PRODUCER, dst: str = CONSUMER, incarnation: int = 0) -> str:
    """The rendezvous key of ``edge`` from ``src``'s CPU to ``dst``'s CPU."""
    return shmrdv.create_key(f"{src}/device:CPU:0", incarnation, f"{dst}/device:CPU:0", edge)


def wait_for(
    predicate: Callable[[], bool], timeout: float = 5.0, what: str = "the condition"
) -> None:
    """Poll ``predicate`` every 10 ms until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:g}s"
        time.sleep(0.01)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
