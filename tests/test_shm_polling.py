"""Polling the doorbell, between real processes (``bell.Poller``).

A receiver spins on its doorbell's value before it blocks (or polls for ``busy_poll``), and
a producer posts for every message unless a post is pending already. These tests check that
no wake-up is lost when the receiver stops polling (its budget spent, or the dispatcher
thread taking the poller role), and that a ping-pong is caught spinning. The consumer is a
``shmrdv.Worker`` in this process, the producer a Worker in a child; nothing asserts a
duration: ``tick_finds`` counts the values found only once a wait on the doorbell timed
out, which is what a lost post costs.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.bell import SPIN_WINDOW, spin_pays

# -- functions the child runs (ChildWorker.call: fn(worker, *args)) -------------------------


def child_send_after(
    worker: shmrdv.Worker, step: int, delays: list[float], prefix: str = "x"
) -> int:
    """Send ``<prefix>1``, ``<prefix>2``, ... each after its delay (s) from the last."""
    rdv = worker.rendezvous(step)
    for i, delay in enumerate(delays, 1):
        time.sleep(delay)
        rdv.send(make_key(f"{prefix}{i}"), np.array([i], dtype=np.int64))
    return len(delays)


def child_ping(worker: shmrdv.Worker, step: int, n: int) -> int:
    """Send ``ping{i}`` and wait for ``pong{i}``, ``n`` times."""
    rdv = worker.rendezvous(step)
    for i in range(n):
        rdv.send(make_key(f"ping{i}"), np.array([i], dtype=np.int64))
        got = rdv.recv(make_key(f"pong{i}", src=CONSUMER, dst=PRODUCER), timeout=30).value
        assert int(got[0]) == i
    return n


def child_send_values(worker: shmrdv.Worker, step: int, key: str, n: int, delay: float) -> int:
    """Send ``0 .. n-1`` under ``key``, each ``delay`` s after the last."""
    rdv = worker.rendezvous(step)
    for i in range(n):
        time.sleep(delay)
        rdv.send(make_key(key), np.array([i], dtype=np.int64))
    return n


def shm_stats(worker: shmrdv.Worker) -> dict[str, Any]:
    st: dict[str, Any] = worker.stats()["shm"]
    return st


def _warm(consumer: shmrdv.Worker, producer: ChildWorker, step: int, spin: bool = True) -> None:
    """Messages sent while the consumer waits for them (its rings attached), until one is
    found by polling if ``spin`` (a ``busy_poll`` receiver)."""
    rdv = consumer.rendezvous(step)
    hits = shm_stats(consumer)["spin_hits"]
    for i in range(1, 21):
        sender = threading.Thread(
            target=producer.call, args=(child_send_after, step, [0.001], f"w{i}_"), daemon=True
        )
        sender.start()
        assert int(rdv.recv(make_key(f"w{i}_1"), timeout=30).value[0]) == 1
        sender.join(30)
        if not spin or shm_stats(consumer)["spin_hits"] > hits:
            return
    raise AssertionError("no message was found by a spin")


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("busy_poll", "max_delay"),
    [(0.005, 0.01), (0.0, 0.0005)],
    ids=["busy_poll", "spin"],
)
def test_polling_receiver_that_stops_polling_is_woken_by_the_next_post(
    busy_poll: float, max_delay: float
) -> None:
    """Sends land before, around and after the moment the receiver stops polling (its
    busy_poll budget, or its spin, spent): each one is received on its post or by the
    poll, never only once the doorbell wait timed out."""
    ns = shmrdv.new_namespace()
    n = 40
    rng = random.Random(18)
    delays = [rng.uniform(0.0, 2 * max_delay) for _ in range(n)]
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, busy_poll=busy_poll) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        _warm(consumer, producer, 1, spin=busy_poll > 0)
        before = shm_stats(consumer)
        out: list[Any] = []
        sender = threading.Thread(
            target=lambda: out.append(producer.call(child_send_after, 1, delays, timeout=60)),
            daemon=True,
        )
        sender.start()
        rdv = consumer.rendezvous(1)
        got = [int(rdv.recv(make_key(f"x{i}"), timeout=30).value[0]) for i in range(1, n + 1)]
        sender.join(30)
        after = shm_stats(consumer)
        assert out == [n]
        assert got == list(range(1, n + 1))
        assert after["tick_finds"] == before["tick_finds"], (before, after)
        consumer.cleanup(1)
        producer.cleanup(1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("receive", ["recv", "future"])
def test_a_send_made_while_nobody_polls_is_found_by_the_next_receive(receive: str) -> None:
    """A send made while nobody polls leaves its post pending; the next receive, a blocked
    one whose busy_poll budget is spent or a future (the dispatcher thread polls), takes it
    and finds the message at once, not once its wait timed out."""
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, busy_poll=0.1) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        _warm(consumer, producer, 1)
        before = shm_stats(consumer)
        assert producer.call(child_send_after, 1, [0.0], timeout=30) == 1
        time.sleep(0.3)  # the busy_poll budget (0.1 s after the last message) is spent
        rdv = consumer.rendezvous(1)
        if receive == "recv":
            got = rdv.recv(make_key("x1"), timeout=30)
        else:
            got = rdv.recv_future(make_key("x1")).result(timeout=30)
        after = shm_stats(consumer)
        assert int(got.value[0]) == 1
        assert after["tick_finds"] == before["tick_finds"], (before, after)
        if receive == "future":
            assert after["dispatcher_polls"] > before["dispatcher_polls"], (before, after)
        consumer.cleanup(1)
        producer.cleanup(1)


@pytest.mark.timeout(60)
def test_callback_receive_after_polling_is_woken_by_the_post() -> None:
    """A blocked receive polls (and holds its post), then only a future waits: the
    dispatcher thread takes the poller role, takes that post back and sleeps; the next
    send, made once it sleeps, posts and wakes it."""
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, busy_poll=0.005) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        _warm(consumer, producer, 1)
        before = shm_stats(consumer)
        fut = consumer.rendezvous(1).recv_future(make_key("x1"))
        # Long enough for the thread to take the role (2 ms) and fall asleep first.
        assert producer.call(child_send_after, 1, [0.2], timeout=30) == 1
        assert int(fut.result(timeout=30).value[0]) == 1
        after = shm_stats(consumer)
        assert after["tick_finds"] == before["tick_finds"], (before, after)
        assert after["doorbell_posts"] > before["doorbell_posts"], (before, after)
        assert after["dispatcher_polls"] > before["dispatcher_polls"], (before, after)
        consumer.cleanup(1)
        producer.cleanup(1)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not spin_pays(), reason="the host is loaded: the spin is off")
def test_a_fresh_key_ping_pong_is_caught_spinning() -> None:
    """In a ping-pong of a new key per message the receiver's spin finds replies (its
    budget does not shrink under traffic; how many it finds depends on the host's load, so
    the bench measures that); no post is lost."""
    ns = shmrdv.new_namespace()
    n = 200
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        _warm(consumer, producer, 1, spin=False)
        before = shm_stats(consumer)
        out: list[Any] = []
        pinger = threading.Thread(
            target=lambda: out.append(producer.call(child_ping, 1, n, timeout=90)), daemon=True
        )
        pinger.start()
        rdv = consumer.rendezvous(1)
        for i in range(n):
            got = rdv.recv(make_key(f"ping{i}"), timeout=30).value
            rdv.send(make_key(f"pong{i}", src=CONSUMER, dst=PRODUCER), got)
        pinger.join(60)
        after = shm_stats(consumer)
        assert out == [n]
        spins = after["spins"] - before["spins"]
        hits = after["spin_hits"] - before["spin_hits"]
        assert spins > 0 and hits > 0, (before, after)
        assert after["tick_finds"] == before["tick_finds"], (before, after)
        consumer.cleanup(1)
        producer.cleanup(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["burst", "spaced"])
def test_values_drained_for_waiting_receives_keep_their_order(delay: float) -> None:
    """A value drained while receives of its key wait goes to the oldest of them at once
    (not through the stash): futures and blocked receives queued on one key get the values
    in sending order, a value nobody waits for yet is kept for the next receive, and the
    futures so served count as served: the dispatcher thread stops polling afterwards."""
    ns = shmrdv.new_namespace()
    n = 8
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, busy_poll=0.005) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        _warm(consumer, producer, 1)
        rdv = consumer.rendezvous(1)
        key = make_key("k")
        futs = [rdv.recv_future(key) for _ in range(3)]
        out: list[Any] = []
        sender = threading.Thread(
            target=lambda: out.append(producer.call(child_send_values, 1, "k", n, delay)),
            daemon=True,
        )
        sender.start()
        got = [f.result(timeout=30) for f in futs]
        got += [rdv.recv(key, timeout=30) for _ in range(n - 3)]
        sender.join(60)
        assert out == [n]
        assert [int(g.value[0]) for g in got] == list(range(n))
        assert shm_stats(consumer)["pending_receives"] == 0
        polls = shm_stats(consumer)["dispatcher_polls"]
        time.sleep(0.7)  # a callback receive counted as pending would poll every 0.2 s
        assert shm_stats(consumer)["dispatcher_polls"] == polls
        consumer.cleanup(1)
        producer.cleanup(1)


def test_an_unanswered_wait_turns_the_spin_off() -> None:
    """A receiver that waited a whole tick in vain spins no more until posts come again:
    an idle receiver blocked for 1.2 s (six ticks) spins once, at its first poll. (Its
    producer is up, and silent.)"""
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns),
    ):
        rdv = consumer.rendezvous(1)
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(make_key("never"), timeout=1.2)
        spins = consumer.stats()["shm"]["spins"]
        consumer.cleanup(1)
    assert spins == (1 if spin_pays() else 0)


def test_posts_turn_the_spin_on_again() -> None:
    """After an unanswered wait, a message that comes by a post starts the spin again."""
    if not spin_pays():
        pytest.skip("the spin is off on this host now (one CPU, or loaded)")
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns) as producer,
    ):
        rdv, prdv = consumer.rendezvous(1), producer.rendezvous(1)
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(make_key("never"), timeout=0.5)
        before = consumer.stats()["shm"]["spins"]
        got: queue.Queue[int] = queue.Queue()
        timer = threading.Timer(0.3, prdv.send, (make_key("late"), np.array([3])))
        timer.start()
        try:
            got.put(int(rdv.recv(make_key("late"), timeout=10).value[0]))
        finally:
            timer.join(10)
        timer = threading.Timer(0.05, prdv.send, (make_key("next"), np.array([4])))
        timer.start()
        try:
            assert rdv.recv(make_key("next"), timeout=10).value[0] == 4
        finally:
            timer.join(10)
        after = consumer.stats()["shm"]["spins"]
        consumer.cleanup(1)
        producer.cleanup(1)
    assert got.get_nowait() == 3
    assert after > before


@pytest.mark.timeout(60)
def test_spins_that_do_not_pay_pause_the_spin() -> None:
    """A producer that answers well after the spin's budget (2 ms): after a window of
    spins that found nothing, the spin pauses (it would only burn the CPU); every message
    still arrives on its post."""
    ns = shmrdv.new_namespace()
    n = 40
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        _warm(consumer, producer, 1, spin=False)
        before = shm_stats(consumer)
        out: list[Any] = []
        sender = threading.Thread(
            target=lambda: out.append(producer.call(child_send_after, 1, [0.002] * n)),
            daemon=True,
        )
        sender.start()
        rdv = consumer.rendezvous(1)
        got = [int(rdv.recv(make_key(f"x{i}"), timeout=30).value[0]) for i in range(1, n + 1)]
        sender.join(30)
        after = shm_stats(consumer)
        assert out == [n] and got == list(range(1, n + 1))
        spins = after["spins"] - before["spins"]
        assert spins <= SPIN_WINDOW + 2, (before, after)
        assert after["tick_finds"] == before["tick_finds"], (before, after)
        consumer.cleanup(1)
        producer.cleanup(1)
