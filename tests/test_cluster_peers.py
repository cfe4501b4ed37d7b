"""The peer directory: provisional answers from the cluster spec, final ones from a live
peer's presence record (real Workers, real records)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shmrdv
from shmrdv._cluster import ALL_TRANSPORTS, NoPresence, Peers
from shmrdv._keys import DeviceName
from shmrdv._procs import ChildWorker
from shmrdv._shm.transport import ShmBoard
from shmrdv._transport import TaskState

A = "/job:a/replica:0/task:0"
B = "/job:b/replica:0/task:0"


def test_peers_unknown_task_is_provisional_and_local(shmrdv_namespace: str) -> None:
    peers = Peers(ShmBoard(shmrdv_namespace), None)
    try:
        rec = peers.lookup(DeviceName.parse(B + "/device:CPU:0"))
        assert (rec.task, rec.same_host, rec.transports, rec.address, rec.final) == (
            B,
            True,
            ALL_TRANSPORTS,
            None,
            False,
        )
        assert peers.state(DeviceName.parse(B)) == TaskState("absent")
    finally:
        peers.close()


def test_peers_cluster_address_decides_before_the_peer_starts(shmrdv_namespace: str) -> None:
    cluster = shmrdv.ClusterSpec({"a": ["127.0.0.1:1"], "b": ["192.0.2.7:2222"]})
    peers = Peers(ShmBoard(shmrdv_namespace), cluster)
    try:
        rec = peers.lookup(DeviceName.parse(B))
        assert not rec.same_host and rec.address == "192.0.2.7:2222" and not rec.final
        assert peers.lookup(DeviceName.parse(A)).same_host
    finally:
        peers.close()


def test_peers_live_record_is_final(shmrdv_namespace: str) -> None:
    peers = Peers(ShmBoard(shmrdv_namespace), None)
    try:
        with shmrdv.Worker(B, namespace=shmrdv_namespace, transports=("grpc",)) as w:
            rec = peers.lookup(DeviceName.parse("/job:b/task:0"))  # replica defaults to 0
            assert rec.final and rec.same_host
            assert rec.transports == ("grpc",)
            assert rec.address == w.address and rec.pid == os.getpid()
            assert rec.incarnation == w.incarnation
            assert peers.state(DeviceName.parse(B)) == TaskState("alive", rec)
        assert peers.state(DeviceName.parse(B)) == TaskState("absent")
    finally:
        peers.close()


def test_peers_killed_peer_is_dead_with_its_last_record(ns: str) -> None:
    peers = Peers(ShmBoard(ns), None)
    try:
        child = ChildWorker(B, namespace=ns)
        try:
            alive = peers.state(DeviceName.parse(B))
            assert alive.state == "alive" and alive.record is not None
            assert (alive.record.pid, alive.record.incarnation) == (child.pid, child.incarnation)
            child.kill()
            child.process.join(10)
            assert peers.state(DeviceName.parse(B)) == TaskState("dead", alive.record)
            assert peers.lookup(DeviceName.parse(B)) == alive.record  # still where it was
        finally:
            child.close()
    finally:
        peers.close()


def test_peers_without_presence_records_answer_from_the_cluster() -> None:
    """Where /dev/shm cannot be used (NoPresence): provisional answers, no sightings."""
    cluster = shmrdv.ClusterSpec({"a": ["127.0.0.1:1"], "b": ["192.0.2.7:2222"]})
    peers = Peers(NoPresence(), cluster)
    try:
        rec = peers.lookup(DeviceName.parse(A))
        assert rec.same_host and rec.address == "127.0.0.1:1" and not rec.final
        assert peers.state(DeviceName.parse(A)) == TaskState("absent")
        assert peers.sightings(DeviceName.parse(A)) is None
    finally:
        peers.close()


# -- port 0 in the cluster spec (issue 29 §2) ------------------------------------------------


@pytest.mark.timeout(60)
def test_port_0_is_the_bound_port_of_a_producer_on_this_host(ns: str) -> None:
    """The README's cluster gives every task 127.0.0.1:0: each worker's server binds a
    free port, and a consumer in another process finds it in the producer's presence
    record (before: it dialled port 0 and timed out)."""
    cluster = {"worker": ["127.0.0.1:0", "127.0.0.1:0"]}
    kw = {"cluster": cluster, "namespace": ns, "transports": ("grpc",)}
    key = shmrdv.create_key(
        "/job:worker/replica:0/task:0/device:CPU:0",
        0,
        "/job:worker/replica:0/task:1/device:CPU:0",
        "p0",
    )
    with (
        ChildWorker("/job:worker/task:0", **kw) as producer,
        ChildWorker("/job:worker/task:1", **kw) as consumer,
    ):
        assert producer.address and not producer.address.endswith(":0")
        producer.send(key, np.arange(5), step=1)
        got = consumer.recv(key, timeout=20, step=1)
        assert got.value.tolist() == [0, 1, 2, 3, 4]


def test_port_0_of_a_task_on_another_host_is_refused_saying_why(ns: str) -> None:
    cluster = {"worker": ["127.0.0.1:0", "192.0.2.7:0"]}  # TEST-NET-1: never this host
    with pytest.raises(shmrdv.InvalidArgumentError, match=r"192\.0\.2\.7:0: port 0 picks"):
        shmrdv.Worker("/job:worker/task:0", cluster=cluster, namespace=ns, transports=("grpc",))
