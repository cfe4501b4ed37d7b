"""ShmBoard: the ``PresenceBoard`` (``_transport.py``) over presence records in /dev/shm.

The worker's own record is a ``Presence`` (``presence.py``: a JSON file locked with
``flock`` for as long as the worker lives); a peer's is read through one ``PeerWatch`` per
peer task (one cached descriptor each) and answered as a final same-host ``PeerRecord``
when it is from this boot. ``sightings`` lists the records of a task in every namespace
(``presence.sightings``), for a diagnosis only.

Publishing and closing also collect what dead workers of this user left in /dev/shm
(``reaper.at_start`` / ``reaper.at_close``: bounded, never a live worker's objects).

``usable()`` says whether /dev/shm can hold records at all: where it cannot (absent,
read-only), a worker that takes no shared-memory transport runs without a board
(``_peers.NoPresence``) instead of failing.

Thread model (``docs/threads.md``): thread-safe, no thread of its own. ``look`` takes no
lock that another thread may hold (``PeerWatch.look`` falls back to a descriptor of its
own when contended): a pool slot given back inside the garbage collector asks it too.
"""

from __future__ import annotations

import os
import time

from .._transport import PeerRecord, PeerState, Sighting
from . import reaper
from .naming import SHM_DIR, Names
from .presence import PeerWatch, Presence, PresenceInfo, boot_id, sightings

__all__ = ["ShmBoard", "usable"]


def usable(shm_dir: str = SHM_DIR) -> bool:
    """Whether this process can create objects in ``shm_dir`` (a writable directory)."""
    return os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK | os.X_OK)


class ShmBoard:
    """The presence records of one namespace on this host (see the module docstring).

    ``namespace``: the job's token (``Names``). Raises ``InvalidArgumentError`` for a bad one.
    """

    def __init__(self, namespace: str) -> None:
        names = Names(namespace)
        self._names = names
        self._watches: dict[str, PeerWatch] = {}
        self._presence: Presence | None = None
        self._task = ""  # the published worker's task
        self._sweeping = False  # ``reaper.at_start`` ran the sweeps (``at_close`` then too)
        self._shown = names.namespace_id  # as it appears in object names (and Sightings)

    def __repr__(self) -> str:
        return f"<ShmBoard {self._shown} watches={len(self._watches)}>"

    def publish(
        self, task: str, incarnation: int, address: str | None, transports: tuple[str, ...]
    ) -> None:
        assert self._presence is None, "a board publishes one worker's record"
        self._task = task
        self._presence = Presence.publish(
            self._names,
            PresenceInfo(
                task=task,
                pid=os.getpid(),
                boot_id=boot_id(),
                incarnation=incarnation,
                started=time.time(),
                namespace=self._names.namespace_id,
                address=address,
                transports=transports,
            ),
        )
        # What dead workers left (issue 20 §1).
        self._sweeping = reaper.at_start(self._names, task, incarnation)

    def _watch(self, task: str) -> PeerWatch:
        """The cached presence watcher of ``task`` (one descriptor per peer task)."""
        w = self._watches.get(task)
        if w is None:
            # No lock: this runs inside the garbage collector too (a pool slot given back
            # asks whether its producer lives), where waiting on a lock the interrupted
            # thread holds would deadlock. The atomic setdefault picks one watch.
            fresh = PeerWatch(self._names, task)
            w = self._watches.setdefault(task, fresh)
            if w is not fresh:
                fresh.close()
        return w

    def look(self, task: str) -> tuple[PeerState, PeerRecord | None]:
        state, info = self._watch(task).look()
        if info is None or info.boot_id != boot_id():
            return state, None
        return state, PeerRecord(
            task=task,
            same_host=True,
            transports=info.transports,
            address=info.address,
            final=True,
            incarnation=info.incarnation,
            pid=info.pid,
        )

    def sightings(self, task: str) -> list[Sighting] | None:
        return sightings(task, self._shown)

    def close(self) -> None:
        watches = list(self._watches.values())
        self._watches.clear()
        for w in watches:
            w.close()
        presence, self._presence = self._presence, None
        if presence is not None:
            presence.close()
            reaper.at_close(self._names, self._task, self._sweeping)
