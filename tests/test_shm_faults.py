"""The shared-memory fault matrix (issue 6 §2): real SIGKILLs at bad moments.

Each case asserts that every tensor sent before the fault is received intact or reported
lost with an error — never half-written — and that nothing is left once ``gc`` runs.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.naming import SHM_DIR, Names
from shmrdv._shm.reaper import collect

N = 32 << 20  # 32 MiB: a send takes milliseconds, so a kill lands inside one


def ns_left(ns: str) -> list[str]:
    import os

    return [e for e in os.listdir(SHM_DIR) if Names(ns).prefix in e]


def send_forever(worker: shmrdv.Worker, k: str) -> None:
    """In the child: send 32 MiB tensors filled with their index, until killed."""
    rdv = worker.rendezvous(1)
    i = 0
    while True:
        rdv.send(k, np.full(N // 8, i, dtype=np.int64))
        i += 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5])
@pytest.mark.slow
def test_fault_producer_killed_while_writing_never_yields_a_half_tensor(
    ns: str, delay: float
) -> None:
    k = make_key("stream")
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        producer = ChildWorker(PRODUCER, namespace=ns, reply_timeout=5)
        box: list[BaseException] = []
        t = threading.Thread(target=lambda: _call_until_killed(producer, k, box))
        t.start()
        time.sleep(delay)
        producer.kill(signal.SIGKILL)  # somewhere inside a 32 MiB write, most likely
        t.join(10)
        rdv = consumer.rendezvous(1)
        got = 0
        while True:
            try:
                value = rdv.recv(k, timeout=2).value
            except (shmrdv.UnavailableError, shmrdv.DeadlineExceededError):
                break  # reported lost (or nothing more was published): never half a tensor
            assert value.shape == (N // 8,)
            assert (value == got).all(), f"tensor {got} is not intact"
            got += 1
            del value
        consumer.cleanup(1)
    collect(ns)
    assert ns_left(ns) == []


def _call_until_killed(producer: ChildWorker, k: str, box: list[BaseException]) -> None:
    try:
        producer.call(send_forever, k, timeout=30)
    except BaseException as e:  # the child dies under the call: that is the point
        box.append(e)


def recv_and_hold(worker: shmrdv.Worker, k: str, then: str) -> None:
    """In the child: receive ``k`` and then block (holding the array) or exit abruptly."""
    value = worker.rendezvous(1).recv(k, timeout=30).value
    assert value[0] == 7
    time.sleep(60)  # holding the zero-copy array until killed


def recv_blocked(worker: shmrdv.Worker, k: str) -> None:
    worker.rendezvous(1).recv(k, timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("moment", ["blocked", "holding"])
@pytest.mark.slow
def test_fault_consumer_killed_leaves_producer_working_and_gc_collects(
    ns: str, moment: str
) -> None:
    k = make_key("held")
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        consumer = ChildWorker(CONSUMER, namespace=ns, reply_timeout=5)
        done: list[BaseException] = []
        if moment == "blocked":
            fn, args = recv_blocked, (k,)
        else:
            producer.rendezvous(1).send(k, np.full(N // 8, 7, dtype=np.int64))
            fn, args = recv_and_hold, (k, "hold")
        t = threading.Thread(target=lambda: _call(consumer, fn, args, done))
        t.start()
        time.sleep(0.5)  # blocked in recv, or mapped and holding the array
        consumer.kill(signal.SIGKILL)
        t.join(10)
        # The producer is unharmed: it keeps sending (the consumer's messages stay for it).
        rdv = producer.rendezvous(1)
        for i in range(3):
            rdv.send(make_key(f"after{i}"), np.full(1 << 17, i, dtype=np.int64))
        producer.cleanup(1)
    # The producer closed; the consumer died: the namespace is dead. The producer's close
    # took the killed consumer's held slot, its record and doorbell (no gc was run); what
    # was sent to the consumer (messages, ring) waits for another run of it
    # (reaper.GRACE_S), or for gc.
    assert {e.split("_")[2][0] for e in ns_left(ns)} <= {"m", "q"}
    collect(ns)
    assert ns_left(ns) == []


def _call(
    consumer: ChildWorker, fn: object, args: tuple[object, ...], box: list[BaseException]
) -> None:
    try:
        consumer.call(fn, *args, timeout=30)  # type: ignore[arg-type]
    except BaseException as e:
        box.append(e)
