"""Helpers shared by the project's tests (fixtures live in conftest.py).

``make_key`` (a key between two tasks' CPUs), ``wait_for`` (poll a condition, bounded),
``free_port`` (a loopback port nobody listens on right now), ``remove_planted`` (clean up
what a test, as root, planted in /dev/shm as user ``NOBODY``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import shmrdv
from shmrdv._shm.naming import SHM_DIR, Names

PRODUCER = "/job:worker/replica:0/task:0"
CONSUMER = "/job:worker/replica:0/task:1"
NOBODY = 65534  # the uid a root test drops to, to act as another local user


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


def remove_planted(namespace: str, uid: int = NOBODY) -> None:
    """Unlink the objects of ``namespace`` in /dev/shm that belong to ``uid``.

    A test running as root plants objects as another user; ``gc`` never removes another
    user's objects, so the test removes them itself before collecting the rest.
    """
    prefix = Names(namespace).prefix
    for entry in os.listdir(SHM_DIR):
        path = os.path.join(SHM_DIR, entry)
        if prefix in entry and os.stat(path, follow_symlinks=False).st_uid == uid:
            os.unlink(path)
