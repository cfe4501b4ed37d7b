"""The peer directory: where each other worker of the job is, and whether it lives.

Answers per peer task with a frozen ``PeerRecord``. The probe proper is the peer's
presence record on this host, read through the worker's ``PresenceBoard``
(``_transport.py``): one of this boot says the peer is on this host, which transports it
takes, its incarnation, pid and gRPC address (a final answer). Before the peer has
started, or where the host keeps no presence records (``NoPresence``: /dev/shm unusable,
a gRPC-only worker), its cluster address decides (loopback, this host's names and
addresses), and the answer is only provisional.

Port 0 in the cluster spec picks a free port when that task's server starts: a peer on
this host learns the port from the task's presence record (until then its address is
not known, and a receive waits for it); a task on another host given port 0 could never
be reached, so the cluster spec is refused, saying why.

Thread model (``docs/threads.md``): thread-safe, no thread or lock of its own; the
board's descriptors are closed by ``close``.
"""

from __future__ import annotations

import dataclasses

from ._cluster import ClusterSpec, is_local_host, split_host_port
from ._errors import InvalidArgumentError
from ._keys import DeviceName
from ._transport import PeerRecord, PeerState, PresenceBoard, Sighting

__all__ = ["ALL_TRANSPORTS", "NoPresence", "Peers", "canonical_task"]

#: Every transport name, in the default order of preference.
ALL_TRANSPORTS = ("shm", "grpc")


def canonical_task(dev: DeviceName) -> DeviceName:
    """The task part of ``dev`` with the replica defaulted to 0; raise if it names no task."""
    job, replica, task = dev.task_key()
    return DeviceName(job=job, replica=replica, task=task, type=None, id=None)


class NoPresence:
    """The ``PresenceBoard`` of a host without presence records: nobody is seen here.

    For a worker that takes no shared-memory transport where /dev/shm cannot be used: its
    peers are found through the cluster spec alone, and nothing is published.
    """

    def publish(
        self, task: str, incarnation: int, address: str | None, transports: tuple[str, ...]
    ) -> None:
        pass

    def look(self, task: str) -> tuple[PeerState, PeerRecord | None]:
        return "absent", None

    def sightings(self, task: str) -> list[Sighting] | None:
        return None

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "<NoPresence>"


class Peers:
    """The ``PeerDirectory`` of one Worker, over its ``PresenceBoard`` and cluster spec."""

    def __init__(self, board: PresenceBoard, cluster: ClusterSpec | None) -> None:
        self._board = board
        self._cluster = cluster
        for task in [] if cluster is None else cluster.tasks():
            assert cluster is not None
            address = cluster.task_address(task)
            host, port = split_host_port(address)
            if port == 0 and not is_local_host(host):
                raise InvalidArgumentError(
                    f"the cluster spec gives {task} the address {address}: port 0 picks a "
                    "free port when that task's server starts, which only a worker on the "
                    "same host can learn (from the task's presence record); give a task on "
                    "another host a fixed port"
                )

    def _provisional(self, name: str) -> PeerRecord:
        """What the cluster spec says of task ``name`` (nothing final): no address while
        its port is 0 (its presence record will say)."""
        if self._cluster is None:
            return PeerRecord(name, True, ALL_TRANSPORTS, None, False)
        try:
            address: str | None = self._cluster.task_address(name)
        except InvalidArgumentError:
            return PeerRecord(name, True, ALL_TRANSPORTS, None, False)  # only reachable here
        assert address is not None
        host, port = split_host_port(address)
        return PeerRecord(
            name, is_local_host(host), ALL_TRANSPORTS, address if port else None, False
        )

    def _final(self, record: PeerRecord) -> PeerRecord:
        """A record from the board, with the cluster's address for the task if it has one
        (not port 0: the record has the port the task's server was given)."""
        if self._cluster is not None and record.task in self._cluster:
            address = self._cluster.task_address(record.task)
            if address != record.address and split_host_port(address)[1]:
                return dataclasses.replace(record, address=address)
        return record

    def lookup(self, task: DeviceName) -> PeerRecord:
        name = str(canonical_task(task))
        _, record = self._board.look(name)
        return self._provisional(name) if record is None else self._final(record)

    def liveness(self, task: DeviceName) -> tuple[PeerState, PeerRecord | None]:
        name = str(canonical_task(task))
        state, record = self._board.look(name)
        if state == "absent":
            return state, None
        return state, self._provisional(name) if record is None else self._final(record)

    def sightings(self, task: DeviceName) -> list[Sighting] | None:
        return self._board.sightings(str(canonical_task(task)))

    def close(self) -> None:
        """Close the board's descriptors. Idempotent."""
        self._board.close()
