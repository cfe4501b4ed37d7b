"""ShmBoard: a worker's presence on this host, the ``PresenceBoard`` of ``_transport.py``.

It publishes the worker's record (``presence.Presence``), answers its peers' states from
one ``presence.Monitor`` and where a task is seen in other namespaces
(``reaper.sightings``, for a diagnosis only); publishing and closing also collect what
dead workers of this user left in /dev/shm (``reaper.at_start`` / ``reaper.at_close``:
bounded, never a live worker's objects). ``usable()`` says whether /dev/shm can hold
records at all: where it cannot, a worker that takes no shared-memory transport runs
without a board (``_cluster.NoPresence``).

Thread model (``docs/threads.md``): thread-safe, no thread of its own; ``state`` may run
inside the garbage collector (``presence.Monitor``).
"""

from __future__ import annotations

import os
import time

from .._transport import Sighting, TaskState
from . import reaper
from .naming import SHM_DIR, Names
from .presence import Monitor, Presence, PresenceInfo, boot_id

__all__ = ["ShmBoard", "usable"]


def usable(shm_dir: str = SHM_DIR) -> bool:
    """Whether this process can create objects in ``shm_dir`` (a writable directory)."""
    return os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK | os.X_OK)


class ShmBoard:
    """The presence records of one namespace on this host (see the module docstring).

    ``namespace``: the job's token (``Names``). Raises ``InvalidArgumentError`` for a bad one.
    """

    def __init__(self, namespace: str) -> None:
        self._names = Names(namespace)
        self._monitor = Monitor(self._names)
        self._presence: Presence | None = None
        self._task = ""  # the published worker's task
        self._sweeping = False  # ``reaper.at_start`` ran the sweeps (``at_close`` then too)

    def __repr__(self) -> str:
        return f"<ShmBoard {self._names.namespace_id} {self._monitor!r}>"

    def publish(
        self, task: str, incarnation: int, address: str | None, transports: tuple[str, ...]
    ) -> None:
        assert self._presence is None, "a board publishes one worker's record"
        self._task = task
        info = PresenceInfo(
            task, os.getpid(), boot_id(), incarnation, time.time(), "", address, transports
        )
        self._presence = Presence.publish(self._names, info)
        self._sweeping = reaper.at_start(self._names, task, incarnation)

    def state(self, task: str) -> TaskState:
        return self._monitor.state(task)

    def sightings(self, task: str) -> list[Sighting] | None:
        return reaper.sightings(task, self._names.namespace_id)

    def close(self) -> None:
        self._monitor.close()
        presence, self._presence = self._presence, None
        if presence is not None:
            presence.close()
            reaper.at_close(self._names, self._task, self._sweeping)
