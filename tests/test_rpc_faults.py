"""gRPC under faults (issue 6 §2): real child processes, real sockets, real signals.

A producer Worker runs in a spawned child (``ChildWorker``, ``transports=("grpc",)``), the
consumer in this process; the consumer finds the producer's address in its presence
record (or in a cluster spec). The child is SIGKILLed mid-stream, restarted with a new
incarnation, never started, or starved of file descriptors, and each case checks the
error the consumer gets, when it gets it, that no partial array is ever delivered, and
that nothing is left in /dev/shm once the dead child's namespace is collected.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, free_port, make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.naming import SHM_DIR, Names

pytestmark = pytest.mark.timeout(60)

# How far past its deadline a receive may return (the issue: "never more than ~0.5 s").
SLACK = 0.5
# 1 GiB, as the issue asks: allocated in the child without a copy, about 2 s to fill and
# 3 s to stream on 2 cores, so the kill lands mid-stream and the test stays under 30 s.
BIG = 1 << 30


def ours(ns: str) -> list[str]:
    """Names of ``ns``'s objects in /dev/shm (segments, records, semaphores)."""
    return sorted(e for e in os.listdir(SHM_DIR) if Names(ns).prefix in e)


class Receiver:
    """``rdv.recv(key, timeout)`` in a thread: its outcome and how long it took."""

    def __init__(self, rdv: Any, key: str, timeout: float) -> None:
        self.timeout = timeout
        self.value: np.ndarray[Any, Any] | None = None
        self.error: BaseException | None = None
        self.elapsed = -1.0
        self._thread = threading.Thread(target=self._run, args=(rdv, key), daemon=True)
        self._thread.start()

    def _run(self, rdv: Any, key: str) -> None:
        start = time.monotonic()
        try:
            self.value = rdv.recv(key, timeout=self.timeout).value
        except BaseException as e:
            self.error = e
        self.elapsed = time.monotonic() - start

    def join(self) -> None:
        self._thread.join(self.timeout + 30)
        assert not self._thread.is_alive(), f"recv still blocked {self.timeout + 30:g}s later"


# -- functions the child runs (importable by name) ------------------------------------------


def child_send_filled(worker: shmrdv.Worker, step: int, key: str, nbytes: int, fill: int) -> None:
    """Send ``nbytes`` of ``fill`` from an ``allocate``d buffer (no copy on send)."""
    rdv = worker.rendezvous(step)
    buf = rdv.allocate(key, (nbytes,), np.uint8)
    buf.fill(fill)
    rdv.send(key, buf)


def child_send(worker: shmrdv.Worker, step: int, key: str) -> None:
    worker.rendezvous(step).send(key, np.arange(10.0))


def child_starved(
    worker: shmrdv.Worker, action: str, step: int, key: str, spare: int
) -> dict[str, Any]:
    """Run ``action`` ("send", "recv", or "recv-waiting": a receive that waits, then sends
    ``parked`` to the consumer) with only ``spare`` descriptors free, then again (a plain
    receive for "recv-waiting") once they are all back. Returns what each attempt gave: "ok" or (error type, message)."""

    def attempt(starved: bool) -> Any:
        try:
            rdv = worker.rendezvous(step)
            if action == "send":
                rdv.send(key, np.arange(20_000.0))  # > 64 KiB: a segment (small ones need no fd)
            elif action == "recv-waiting" and starved:
                # Waiting first, then saying so (inline, on the warm route: no descriptor).
                waiting = rdv.recv_future(key, copy=True)
                rdv.send(make_key("parked"), np.zeros(1))
                waiting.result(timeout=30)
            else:
                rdv.recv(key, timeout=3.0, copy=True)
            return "ok"
        except BaseException as e:  # report anything, an OSError included
            return (type(e).__name__, str(e))

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 64, hard))
    hog: list[int] = []
    try:
        try:
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        for _ in range(min(spare, len(hog))):
            os.close(hog.pop())
        starved = attempt(True)
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"starved": starved, "after": attempt(False), "alive": True}


