"""The shared-memory producer's view of what a consumer took: real segments, a real ring in
shared memory, a real consumer process for liveness."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import CONSUMER, PRODUCER

import shmrdv
from shmrdv._cluster import Peers
from shmrdv._errors import ResourceExhaustedError
from shmrdv._keys import DeviceName
from shmrdv._procs import ChildWorker
from shmrdv._shm.files import Segment
from shmrdv._shm.naming import Names
from shmrdv._shm.producer import LSTATS_PER_REFRESH, Inflight
from shmrdv._shm.ring import Ring, ring_size
from shmrdv._shm.transport import ShmBoard

DST = DeviceName.parse(CONSUMER + "/device:CPU:0")


@pytest.fixture
def names(ns: str) -> Iterator[Names]:
    # A live worker in the namespace: no Worker's sweep (of this or another process) takes
    # the namespace for a dead one and collects the segments the tests publish by hand.
    with shmrdv.Worker(PRODUCER, namespace=ns, transports=("shm",)):
        yield Names(ns)


@pytest.fixture
def peers(ns: str) -> Iterator[Peers]:
    p = Peers(ShmBoard(ns), None)
    yield p
    p.close()


def _publish(names: Names, seq: int, size: int = 64) -> Segment:
    name = names.message(0, "k", 7, seq)
    seg = Segment.create(names, size, name=name)
    seg.close()
    return seg


def test_inflight_segment_counts_until_its_name_is_gone(names: Names, peers: Peers) -> None:
    flight = Inflight(100, peers).of(DST)
    segs = []
    for seq in range(2):
        ticket = flight.reserve(50, None, "m")
        seg = _publish(names, seq)
        ticket.segment(seg.name)
        segs.append(seg)
    with pytest.raises(ResourceExhaustedError, match=r"task:1.*max_inflight_bytes=100"):
        flight.reserve(50, 0.05, "m")
    assert flight.window.used == 100

    def consume() -> None:
        time.sleep(0.1)
        taken = names.path(names.temp())
        os.rename(segs[1].path, taken)  # a consumer takes a message by renaming it away
        os.unlink(taken)

    t = threading.Thread(target=consume)
    t.start()
    t0 = time.monotonic()
    flight.reserve(50, 5, "m")
    t.join(5)
    assert 0.05 < time.monotonic() - t0 < 4
    assert flight.window.used == 100  # one in flight, one reserved
    segs[0].unlink()
    flight.refresh()
    assert flight.window.used == 50  # the reserved one


def test_inflight_refresh_looks_at_a_bounded_number_of_names(names: Names, peers: Peers) -> None:
    n = LSTATS_PER_REFRESH + 8
    flight = Inflight(10 * n, peers).of(DST)
    segs = []
    for seq in range(n):
        ticket = flight.reserve(10, None, "m")
        segs.append(_publish(names, seq))
        ticket.segment(segs[-1].name)
    for seg in segs:
        seg.unlink()
    flight.refresh()
    assert flight.window.used == 80  # the first refresh looked at LSTATS_PER_REFRESH only
    flight.refresh()
    assert flight.window.used == 0


def test_inflight_ring_record_counts_until_the_consumer_passes_it(
    names: Names, peers: Peers
) -> None:
    capacity = 4096
    seg = Segment.create(names, ring_size(capacity))
    try:
        producer = Ring.format(memoryview(seg.buf), capacity)
        flight = Inflight(300, peers).of(DST)
        for i in range(3):
            ticket = flight.reserve(100, None, "m")
            at = producer.reserve(100)
            producer.buf[at : at + 100] = bytes([i]) * 100
            ticket.record(producer, producer.commit())
        with pytest.raises(ResourceExhaustedError):
            flight.reserve(100, 0.05, "m")
        other = Segment.attach(names, seg.name)  # the consumer's own mapping
        consumer = Ring(memoryview(other.buf))
        taken = consumer.take()
        assert bytes(next(taken))[:1] == b"\x00"
        assert bytes(next(taken))[:1] == b"\x01"  # the first record is passed now
        flight.reserve(100, 1, "m")
        assert flight.window.used == 300
        for _ in taken:
            pass
        flight.refresh()
        assert flight.window.used == 100  # the one reserved last
        consumer.release()
        other.close()
        producer.release()
    finally:
        seg.unlink()
        seg.close()


def test_inflight_dead_consumer_frees_its_window(ns: str, names: Names, peers: Peers) -> None:
    with ChildWorker(CONSUMER, namespace=ns) as consumer:
        flight = Inflight(100, peers).of(DST)  # sees the consumer alive
        ticket = flight.reserve(100, None, "m")
        seg = _publish(names, 0)
        ticket.segment(seg.name)
        with pytest.raises(ResourceExhaustedError):
            flight.reserve(1, 0.1, "m")
        consumer.kill()
        t0 = time.monotonic()
        flight.reserve(60, 5, "m")
        assert time.monotonic() - t0 < 4
        assert flight.window.used == 60
        seg.unlink()


def test_inflight_one_flight_per_consumer_task(peers: Peers) -> None:
    inflight = Inflight(10, peers)
    a = inflight.of(DST)
    assert inflight.of(DeviceName.parse(CONSUMER + "/device:GPU:0")) is a
    b = inflight.of(DeviceName.parse("/job:worker/replica:0/task:2"))
    a.reserve(10, None, "m")
    b.reserve(4, None, "m")
    assert inflight.windows.used() == 14
    with pytest.raises(ResourceExhaustedError, match="task:2"):
        b.reserve(7, 0, "m")
    assert inflight.windows.waits() == 1
    inflight.close(RuntimeError("closed"))
    assert inflight.windows.used() == 0
    with pytest.raises(RuntimeError, match="closed"):
        a.reserve(1, None, "m")
    with pytest.raises(RuntimeError, match="closed"):  # a flight made after closing too
        inflight.of(DeviceName.parse("/job:worker/replica:0/task:3")).reserve(1, None, "m")
    assert inflight.windows.used() == 0


def test_inflight_ticket_cancel_gives_back_once_and_only_before_publish(
    names: Names, peers: Peers
) -> None:
    flight = Inflight(100, peers).of(DST)
    failed = flight.reserve(70, None, "m")
    failed.cancel()  # the send failed before publishing: its bytes come back
    failed.cancel()
    assert flight.window.used == 0
    sent = flight.reserve(70, None, "m")
    seg = _publish(names, 0)
    sent.segment(seg.name)
    sent.cancel()  # an error after publishing: the message is in flight all the same
    assert flight.window.used == 70
    seg.unlink()
    flight.refresh()
    assert flight.window.used == 0


def test_inflight_for_key_is_the_consumer_tasks_flight(peers: Peers) -> None:
    from shmrdv._keys import parse_key
    from tests.helpers import make_key

    inflight = Inflight(10, peers)
    flight = inflight.for_key(parse_key(make_key("a")))
    assert inflight.for_key(parse_key(make_key("b"))) is flight
    assert inflight.of(DST) is flight


def test_inflight_another_file_at_the_name_is_not_the_message(names: Names, peers: Peers) -> None:
    # The consumer took the message; a file re-created at its name (another user's, or any
    # other inode) does not keep it in flight (issue 20 §3).
    flight = Inflight(100, peers).of(DST)
    ticket = flight.reserve(100, None, "m")
    seg = _publish(names, 0)
    ticket.segment(seg.name)
    assert flight.window.used == 100
    seg.unlink()
    fd = os.open(seg.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        flight.reserve(100, 1, "m").cancel()
        assert flight.window.used == 0
    finally:
        os.unlink(seg.path)
