"""The conformance battery over a real two-process pair through shared memory.

The consumer is a Worker in this process; the producer is a Worker in a spawned child
process, driven over a pipe. Every value crosses a real segment, every wake-up a real
semaphore. The same checks run with plain sends (one copy) and with allocate + send
(zero copy).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

import shmrdv
from shmrdv._child import ChildWorker
from shmrdv.testing import CHECKS, RendezvousPair

PRODUCER = "/job:worker/replica:0/task:0"
CONSUMER = "/job:worker/replica:0/task:1"

_steps = itertools.count(1)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[ChildWorker, shmrdv.Worker]]:
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        yield producer, consumer
        for step in range(1, next(_steps)):
            consumer.cleanup(step)


@contextmanager
def shm_pair(
    workers: tuple[ChildWorker, shmrdv.Worker], allocate: bool
) -> Iterator[RendezvousPair]:
    producer, consumer = workers
    step = next(_steps)

    def make_key(edge: str) -> str:
        return shmrdv.create_key(f"{PRODUCER}/device:CPU:0", 0, f"{CONSUMER}/device:CPU:0", edge)

    try:
        yield RendezvousPair(
            producer=producer.producer(step, allocate=allocate),
            consumer=consumer.rendezvous(step),
            make_key=make_key,
        )
    finally:
        consumer.cleanup(step)
        producer.cleanup(step)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_shm_conformance_send(
    check: Callable[[RendezvousPair], None], workers: tuple[ChildWorker, shmrdv.Worker]
) -> None:
    with shm_pair(workers, allocate=False) as pair:
        check(pair)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_shm_conformance_allocate(
    check: Callable[[RendezvousPair], None], workers: tuple[ChildWorker, shmrdv.Worker]
) -> None:
    with shm_pair(workers, allocate=True) as pair:
        check(pair)