# -- a peer killed mid-stream ------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_peer_killed_mid_stream_is_unavailable_without_partial_array(ns: str) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer:
        producer = ChildWorker(PRODUCER, namespace=ns, transports=("grpc",))
        try:
            key = make_key("big")
            producer.call(child_send_filled, 1, key, BIG, 7)
            rdv = consumer.rendezvous(1)
            recv = Receiver(rdv, key, timeout=30.0)
            deadline = time.monotonic() + 10
            while not consumer.stats()["grpc"].get("fetching") and recv.elapsed < 0:
                assert time.monotonic() < deadline, "the stream never started"
                time.sleep(0.001)
            time.sleep(0.2)
            assert recv.elapsed < 0, "the 1 GiB stream finished before the kill"
            killed = time.monotonic()
            producer.kill()
        finally:
            producer.close()
        recv.join()
        noticed = time.monotonic() - killed
        assert recv.value is None, "a partial array was delivered"
        assert isinstance(recv.error, shmrdv.UnavailableError), repr(recv.error)
        assert producer.address is not None and producer.address in str(recv.error)
        assert noticed < 5.0, f"the kill was noticed only after {noticed:.1f}s"
        # The consumer goes on: a later receive of the key waits (and times out) cleanly.
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(key, timeout=0.3)
        # Only the dead child's presence record is left, for gc (the ns fixture collects it).
        assert all("_w" in name for name in ours(ns)), ours(ns)


# -- a peer restarted with a new incarnation -------------------------------------------------


@pytest.mark.slow
def test_restarted_peer_old_incarnation_is_aborted_naming_it(ns: str) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer:
        rdv = consumer.rendezvous(1)
        with ChildWorker(PRODUCER, namespace=ns, transports=("grpc",)) as first:
            old = make_key("k", incarnation=first.incarnation)
            first.call(child_send, 1, old)
            assert rdv.recv(old, timeout=10).value.tolist() == list(range(10))
            first.kill()
        with ChildWorker(PRODUCER, namespace=ns, transports=("grpc",)) as second:
            assert second.incarnation != first.incarnation
            start = time.monotonic()
            with pytest.raises(shmrdv.AbortedError) as info:
                rdv.recv(old, timeout=10)
            assert time.monotonic() - start < 2.0, "refused at once, not at the deadline"
            text = str(info.value)
            # TensorFlow's words (GrpcWorker::PrepareRecvTensor), naming the restarted task.
            assert "expects a different device incarnation" in text
            assert f'("{PRODUCER}") was probably restarted' in text
            assert f"{first.incarnation:016x}" in text and f"{second.incarnation:016x}" in text
            # Incarnation 0 is not checked; the new incarnation's own keys work too.
            for inc in (0, second.incarnation):
                key = make_key("k", incarnation=inc)
                second.call(child_send, 1, key)
                assert rdv.recv(key, timeout=10).value.tolist() == list(range(10))


# -- a producer that is not running ----------------------------------------------------------


