"""A Worker's routes: derived once per pair of key ends (never per edge name), transports
chosen from the priority list by what the peer takes, the closed-worker error."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import make_key

import shmrdv

A = "/job:a/replica:0/task:0"
B = "/job:b/replica:0/task:0"


def test_router_one_route_per_pair_of_ends_whatever_the_keys_and_steps(
    shmrdv_namespace: str,
) -> None:
    # A key per item and TensorFlow's new step per run both reuse the same two ends: their
    # route is derived once, and a key used once leaves nothing behind.
    with shmrdv.Worker(A, namespace=shmrdv_namespace) as w:
        for step in range(200):
            rdv = w.rendezvous(step)
            key = make_key(f"x{step}", src=A, dst=A)
            rdv.send(key, np.arange(3))
            assert rdv.recv(key, timeout=5).value.tolist() == [0, 1, 2]
            w.cleanup(step)
        assert w.stats()["routes"] == 1


def test_router_routes_are_bounded(shmrdv_namespace: str) -> None:
    from shmrdv._routes import ENDS_MAX as _ENDS_MAX

    with shmrdv.Worker(A, namespace=shmrdv_namespace) as w:
        rdv = w.rendezvous(1)
        for i in range(_ENDS_MAX + 50):
            device = f"{A}/device:CPU:{i}"  # a new pair of ends each time
            key = shmrdv.create_key(device, 0, device, "k")
            rdv.send(key, np.zeros(1))
            rdv.recv(key, timeout=5)
        assert w.stats()["routes"] <= _ENDS_MAX


def test_router_takes_only_a_transport_the_peer_takes(shmrdv_namespace: str) -> None:
    # The producer prefers gRPC, but the consumer's presence record says it takes
    # shared memory only: the route is shared memory.
    with (
        shmrdv.Worker(B, namespace=shmrdv_namespace, transports=("shm",)) as consumer,
        shmrdv.Worker(A, namespace=shmrdv_namespace, transports=("grpc", "shm")) as producer,
    ):
        key = make_key("x", src=A, dst=B)
        producer.rendezvous(1).send(key, np.arange(4.0))
        assert consumer.rendezvous(1).recv(key, timeout=10).value.tolist() == [0, 1, 2, 3]
        assert producer.stats()["shm"]["sent"] == 1
        assert producer.stats()["grpc"]["sent"] == 0


def test_router_first_preference_wins_when_the_peer_takes_both(shmrdv_namespace: str) -> None:
    with (
        shmrdv.Worker(B, namespace=shmrdv_namespace, transports=("grpc", "shm")) as consumer,
        shmrdv.Worker(A, namespace=shmrdv_namespace, transports=("grpc", "shm")) as producer,
    ):
        key = make_key("x", src=A, dst=B)
        producer.rendezvous(1).send(key, np.arange(4.0))
        assert consumer.rendezvous(1).recv(key, timeout=10).value.tolist() == [0, 1, 2, 3]
        assert producer.stats()["grpc"]["sent"] == 1
        assert producer.stats()["shm"]["sent"] == 0


@pytest.mark.parametrize(
    ("consumer_order", "producer_order", "used"),
    [(("grpc", "shm"), ("shm", "grpc"), "shm"), (("shm", "grpc"), ("grpc", "shm"), "grpc")],
)
def test_router_both_ends_take_the_producers_pick(
    shmrdv_namespace: str,
    consumer_order: tuple[str, ...],
    producer_order: tuple[str, ...],
    used: str,
) -> None:
    """Workers that list the transports in different orders still meet: a key goes by the
    producer's first choice, and its consumer waits there (it waited on its own first
    choice, and the value never came)."""
    with (
        shmrdv.Worker(B, namespace=shmrdv_namespace, transports=consumer_order) as consumer,
        shmrdv.Worker(A, namespace=shmrdv_namespace, transports=producer_order) as producer,
    ):
        key = make_key("x", src=A, dst=B)
        producer.rendezvous(1).send(key, np.arange(4.0))
        assert consumer.rendezvous(1).recv(key, timeout=10).value.tolist() == [0, 1, 2, 3]
        assert producer.stats()[used]["sent"] == 1


def test_router_no_common_transport_says_why(shmrdv_namespace: str) -> None:
    with (
        shmrdv.Worker(B, namespace=shmrdv_namespace, transports=("grpc",)),
        shmrdv.Worker(A, namespace=shmrdv_namespace, transports=("shm",)) as producer,
        pytest.raises(shmrdv.InvalidArgumentError, match="takes transports"),
    ):
        producer.rendezvous(1).send(make_key("x", src=A, dst=B), np.zeros(2))


def test_router_closed_worker_has_one_message(shmrdv_namespace: str) -> None:
    w = shmrdv.Worker(A, namespace=shmrdv_namespace)
    rdv = w.rendezvous(1)
    errors: list[BaseException] = []
    got = threading.Event()

    def done(error: BaseException | None, _received: object) -> None:
        errors.append(error)  # type: ignore[arg-type]
        got.set()

    rdv.recv_async(make_key("x", src=B, dst=A), done)  # pending across the close
    w.close()
    assert got.wait(10)
    expected = f"Worker {A} is closed"
    assert isinstance(errors[0], shmrdv.AbortedError) and str(errors[0]) == expected
    for call in (
        lambda: rdv.send(make_key("x", src=A, dst=B), np.zeros(1)),
        lambda: rdv.recv(make_key("x", src=B, dst=A), timeout=1),
        lambda: w.rendezvous(2),
    ):
        with pytest.raises(shmrdv.AbortedError) as info:
            call()
        assert str(info.value) == expected


def test_router_bad_send_timeout_refused(shmrdv_namespace: str) -> None:
    with (
        shmrdv.Worker(A, namespace=shmrdv_namespace) as w,
        pytest.raises(shmrdv.InvalidArgumentError, match="timeout"),
    ):
        w.rendezvous(1).send(make_key("x", src=A, dst=A), np.zeros(1), timeout=-1)


def test_router_checks_every_value_whatever_came_before(shmrdv_namespace: str) -> None:
    # Every value is checked, whatever the key sent before.
    with shmrdv.Worker(A, namespace=shmrdv_namespace) as w:
        rdv, key = w.rendezvous(1), make_key("x", src=A, dst=A)
        with pytest.raises(shmrdv.InvalidArgumentError, match="Python objects"):
            rdv.send(key, np.empty((), dtype=object))
        rdv.send(key, np.zeros(2))
        with pytest.raises(shmrdv.InvalidArgumentError, match="Python objects"):
            rdv.send(key, np.empty(2, dtype=object))
        with pytest.raises(shmrdv.InvalidArgumentError, match="only numpy arrays"):
            rdv.send(key, [0.0, 0.0])
        rdv.send(key, np.float64(3.0))  # a numpy scalar: a 0-d array
        assert rdv.recv(key, timeout=5).value.tolist() == [0.0, 0.0]
        assert rdv.recv(key, timeout=5).value.tolist() == 3.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocking", [True, False], ids=["recv", "recv_future"])
@pytest.mark.parametrize(
    ("consumer_order", "producer_order", "used"),
    [
        (("grpc", "shm"), ("shm", "grpc"), "shm"),
        (("shm", "grpc"), ("grpc", "shm"), "grpc"),
        (("shm", "grpc"), ("shm", "grpc"), "shm"),
    ],
)
def test_router_a_receive_started_before_its_producer_meets_its_pick(
    shmrdv_namespace: str,
    consumer_order: tuple[str, ...],
    producer_order: tuple[str, ...],
    used: str,
    blocking: bool,
) -> None:
    """Before the producer starts, its record is provisional and its order unknown: the
    receive listens on the consumer's own pick, and on the producer's once it is known,
    which delivers (it waited on the consumer's own first choice, and the value never
    came). A producer that picks the consumer's own first choice makes no other transport:
    no gRPC client where shared memory carries the key."""
    with shmrdv.Worker(B, namespace=shmrdv_namespace, transports=consumer_order) as consumer:
        rdv = consumer.rendezvous(1)
        key = make_key("early", src=A, dst=B)
        got: list[object] = []
        if blocking:
            t = threading.Thread(target=lambda: got.append(rdv.recv(key, timeout=20)))
            t.start()
        else:
            fut = rdv.recv_future(key)
        try:
            with shmrdv.Worker(
                A, namespace=shmrdv_namespace, transports=producer_order
            ) as producer:
                producer.rendezvous(1).send(key, np.arange(3.0))
                if blocking:
                    t.join(20)
                    received = got[0]
                else:
                    received = fut.result(20)
                assert isinstance(received, shmrdv.Received)
                assert received.value.tolist() == [0.0, 1.0, 2.0]
                assert producer.stats()[used]["sent"] == 1
                if used == consumer_order[0]:
                    assert set(consumer.stats()) & {"shm", "grpc"} == {used}
                # Once the producer is known, a receive listens on its pick alone.
                producer.rendezvous(1).send(key, np.arange(2.0))
                assert rdv.recv(key, timeout=10).value.tolist() == [0.0, 1.0]
                producer.cleanup(1)
        finally:
            consumer.cleanup(1)
            if blocking:
                t.join(20)
