"""A pool slot's way back through its control block (issue 18 §2), and what may go wrong.

A consumer whose array over a pool slot is collected renames the slot's ``held`` name to
``returned`` and stores the ticket of its next lend in the slot's control block; the
producer reads the word at its next acquire and reuses the slot without touching a name (it
publishes it from ``returned``). These tests check that the slot is reused that way (no
``pool`` name again), and that a file shrunk under a slot name, or planted under a name the
slot could go back to, is refused and crashes neither side (a SIGBUS would kill this very
process: both workers run in it).
"""

from __future__ import annotations

import gc
import os
import signal
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key, remove_planted, run_as_nobody, wait_for

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.naming import SHM_DIR, SLOT_BITS, Names
from shmrdv._shm.pool import CONTROL

INCARNATION = 0x5107_0000_0000_0001
# 1 MiB of float64: well above the ring's 64 KiB, so every message goes through a pool slot.
N = 1 << 17
NEXT = 1 << SLOT_BITS  # a slot's ticket grows by this at each lend


def kinds(ns: str) -> list[str]:
    """The kind letters of ``ns``'s segment files (doorbell semaphores left out)."""
    prefix = Names(ns).prefix
    return sorted(e[len(prefix)] for e in os.listdir(SHM_DIR) if e.startswith(prefix))


def pool_stats(worker: shmrdv.Worker) -> dict[str, Any]:
    return dict(worker.stats()["shm"])


@pytest.fixture
def pair(ns: str) -> Iterator[tuple[shmrdv.Worker, shmrdv.Worker]]:
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        yield producer, consumer
        consumer.cleanup(1)
        producer.cleanup(1)


def test_slot_returned_through_its_control_block_is_reused(
    ns: str, pair: tuple[shmrdv.Worker, shmrdv.Worker]
) -> None:
    producer, consumer = pair
    names = Names(ns)
    key = make_key("again")
    prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(5):
        prdv.send(key, np.full(N, i, dtype=np.float64))
        got = crdv.recv(key, timeout=5).value
        assert got[0] == i and got[-1] == i
        assert kinds(ns).count("h") == 1  # held while the array lives
        del got
        # Given back at once; the producer takes it from there without renaming it to a
        # ``pool`` name first.
        assert kinds(ns).count("r") == 1 and "h" not in kinds(ns) and "p" not in kinds(ns)
        back = names.path(names.returned(PRODUCER, INCARNATION, i * NEXT))
        with open(back, "rb") as f:  # the control block says so too
            f.seek(-CONTROL, os.SEEK_END)
            assert int.from_bytes(f.read(8), "little") == (i + 1) * NEXT
    st = pool_stats(producer)
    assert st["pool_created"] == 1 and st["pool_reused"] == 4, st
    assert st["pool_lost"] == 0 and st["pool_refused"] == 0, st


def test_receive_waiting_before_its_message_takes_whichever_slot_comes(
    ns: str, pair: tuple[shmrdv.Worker, shmrdv.Worker]
) -> None:
    """A receive that waits before its message is sent has that message's names computed
    meanwhile, for the slot the key's last message came in (``NamedMessages.ahead``). The
    message is taken, and its slot given back under its own names, whether it comes in
    that slot (under its next ticket) or in another one (the first slot still held)."""
    producer, consumer = pair
    names = Names(ns)
    key = make_key("ahead")
    prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
    kept = None
    # Message: the slot's ticket. Slot 0 serves 0-2; 2 stays held, so 3 comes in slot 1
    # (slot 0's next ticket was predicted), and 4 and 5 in slot 1 again.
    tickets = [0, NEXT, 2 * NEXT, 1, 1 + NEXT, 1 + 2 * NEXT]
    for i, ticket in enumerate(tickets):
        fut = crdv.recv_future(key)  # waits: the next message's names are computed now
        prdv.send(key, np.full(N, i, dtype=np.float64))
        got = fut.result(timeout=5).value
        assert got[0] == i and got[-1] == i
        assert os.path.exists(names.path(names.held(PRODUCER, INCARNATION, ticket)))
        if i == 2:
            kept = got
        del got, fut
        gc.collect()  # (a future that completed is in a reference cycle until collected)
        if i != 2:
            back = names.path(names.returned(PRODUCER, INCARNATION, ticket))
            assert os.path.exists(back), i
    assert kept is not None and kept[0] == 2
    del kept
    gc.collect()
    assert os.path.exists(names.path(names.returned(PRODUCER, INCARNATION, 2 * NEXT)))
    assert "h" not in kinds(ns)
    st = pool_stats(producer)
    assert st["pool_created"] == 2 and st["pool_lost"] == 0 and st["pool_refused"] == 0, st


def test_slot_shrunk_before_its_take_is_refused_and_both_sides_go_on(
    ns: str, pair: tuple[shmrdv.Worker, shmrdv.Worker]
) -> None:
    producer, consumer = pair
    names = Names(ns)
    key = make_key("shrunk")
    prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
    prdv.send(key, np.full(N, 1.0))
    assert crdv.recv(key, timeout=5).value[0] == 1.0  # the consumer keeps the slot mapped
    prdv.send(key, np.full(N, 2.0))  # the same slot, announced by the ring
    message = names.path(names.message(1, key, INCARNATION, 1))
    os.truncate(message, 4096)  # a buggy process of this user
    with pytest.raises(shmrdv.InternalError, match=r"truncated|past the end"):
        crdv.recv(key, timeout=5)
    prdv.send(key, np.full(N, 3.0))  # the producer forgets the shrunk slot, uses another
    np.testing.assert_array_equal(crdv.recv(key, timeout=5).value, np.full(N, 3.0))
    st = pool_stats(producer)
    assert st["pool_created"] == 2, st