@pytest.mark.parametrize("timeout", [0.3, 1.0, 2.5])
@pytest.mark.slow
def test_producer_never_started_fails_at_the_deadline(ns: str, timeout: float) -> None:
    # The cluster gives the producer an address where nothing listens: connection refused,
    # retried with backoff until the deadline.
    cluster = {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    with shmrdv.Worker(CONSUMER, cluster=cluster, namespace=ns, transports=("grpc",)) as consumer:
        recv = Receiver(consumer.rendezvous(1), make_key("x"), timeout)
        recv.join()
    assert isinstance(recv.error, (shmrdv.DeadlineExceededError, shmrdv.UnavailableError))
    assert recv.elapsed <= timeout + SLACK, f"{recv.elapsed:.3f}s for a {timeout}s deadline"
    if isinstance(recv.error, shmrdv.DeadlineExceededError):
        assert recv.elapsed >= timeout * 0.95


@pytest.mark.parametrize("where", ["loopback", "unroutable"])
def test_unreachable_producer_is_named_with_its_address_and_grpc_status(
    ns: str, where: str
) -> None:
    """Nothing listens at the producer's address: the timeout says which address and what
    gRPC answered; it used to say only that the task "is not alive anywhere on this host
    ... or it runs on another host" (issue 19 §4). ``unroutable``: an address of another
    host that answers nothing (TEST-NET-1, RFC 5737)."""
    address = f"127.0.0.1:{free_port()}" if where == "loopback" else "192.0.2.1:2222"
    cluster = {"worker": [address, f"127.0.0.1:{free_port()}"]}
    with shmrdv.Worker(CONSUMER, cluster=cluster, namespace=ns, transports=("grpc",)) as consumer:
        recv = Receiver(consumer.rendezvous(1), make_key("x"), 0.5)
        recv.join()
    assert isinstance(recv.error, shmrdv.DeadlineExceededError), recv.error
    text = str(recv.error)
    assert f"the gRPC server of {PRODUCER} at {address} does not answer" in text, text
    assert "UNAVAILABLE" in text or "DEADLINE_EXCEEDED" in text, text
    assert recv.elapsed <= 0.5 + SLACK, f"{recv.elapsed:.3f}s for a 0.5s deadline"


def test_unreachable_producer_is_named_in_the_stats_of_a_long_wait(ns: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    cluster = {"worker": [address, f"127.0.0.1:{free_port()}"]}
    with shmrdv.Worker(CONSUMER, cluster=cluster, namespace=ns, transports=("grpc",)) as consumer:
        recv = Receiver(consumer.rendezvous(1), make_key("x"), 10)
        deadline = time.monotonic() + 8
        while not consumer.stats()["waiting"]:  # listed after a second of waiting
            assert time.monotonic() < deadline
            time.sleep(0.05)
        [waiting] = consumer.stats()["waiting"]
        assert f"at {address} does not answer: UNAVAILABLE" in waiting["diagnosis"], waiting
        consumer.cleanup(1)
        recv.join()
    assert isinstance(recv.error, shmrdv.AbortedError)


def test_producer_not_started_is_awaited_until_the_deadline(ns: str) -> None:
    # No cluster spec and no presence record yet: the producer may still start (its record
    # will carry its address), so the receive waits for it — and no longer than asked.
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer:
        recv = Receiver(consumer.rendezvous(1), make_key("x"), 0.5)
        recv.join()
    assert isinstance(recv.error, shmrdv.DeadlineExceededError)
    assert recv.elapsed <= 0.5 + SLACK


def test_producer_started_after_the_recv_is_found(ns: str) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer:
        fut = consumer.rendezvous(1).recv_future(make_key("warm"))
        with ChildWorker(PRODUCER, namespace=ns, transports=("grpc",)) as producer:
            producer.call(child_send, 1, make_key("warm"))
            assert fut.result(timeout=20).value.size == 10
        consumer.cleanup(1)


@pytest.mark.parametrize("timeout", [0.5, 2.0])
@pytest.mark.slow
def test_producer_killed_before_recv_fails_at_the_deadline(ns: str, timeout: float) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer:
        rdv = consumer.rendezvous(1)
        with ChildWorker(PRODUCER, namespace=ns, transports=("grpc",)) as producer:
            producer.call(child_send, 1, make_key("warm"))
            assert rdv.recv(make_key("warm"), timeout=10).value.size == 10  # connected
            producer.kill()
        recv = Receiver(rdv, make_key("x"), timeout)
        recv.join()
    assert isinstance(recv.error, (shmrdv.DeadlineExceededError, shmrdv.UnavailableError))
    assert recv.elapsed <= timeout + SLACK, f"{recv.elapsed:.3f}s for a {timeout}s deadline"


# -- open files exhausted --------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.slow
def test_fd_exhaustion_send_is_resource_exhausted_and_recovers(ns: str, transport: str) -> None:
    tr = (transport,)
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, transports=tr) as consumer,
        ChildWorker(PRODUCER, namespace=ns, transports=tr) as producer,
    ):
        key = make_key("k")
        producer.call(child_send, 1, key)  # the route to the consumer is known
        out = producer.call(child_starved, "send", 1, key, 0)
        assert out["alive"]
        if transport == "shm":
            # A new segment needs a descriptor: refused, nothing half-sent.
            assert out["starved"][0] == "ResourceExhaustedError", out
            assert "open files" in out["starved"][1]
            expected = 2
        else:
            # Buffered in the producer's memory: no descriptor needed.
            assert out["starved"] == "ok", out
            expected = 3
        assert out["after"] == "ok", out
        rdv = consumer.rendezvous(1)
        for _ in range(expected):
            assert rdv.recv(key, timeout=10).value.size in (10, 20_000)
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(key, timeout=0.2)


