"""The peer directory: where each other worker of the job is, and whether it lives.

Answers per peer task with a frozen ``PeerRecord``. The probe proper is the peer's
presence record in /dev/shm: visible with our boot id, it says the peer is on this host,
which transports it takes, its incarnation, pid and gRPC address (a final answer). Before
the peer has started, its cluster address decides (loopback, this host's names and
addresses), and the answer is only provisional.

Thread-safe. One ``PeerWatch`` (one cached descriptor) per peer task, closed by ``close``.
"""

from __future__ import annotations

from ._cluster import ClusterSpec
from ._devices import DeviceName
from ._errors import InvalidArgumentError
from ._hostaddr import is_local_host, split_host_port
from ._shm.naming import Names
from ._shm.presence import PeerWatch, PresenceInfo, boot_id
from ._transport import PeerRecord, PeerState

__all__ = ["ALL_TRANSPORTS", "Peers", "canonical_task"]

#: Every transport name, in the default order of preference.
ALL_TRANSPORTS = ("shm", "grpc")


def canonical_task(dev: DeviceName) -> DeviceName:
    """The task part of ``dev`` with the replica defaulted to 0; raise if it names no task."""
    job, replica, task = dev.task_key()
    return DeviceName(job=job, replica=replica, task=task, type=None, id=None)


class Peers:
    """The ``PeerDirectory`` of one Worker."""

    def __init__(self, names: Names, cluster: ClusterSpec | None) -> None:
        self._names = names
        self._cluster = cluster
        self._watches: dict[tuple[str, int, int], PeerWatch] = {}
        self._closed = False

    def watch(self, task: DeviceName) -> PeerWatch:
        """The cached presence watcher of ``task`` (one descriptor per peer task)."""
        tk = task.task_key()
        w = self._watches.get(tk)
        if w is None:
            # No lock: this runs inside the garbage collector too (a pool slot given back
            # asks whether its producer lives), where waiting on a lock the interrupted
            # thread holds would deadlock. The atomic setdefault picks one watch.
            fresh = PeerWatch(self._names, str(canonical_task(task)))
            w = self._watches.setdefault(tk, fresh)
            if w is not fresh:
                fresh.close()
        return w

    def _record(self, task: DeviceName, info: PresenceInfo | None) -> PeerRecord:
        name = str(canonical_task(task))
        if info is not None and info.boot_id == boot_id():
            address = info.address
            if self._cluster is not None and name in self._cluster:
                address = self._cluster.task_address(name)
            return PeerRecord(
                task=name,
                same_host=True,
                transports=info.transports,
                address=address,
                final=True,
                incarnation=info.incarnation,
                pid=info.pid,
            )
        if self._cluster is None:
            return PeerRecord(name, True, ALL_TRANSPORTS, None, False)
        try:
            address = self._cluster.task_address(name)
        except InvalidArgumentError:
            return PeerRecord(name, True, ALL_TRANSPORTS, None, False)  # only reachable here
        host, _ = split_host_port(address)
        return PeerRecord(name, is_local_host(host), ALL_TRANSPORTS, address, False)

    def lookup(self, task: DeviceName) -> PeerRecord:
        return self._record(task, self.watch(task).info())

    def liveness(self, task: DeviceName) -> tuple[PeerState, PeerRecord | None]:
        watch = self.watch(task)
        state = watch.state()
        info = watch.info() if state != "absent" else None
        return state, (self._record(task, info) if info is not None else None)

    def close(self) -> None:
        """Close every cached descriptor. Idempotent."""
        watches = list(self._watches.values())
        self._watches.clear()
        for w in watches:
            w.close()
