"""A polling receiver's own doorbell post, between real processes (issue 18 §1).

While a receiver spins on the rings' heads it keeps a post of its own pending on its
doorbell, and a producer that finds a post pending does not post (``dispatcher.py``,
"The poller's own post"). These tests check that no wake-up is lost when the receiver
stops polling (its budget spent, or the dispatcher thread taking the poller role), and
that a polling receiver's producer posts nothing. The consumer is a ``shmrdv.Worker`` in
this process, the producer a Worker in a spawned child; nothing asserts a duration:
``tick_finds`` counts the values found only once a wait on the doorbell timed out, which
is what a lost post costs, and ``doorbell_posts`` the posts the consumer took.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._procs import ChildWorker

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
    """Messages sent while the consumer waits for them, until one is found by a spin (the
    rings attached, the poller's own post pending since that spin) if ``spin``."""
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
    ids=["busy_poll", "adaptive_spin"],
)
def test_polling_receiver_that_stops_polling_is_woken_by_the_next_post(
    busy_poll: float, max_delay: float
) -> None:
    """Sends land before, around and after the moment the receiver stops polling (its
    busy_poll budget, or its adaptive spin, spent): each one is received on its post or
    by the poll, never only once the doorbell wait timed out."""
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
def test_a_send_that_skipped_its_post_is_found_by_the_next_receive(receive: str) -> None:
    """The receiver's poll found a message and returned, its own post left pending; the
    next send comes while nobody polls, finds that post and does not post. The next
    receive, a blocked one whose busy_poll budget is spent (it does not spin) or a future
    (the dispatcher thread polls, and never spins), takes the post back before it would
    sleep and finds the message by the look after it, not once its wait timed out."""
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
        assert after["doorbell_posts"] == before["doorbell_posts"], (before, after)
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
def test_polling_receiver_takes_no_post_per_message() -> None:
    """In a ping-pong the receiving side polls throughout (busy_poll far above a round
    trip): its producer finds the poller's own post pending and posts nothing, so the
    receiver takes no post per message (one per message without the poller's post)."""
    ns = shmrdv.new_namespace()
    n = 200
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, busy_poll=30.0) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        _warm(consumer, producer, 1)
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
        posts = after["doorbell_posts"] - before["doorbell_posts"]
        assert posts < n // 4, (before, after)
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