@pytest.mark.slow
def test_fd_exhaustion_shm_recv_is_resource_exhausted_and_recovers(ns: str) -> None:
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        back = make_key("back", src=CONSUMER, dst=PRODUCER)
        rdv = consumer.rendezvous(1)
        rdv.send(back, np.arange(3.0))
        rdv.send(back, np.arange(4.0))
        producer.call(child_send, 1, make_key("warm"))  # the route is known
        rdv.recv(make_key("warm"), timeout=10)
        out = producer.call(child_starved, "recv", 1, back, 0)
        assert out["alive"]
        # Mapping the segment needs a descriptor: refused, and the message stays queued.
        assert out["starved"][0] == "ResourceExhaustedError", out
        assert out["after"] == "ok", out
        # ... so the second receive got the first value and the second is still there.
        assert producer.recv(back, timeout=10, step=1).value.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.slow
def test_fd_exhaustion_a_waiting_shm_recv_fails_and_the_value_stays(ns: str) -> None:
    # The value's segment arrives while the receive waits, with no descriptor to map it:
    # the waiting receive fails, and the value is the next receive's.
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        back = make_key("back", src=CONSUMER, dst=PRODUCER)
        rdv = consumer.rendezvous(1)
        producer.call(child_send, 1, make_key("warm"))  # the route is known
        rdv.recv(make_key("warm"), timeout=10)
        rdv.send(back, np.arange(2.0))  # the ring is attached (inline: no segment)
        assert producer.recv(back, timeout=10, step=1).value.tolist() == [0.0, 1.0]
        big = np.arange(20_000.0)  # > 64 KiB: a segment, never mapped by the child yet

        def send_once_waiting() -> None:
            rdv.recv(make_key("parked"), timeout=30)  # the child's receive waits
            rdv.send(back, big)

        sender = threading.Thread(target=send_once_waiting)
        sender.start()
        try:
            out = producer.call(child_starved, "recv-waiting", 1, back, 0)
        finally:
            sender.join(30)
        assert out["alive"]
        assert out["starved"][0] == "ResourceExhaustedError", out
        assert out["after"] == "ok", out  # it got the value the starved receive could not


@pytest.mark.slow
def test_fd_exhaustion_first_contact_is_resource_exhausted(ns: str) -> None:
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        key = make_key("k")
        out = producer.call(child_starved, "send", 1, key, 0)
        assert out["alive"] and out["after"] == "ok", out
        assert out["starved"][0] == "ResourceExhaustedError", out
        consumer.rendezvous(1).recv(key, timeout=10)


def _grpc_recv_starved(ns: str) -> dict[str, Any]:
    """The producer child receives over a channel it never opened, with no descriptor free."""
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer,
        ChildWorker(PRODUCER, namespace=ns, transports=("grpc",)) as producer,
    ):
        producer.call(child_send, 1, make_key("warm"))  # the route is known, no channel yet
        consumer.rendezvous(1).recv(make_key("warm"), timeout=10)
        back = make_key("back", src=CONSUMER, dst=PRODUCER)
        consumer.rendezvous(1).send(back, np.arange(3.0))
        consumer.rendezvous(1).send(back, np.arange(4.0))
        out: dict[str, Any] = producer.call(child_starved, "recv", 1, back, 0)
        return out


@pytest.mark.slow
def test_fd_exhaustion_grpc_new_channel_is_resource_exhausted(ns: str) -> None:
    out = _grpc_recv_starved(ns)
    assert out["alive"]
    assert out["starved"][0] == "ResourceExhaustedError", out


@pytest.mark.slow
def test_fd_exhaustion_grpc_recv_recovers_once_fds_are_back(ns: str) -> None:
    out = _grpc_recv_starved(ns)
    assert out["alive"]
    assert out["after"] == "ok", out