def test_slot_shrunk_while_held_gives_nothing_back_and_crashes_nothing(
    ns: str, pair: tuple[shmrdv.Worker, shmrdv.Worker]
) -> None:
    producer, consumer = pair
    names = Names(ns)
    key = make_key("held-shrunk")
    prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
    prdv.send(key, np.full(N, 1.0))
    got = crdv.recv(key, timeout=5).value
    assert got[0] == 1.0
    os.truncate(names.path(names.held(PRODUCER, INCARNATION, 0)), 4096)
    del got  # its control block is gone: nothing is stored (that would be a SIGBUS)
    for i in range(2, 4):
        prdv.send(key, np.full(N, float(i)))  # the shrunk slot is forgotten, not written
        np.testing.assert_array_equal(crdv.recv(key, timeout=5).value, np.full(N, float(i)))
    assert pool_stats(producer)["pool_created"] == 2


def _plant(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"planted")
    os.close(fd)


@dataclass
class Planted:
    path: str

    def assert_untouched(self) -> None:
        st = os.stat(self.path, follow_symlinks=False)
        assert stat.S_ISREG(st.st_mode) and st.st_uid != os.geteuid()
        with open(self.path, "rb") as f:
            assert f.read() == b"planted"


@pytest.mark.skipif(os.geteuid() != 0, reason="planting as another user needs root")
def test_file_planted_under_the_next_pool_name_is_left_alone(ns: str) -> None:
    names = Names(ns)
    planted_at = names.path(names.pool(PRODUCER, INCARNATION, NEXT))  # slot 0's next name
    run_as_nobody(_plant, planted_at)
    planted = Planted(planted_at)
    planted.assert_untouched()
    key = make_key("planted")
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
        for i in range(4):
            prdv.send(key, np.full(N, float(i)))
            got = crdv.recv(key, timeout=5).value
            assert got[0] == float(i)
            got[:] = -1  # the consumer's own memory, never the planted file
            del got
            planted.assert_untouched()
        st = pool_stats(producer)
        assert st["pool_created"] == 1 and st["pool_reused"] == 3, st
        consumer.cleanup(1)
        producer.cleanup(1)
    planted.assert_untouched()
    remove_planted(ns)


def test_slot_given_back_after_its_producer_closed_is_collected(ns: str) -> None:
    """The producer closes while the consumer holds its slot: the slot, given back later,
    goes with what that run left once the consumer sees the run is over (its ring is
    retired), without a look at the producer's liveness per give-back."""
    key = make_key("late")
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        crdv = consumer.rendezvous(1)
        with shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer:
            producer.rendezvous(1).send(key, np.full(N, 5.0))
            got = crdv.recv(key, timeout=5).value
        assert got[0] == 5.0
        del got
        # A receive that waits lets the consumer's scans look at its producers meanwhile.
        deadline = time.monotonic() + 5
        while {"p", "r", "h"} & set(kinds(ns)) and time.monotonic() < deadline:
            with pytest.raises(shmrdv.DeadlineExceededError):
                crdv.recv(make_key("nothing"), timeout=0.3)
        assert not {"p", "r", "h"} & set(kinds(ns)), kinds(ns)
        consumer.cleanup(1)
    wait_for(lambda: kinds(ns) == [], 5, "nothing left")


_kept: list[Any] = []


def child_recv_and_keep(worker: shmrdv.Worker, key: str) -> float:
    got = worker.rendezvous(1).recv(key, timeout=10).value
    _kept.append(got)  # held until the process dies
    return float(got[0])


@pytest.mark.slow
def test_slot_held_by_a_killed_consumer_goes_back_to_its_producer(ns: str) -> None:
    """A consumer killed while it holds a slot leaves its ``held`` name (nothing ran to
    give it back): the producer sees that run gone and takes the slot back for its next
    sends, within about a second, instead of holding its memory for nothing."""
    names = Names(ns)
    key = make_key("killed")
    with shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer:
        prdv = producer.rendezvous(1)
        consumer = ChildWorker(CONSUMER, namespace=ns)
        try:
            prdv.send(key, np.full(N, 1.0))
            assert consumer.call(child_recv_and_keep, key) == 1.0
            held = names.path(names.held(PRODUCER, INCARNATION, 0))
            assert os.path.exists(held)
            consumer.kill(signal.SIGKILL)
            consumer.process.join(10)
        finally:
            consumer.close()
        assert os.path.exists(held)  # the killed consumer left it
        deadline = time.monotonic() + 5
        while pool_stats(producer)["pool_reclaimed"] == 0:
            assert time.monotonic() < deadline, pool_stats(producer)
            # Each send needs a slot: the lost check of the held one runs at most once a
            # second. (Nobody receives these: they are unlinked at cleanup.)
            prdv.send(key, np.full(N, 2.0))
            time.sleep(0.2)
        assert not os.path.exists(held)
        st = pool_stats(producer)
        # The send that took it back was served by it (the others' slots are unreceived).
        assert st["pool_reused"] == 1 and st["pool_lost"] == 0, st
        producer.cleanup(1)


def test_slot_given_back_after_its_producer_closed_goes_at_the_consumers_close(ns: str) -> None:
    """As above, but the consumer closes without another scan, while another worker keeps
    the namespace alive (so no sweep of a dead namespace takes it): its close collects
    what the closed producer run left."""
    key = make_key("late-close")
    with shmrdv.Worker("/job:worker/replica:0/task:2", namespace=ns):
        with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
            with shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer:
                producer.rendezvous(1).send(key, np.full(N, 6.0))
                got = consumer.rendezvous(1).recv(key, timeout=5).value
            assert got[0] == 6.0
            del got  # given back to a producer that is gone
            consumer.cleanup(1)
        assert not {"p", "r", "h", "m"} & set(kinds(ns)), kinds(ns)
