"""The shared-memory consumer: channels in order per key, and a dead run's leftovers go
while it polls."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.naming import SHM_DIR, Names

pytestmark = pytest.mark.timeout(120)


def _left(ns: str) -> set[str]:
    prefix = Names(ns).prefix
    return {e for e in os.listdir(SHM_DIR) if prefix in e}


def test_consumer_collects_a_killed_producer_run_it_has_taken(ns: str) -> None:
    """A consumer that took every record of a SIGKILLed producer's ring unmaps it and frees
    what that run left (pool slots, doorbell, presence record) while it polls: no sweep,
    no ``gc``. While it has not taken them all, the ring stays (its records are the task's,
    for this process or its next one) and so does what the run left."""
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        mine = _left(ns)  # the consumer's own record and doorbell
        producer = ChildWorker(PRODUCER, namespace=ns)
        try:
            for i in range(3):
                producer.send(make_key(f"big{i}"), np.full(300_000, i, np.uint8), step=1)
            producer.send(make_key("small"), np.arange(4, dtype=np.int32), step=1)
            rdv = consumer.rendezvous(1)
            for i in range(2):  # the third big one and the small one stay unreceived
                got = rdv.recv(make_key(f"big{i}"), timeout=10)
                assert got.value[0] == i
                del got
            producer.kill(signal.SIGKILL)
        finally:
            producer.close()
        assert _left(ns) > mine  # the dead run's record, doorbell, slots
        # Polling: a receive waits for a key the dead run never sent (the consumer never
        # saw that channel's producer alive, so it waits out its timeout).
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(make_key("never"), timeout=1.0)
        kinds = {e.split(Names(ns).prefix, 1)[1][0] for e in _left(ns) - mine}
        assert {"m", "q"} <= kinds  # the unreceived big message, the ring with its notice
        assert rdv.recv(make_key("big2"), timeout=10).value[0] == 2
        assert rdv.recv(make_key("small"), timeout=10).value.tolist() == [0, 1, 2, 3]
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(make_key("never"), timeout=1.0)  # polls: every record is taken now
        assert consumer.stats()["shm"]["rings"] == 0  # the dead run's ring is unmapped
        left = _left(ns) - mine
        kinds = {e.split(Names(ns).prefix, 1)[1][0] for e in left}
        assert kinds <= {"h"}, left  # only the held slot of big2's array, if not yet given back
        # A new run of the producer is received as before.
        with ChildWorker(PRODUCER, namespace=ns) as again:
            again.send(make_key("after"), np.full(300_000, 9, np.uint8), step=2)
            assert consumer.rendezvous(2).recv(make_key("after"), timeout=10).value[0] == 9
    assert _left(ns) == set()


_SRC = "/job:a/replica:0/task:0/device:CPU:0"
_DST = "/job:a/replica:0/task:1/device:CPU:0"


def _live_key(name: str) -> str:
    """A key of ``name`` that does not pin the producer's incarnation."""
    return shmrdv.create_key(_SRC, 0, _DST, name)


def _pair(ns: str) -> tuple[shmrdv.Worker, shmrdv.Worker]:
    return shmrdv.Worker(_SRC.rsplit("/", 1)[0], namespace=ns), shmrdv.Worker(
        _DST.rsplit("/", 1)[0], namespace=ns
    )


def test_consumer_channels_keep_each_keys_order_and_go_at_cleanup(ns: str) -> None:
    """A key's messages, sent after its first was taken or before, arrive in order, and a
    second key's two messages sent before any receive too. The consumer counts one channel
    per (step, key), none after cleanup."""
    wp, wc = _pair(ns)
    with wp, wc:
        rp, rc = wp.rendezvous(5), wc.rendezvous(5)
        rp.send(_live_key("x"), np.arange(3, dtype=np.int32))
        assert rc.recv(_live_key("x"), timeout=10).value.tolist() == [0, 1, 2]
        for i in (1, 2):
            rp.send(_live_key("x"), np.full(3, i, dtype=np.int32))
        rp.send(_live_key("y"), np.full(2, 7, dtype=np.int16))
        rp.send(_live_key("y"), np.full(2, 8, dtype=np.int16))
        assert rc.recv(_live_key("x"), timeout=10).value.tolist() == [1, 1, 1]
        assert rc.recv(_live_key("y"), timeout=10).value.tolist() == [7, 7]
        assert rc.recv(_live_key("x"), timeout=10).value.tolist() == [2, 2, 2]
        assert rc.recv(_live_key("y"), timeout=10).value.tolist() == [8, 8]
        with pytest.raises(shmrdv.DeadlineExceededError):
            rc.recv(_live_key("x"), timeout=0.05)
        stats = wc.stats()["shm"]
        assert stats["channels"] == 2 and stats["received"] == 5, stats
        wp.cleanup(5)
        wc.cleanup(5)
        assert wc.stats()["shm"]["channels"] == 0


def test_consumer_serves_pinned_keys_waiters_and_dead_values(ns: str) -> None:
    """A key that names its producer's incarnation is served; a receive that waits first
    is served when the record comes; dead values stay dead."""
    wp, wc = _pair(ns)
    with wp, wc:
        rp, rc = wp.rendezvous(6), wc.rendezvous(6)
        pinned = shmrdv.create_key(_SRC, wp.incarnation, _DST, "pinned")
        rp.send(pinned, np.arange(4, dtype=np.float64))
        assert rc.recv(pinned, timeout=10).value.tolist() == [0.0, 1.0, 2.0, 3.0]
        fut = rc.recv_future(_live_key("later"))
        rp.send(_live_key("later"), np.ones(2, dtype=np.uint8), is_dead=True)
        got = fut.result(10)
        assert got.is_dead and got.value.tolist() == [1, 1]
        rp.send(_live_key("dead"), np.zeros(1, dtype=np.uint8), is_dead=True)
        assert rc.recv(_live_key("dead"), timeout=10).is_dead
        wp.cleanup(6)
        wc.cleanup(6)
