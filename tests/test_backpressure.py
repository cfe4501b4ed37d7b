"""Backpressure: ``Worker(max_inflight_bytes=N)`` bounds what a producer has in flight to one
consumer, over every cross-process transport (DESIGN.md "Backpressure")."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key, wait_for

import shmrdv
from shmrdv._window import VALUE_FLOOR
from shmrdv.testing import ChildWorker

MIB = 1 << 20
TRANSPORTS = [("shm",), ("grpc",)]


def _inflight(w: shmrdv.Worker, transport: tuple[str, ...]) -> int:
    return int(w.stats()[transport[0]]["inflight_bytes"])


@pytest.fixture(params=TRANSPORTS, ids=lambda t: t[0])
def transport(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def pair(ns: str, transport: tuple[str, ...]) -> Iterator[tuple[shmrdv.Worker, shmrdv.Worker]]:
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, transports=transport) as consumer,
        shmrdv.Worker(
            PRODUCER, namespace=ns, transports=transport, max_inflight_bytes=4 * MIB
        ) as producer,
    ):
        yield producer, consumer
        producer.cleanup(0)
        consumer.cleanup(0)


def test_backpressure_window_refuses_bad_values(ns: str) -> None:
    for bad in (0, -5, 1.5, "1m"):
        with pytest.raises(shmrdv.InvalidArgumentError, match="max_inflight_bytes"):
            shmrdv.Worker(PRODUCER, namespace=ns, max_inflight_bytes=bad)  # type: ignore[arg-type]


def test_backpressure_window_shows_in_repr_and_stats(ns: str) -> None:
    with shmrdv.Worker(PRODUCER, namespace=ns, max_inflight_bytes=3 * MIB) as w:
        assert f"max_inflight_bytes={3 * MIB}" in repr(w)
        assert w.max_inflight_bytes == 3 * MIB and w.stats()["max_inflight_bytes"] == 3 * MIB
    with shmrdv.Worker(PRODUCER, namespace=ns) as w:
        assert "max_inflight_bytes" not in repr(w) and w.stats()["max_inflight_bytes"] is None


def test_backpressure_full_window_times_out_and_sends_nothing(
    pair: tuple[shmrdv.Worker, shmrdv.Worker], transport: tuple[str, ...]
) -> None:
    producer, consumer = pair
    key = make_key("full")
    for i in range(4):
        producer.rendezvous(0).send(key, np.full(MIB // 8, i, np.float64))
    t0 = time.monotonic()
    with pytest.raises(shmrdv.ResourceExhaustedError, match=r"task:1.*max_inflight_bytes"):
        producer.rendezvous(0).send(key, np.full(MIB // 8, 99, np.float64), timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 5
    assert _inflight(producer, transport) <= 4 * MIB
    for i in range(4):
        assert consumer.rendezvous(0).recv(key, timeout=10).value[0] == i
    with pytest.raises(shmrdv.DeadlineExceededError):
        consumer.rendezvous(0).recv(key, timeout=0.5)  # the refused one never went out


def test_backpressure_empty_values_fill_the_window_and_all_arrive(
    ns: str, transport: tuple[str, ...]
) -> None:
    """A value of no bytes counts ``VALUE_FLOOR`` bytes: a flood of them stops at the
    window (before, shared memory let 200,000 through, one /dev/shm file each once the
    ring was full), and every one sent arrives, in order."""
    window = 64 << 10
    key = make_key("empty")
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, transports=transport) as consumer,
        shmrdv.Worker(
            PRODUCER, namespace=ns, transports=transport, max_inflight_bytes=window
        ) as producer,
    ):
        rdv = producer.rendezvous(0)
        sent = 0
        with pytest.raises(shmrdv.ResourceExhaustedError, match="max_inflight_bytes"):
            while sent < 5_000:
                rdv.send(key, np.zeros((sent % 7, 0), np.float32), timeout=0.2)
                sent += 1
        assert sent == window // VALUE_FLOOR
        for i in range(sent):
            assert consumer.rendezvous(0).recv(key, timeout=10).value.shape == (i % 7, 0)
        # Room again once they are taken (shared memory looks when a send waits; a gRPC
        # series' values count until its consumer acknowledges them).
        rdv.send(key, np.zeros((0,), np.float32), timeout=5)
        wait_for(lambda: _inflight(producer, transport) <= VALUE_FLOOR, timeout=10)


def test_backpressure_slow_consumer_bounds_and_keeps_order(
    pair: tuple[shmrdv.Worker, shmrdv.Worker], transport: tuple[str, ...]
) -> None:
    producer, consumer = pair
    key = make_key("slow")
    n = 24
    peak = 0
    errors: list[BaseException] = []

    def produce() -> None:
        nonlocal peak
        try:
            for i in range(n):
                producer.rendezvous(0).send(key, np.full(MIB // 8, i, np.float64), timeout=30)
                peak = max(peak, _inflight(producer, transport))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    got = []
    for _ in range(n):
        time.sleep(0.01)
        got.append(int(consumer.rendezvous(0).recv(key, timeout=30).value[0]))
    t.join(30)
    assert not errors
    assert got == list(range(n))
    assert 0 < peak <= 4 * MIB


def test_backpressure_large_tensor_goes_when_nothing_in_flight(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    key = make_key("big")
    producer.rendezvous(0).send(key, np.ones(6 * MIB, np.uint8), timeout=1)
    assert consumer.rendezvous(0).recv(key, timeout=10).value.nbytes == 6 * MIB


def test_backpressure_cleanup_returns_the_steps_bytes(
    pair: tuple[shmrdv.Worker, shmrdv.Worker], transport: tuple[str, ...]
) -> None:
    producer, consumer = pair
    key = make_key("cleaned")
    for _ in range(4):
        producer.rendezvous(1).send(key, np.zeros(MIB, np.uint8))
    with pytest.raises(shmrdv.ResourceExhaustedError):
        producer.rendezvous(1).send(key, np.zeros(MIB, np.uint8), timeout=0.1)
    consumer.cleanup(1)
    producer.cleanup(1)
    producer.rendezvous(2).send(key, np.zeros(MIB, np.uint8), timeout=10)
    assert consumer.rendezvous(2).recv(key, timeout=10).value.nbytes == MIB
    producer.cleanup(2)
    consumer.cleanup(2)


def test_backpressure_close_wakes_a_waiting_send(ns: str, transport: tuple[str, ...]) -> None:
    key = make_key("closing")
    errors: list[BaseException] = []
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=transport) as consumer:
        producer = shmrdv.Worker(
            PRODUCER, namespace=ns, transports=transport, max_inflight_bytes=MIB
        )
        producer.rendezvous(0).send(key, np.zeros(MIB, np.uint8))

        def blocked() -> None:
            try:
                producer.rendezvous(0).send(key, np.ones(MIB, np.uint8))  # no timeout
            except shmrdv.RendezvousError as e:
                errors.append(e)

        t = threading.Thread(target=blocked)
        t.start()
        wait_for(lambda: producer.stats()[transport[0]]["window_waits"] == 1)
        producer.close()
        t.join(10)
        assert not t.is_alive() and len(errors) == 1, errors
        if transport == ("shm",):  # over gRPC the outbox went with the producer
            assert consumer.rendezvous(0).recv(key, timeout=10).value[0] == 0
            with pytest.raises(shmrdv.DeadlineExceededError):
                consumer.rendezvous(0).recv(key, timeout=0.3)  # the woken one never went out
        consumer.cleanup(0)


def test_backpressure_dead_consumer_frees_the_window(ns: str, transport: tuple[str, ...]) -> None:
    key = make_key("dies")
    with (
        ChildWorker(CONSUMER, namespace=ns, transports=transport) as consumer,
        shmrdv.Worker(
            PRODUCER, namespace=ns, transports=transport, max_inflight_bytes=2 * MIB
        ) as producer,
    ):
        producer.rendezvous(0).send(key, np.zeros(2 * MIB, np.uint8))
        with pytest.raises(shmrdv.ResourceExhaustedError):
            producer.rendezvous(0).send(key, np.zeros(MIB, np.uint8), timeout=0.1)
        consumer.kill()
        t0 = time.monotonic()
        producer.rendezvous(0).send(key, np.zeros(MIB, np.uint8), timeout=10)
        assert time.monotonic() - t0 < 5
        producer.cleanup(0)
    # The dead consumer's unreceived messages are nobody's now: collect them.
    gc = subprocess.run(
        [sys.executable, "-m", "shmrdv", "gc", "--namespace", ns],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gc.returncode == 0, gc.stderr
