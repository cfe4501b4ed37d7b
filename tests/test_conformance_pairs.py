"""The conformance battery over real two-process pairs: shared memory and gRPC.

The consumer is a Worker in this process; the producer is a Worker in a spawned child
process, driven over a pipe. ``shm``: every value crosses a real segment or ring and
every wake-up a real semaphore. ``grpc``: both take only ``transports=("grpc",)``, so
every value is pulled through RecvTensorStream from the child's real server on
127.0.0.1. Each check runs with plain sends and with allocate + send.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv.testing import CHECKS, RendezvousPair

_steps = itertools.count(1)
Workers = tuple[ChildWorker, shmrdv.Worker]


@pytest.fixture(scope="module", params=["shm", "grpc"])
def workers(request: pytest.FixtureRequest) -> Iterator[Workers]:
    transports = ("grpc",) if request.param == "grpc" else None
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, transports=transports) as consumer,
        ChildWorker(PRODUCER, namespace=ns, transports=transports) as producer,
    ):
        yield producer, consumer


@contextmanager
def pair_of(workers: Workers, allocate: bool) -> Iterator[RendezvousPair]:
    producer, consumer = workers
    step = next(_steps)

    try:
        yield RendezvousPair(
            producer=producer.producer(step, allocate=allocate),
            consumer=consumer.rendezvous(step),
            make_key=make_key,
        )
    finally:
        consumer.cleanup(step)
        producer.cleanup(step)


@pytest.mark.parametrize("allocate", [False, True], ids=["send", "allocate"])
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance_pair(
    check: Callable[[RendezvousPair], None], allocate: bool, workers: Workers
) -> None:
    with pair_of(workers, allocate) as pair:
        check(pair)
