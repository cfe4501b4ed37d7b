"""A gRPC producer that goes away while its consumer waits (issue 19, bugs 3a and 3b).

The producer Worker runs in a spawned child (``ChildWorker``, ``transports=("grpc",)``), the
consumer in this process, blocked in ``recv`` (or holding a ``recv_future``) on a key the
producer has not sent. Closing the producer, or killing it, must fail the receive within
about a second — as shared memory does — with ``UnavailableError`` naming the producer,
its address and the gRPC status, not leave it waiting for its own deadline. Closing is
graceful: the consumer's gRPC library does not log a "Got goaway" for its cancelled call.
"""

from __future__ import annotations

import time

import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._procs import ChildWorker

pytestmark = pytest.mark.timeout(60)

# The consumer's own deadline: far beyond the second the failure may take.
DEADLINE = 8.0
# "Within about a second": the grace a producer that died gets to come back, plus slack
# for a loaded machine.
GONE_WITHIN = 2.5


def child_send(worker: shmrdv.Worker, step: int, key: str) -> None:
    import numpy as np

    worker.rendezvous(step).send(key, np.arange(10.0))


def _connected(rdv: shmrdv.Rendezvous, producer: ChildWorker) -> None:
    """One value over gRPC first: the consumer has reached the producer's server."""
    producer.call(child_send, 1, make_key("warm"))
    assert rdv.recv(make_key("warm"), timeout=10).value.size == 10


def _check_gone(error: BaseException | None, producer: ChildWorker, elapsed: float) -> None:
    assert isinstance(error, shmrdv.UnavailableError), repr(error)
    text = str(error)
    assert PRODUCER in text, text
    assert producer.address is not None and producer.address in text, text
    assert "UNAVAILABLE" in text, text
    assert elapsed < GONE_WITHIN, f"noticed {elapsed:.2f}s after the producer went away"


@pytest.mark.parametrize("how", ["close", "kill"])
def test_blocked_recv_fails_soon_when_the_producer_goes(ns: str, how: str) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer:
        rdv = consumer.rendezvous(1)
        producer = ChildWorker(PRODUCER, namespace=ns, transports=("grpc",))
        try:
            _connected(rdv, producer)
            fut = rdv.recv_future(make_key("never"))  # a parked future's call, too
            import threading

            gone_at: list[float] = []

            def go() -> None:
                gone_at.append(time.monotonic())
                if how == "kill":
                    producer.kill()
                else:
                    producer.close()

            threading.Timer(0.3, go).start()
            error: BaseException | None = None
            try:
                rdv.recv(make_key("x"), timeout=DEADLINE)
            except BaseException as e:
                error = e
            elapsed = time.monotonic() - gone_at[0]
            _check_gone(error, producer, elapsed)
            future_error = fut.exception(timeout=DEADLINE)
            _check_gone(future_error, producer, time.monotonic() - gone_at[0])
        finally:
            producer.close()


def test_producer_close_is_graceful_for_a_waiting_consumer(
    ns: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer:
        rdv = consumer.rendezvous(1)
        with ChildWorker(PRODUCER, namespace=ns, transports=("grpc",)) as producer:
            _connected(rdv, producer)
            fut = rdv.recv_future(make_key("never"))
            time.sleep(0.3)  # its call is parked at the producer's server
        assert isinstance(fut.exception(timeout=DEADLINE), shmrdv.UnavailableError)
    err = capfd.readouterr().err
    assert "goaway" not in err.lower(), err
