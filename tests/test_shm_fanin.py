"""Several producers into one consumer (issue 15 §2): equal incarnations never collide."""

from __future__ import annotations

import numpy as np
import pytest

import shmrdv
from shmrdv._procs import ChildWorker

CONSUMER = "/job:worker/replica:0/task:9"


def _key(task: int, i: int, incarnation: int = 1) -> str:
    return shmrdv.create_key(
        f"/job:worker/replica:0/task:{task}/device:CPU:0",
        incarnation,
        CONSUMER + "/device:CPU:0",
        f"t{i}",
    )


def _send_many(worker: shmrdv.Worker, task: int, n: int) -> int:
    rdv = worker.rendezvous(1)
    for i in range(n):
        rdv.send(_key(task, i), np.full(4 << 20, task * 1000 + i, np.float32))  # 16 MiB
        rdv.send(_key(task, 100 + i), np.full(4, task * 1000 + i, np.float32))  # inline
    return n


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_fanin_producers_with_equal_incarnations_all_arrive() -> None:
    """Four producers (tasks 0-3) all made with incarnation=1: pool slots, held/returned
    names, rings, doorbells and presence records carry the task, so nothing collides."""
    ns = shmrdv.new_namespace()
    n = 6
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        producers = [
            ChildWorker(f"/job:worker/replica:0/task:{t}", namespace=ns, incarnation=1)
            for t in range(4)
        ]
        try:
            assert {p.incarnation for p in producers} == {1}
            rdv = consumer.rendezvous(1)
            assert [p.call(_send_many, t, n, timeout=60) for t, p in enumerate(producers)] == [
                n
            ] * 4
            for i in range(n):
                for t in range(4):
                    got = rdv.recv(_key(t, i), timeout=30)
                    assert got.value.shape == (4 << 20,)
                    assert got.value[0] == got.value[-1] == t * 1000 + i
                    del got
                    small = rdv.recv(_key(t, 100 + i), timeout=30)
                    assert small.value.tolist() == [t * 1000 + i] * 4
            # A second round reuses the slots given back (returned names are per task).
            assert [p.call(_send_many, t, 2, timeout=60) for t, p in enumerate(producers)] == [
                2
            ] * 4
            for t in range(4):  # they arrived too
                assert rdv.recv(_key(t, 0), timeout=30).value[0] == t * 1000
            consumer.cleanup(1)
        finally:
            for p in producers:
                p.close()
