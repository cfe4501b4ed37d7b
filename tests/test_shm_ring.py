"""The small-message ring: pure tests on a buffer, then through real processes."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key
from hypothesis import given, settings
from hypothesis import strategies as st

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.ring import _BATCH_BYTES, DATA_OFFSET, Ring, ring_size


def make_ring(capacity: int = 4096) -> Ring:
    return Ring.format(memoryview(bytearray(ring_size(capacity))), capacity, b'{"x": 1}')


def put(ring: Ring, payload: bytes) -> bool:
    """Append one record as the producer does (reserve, write, commit); False if no room."""
    at = ring.reserve(len(payload))
    if at < 0:
        return False
    ring.buf[at : at + len(payload)] = payload
    ring.commit()
    return True


def test_ring_put_take_in_order_with_meta() -> None:
    ring = make_ring()
    assert ring.meta() == b'{"x": 1}' and not ring.pending()
    for i in range(5):
        assert put(ring, bytes([i]) * (i + 1))
    assert ring.pending()
    got = [bytes(p) for p in ring.take()]
    assert [g[: i + 1] for i, g in enumerate(got)] == [bytes([i]) * (i + 1) for i in range(5)]
    assert not ring.pending()


def test_ring_full_refuses_without_writing_and_wraps() -> None:
    ring = make_ring(1024)
    record = b"x" * 200
    n = 0
    while put(ring, record):
        n += 1
    assert n == 4  # 4 x 208 bytes fit in 1024, a fifth does not
    assert len(list(ring.take())) == 4
    for _ in range(10):  # wraps around the end many times, always in order
        assert put(ring, b"a" * 200) and put(ring, b"b" * 200)
        assert [bytes(p)[:1] for p in ring.take()] == [b"a", b"b"]


def test_ring_record_too_big_is_refused() -> None:
    ring = make_ring(1024)
    assert not put(ring, b"x" * 1024)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=40), st.integers(1, 5))
def test_ring_interleaved_put_take_keeps_fifo(sizes: list[int], batch: int) -> None:
    ring = make_ring(2048)
    sent: list[bytes] = []
    taken: list[bytes] = []
    for i, n in enumerate(sizes):
        rec = (i % 251).to_bytes(1, "little") * n
        if put(ring, rec):
            sent.append(rec)
        if i % batch == 0:
            taken += [bytes(p)[: len(sent[len(taken) + j])] for j, p in enumerate(ring.take())]
    taken += [bytes(p)[: len(sent[len(taken) + j])] for j, p in enumerate(ring.take())]
    assert taken == sent


def test_ring_spans_come_in_batches_taken_only_at_consume() -> None:
    ring = make_ring(1 << 20)
    sent = [i.to_bytes(4, "little") * 50 for i in range(1000)]  # 208 KB of 208 B records
    for rec in sent:
        assert put(ring, rec)
    buf, taken, batches = ring.buf, [], 0
    while True:
        tail = ring.tail
        spans = ring.spans()
        assert spans and ring.tail == tail  # nothing taken before ``consume``
        assert sum(end - at + 4 for at, end in spans) <= _BATCH_BYTES + 208
        taken += [bytes(buf[at:end])[:200] for at, end in spans]
        batches += 1
        if not ring.consume():
            break
    assert taken == sent and batches * _BATCH_BYTES >= 208_000 > (batches - 1) * _BATCH_BYTES
    assert not ring.pending() and ring.spans() == []


@pytest.mark.parametrize("before", [0, 1, 3])
def test_ring_consume_before_a_record_leaves_it_and_what_follows(before: int) -> None:
    ring = make_ring(1024)
    for _ in range(3):  # the records below wrap around the end
        assert put(ring, b"w" * 200)
    assert len(list(ring.take())) == 3
    for i in range(4):
        assert put(ring, bytes([i]) * 200)
    spans = ring.spans()
    assert len(spans) == 4
    assert not ring.consume(spans[before][0])
    assert [bytes(p)[:1] for p in ring.take()] == [bytes([i]) for i in range(before, 4)]


def test_ring_a_new_reader_reads_exactly_the_records_not_taken() -> None:
    buf = memoryview(bytearray(ring_size(4096)))
    producer = Ring.format(buf, 4096)
    for name in b"abcd":
        assert put(producer, bytes([name]) * 8)
    ring = Ring(buf)
    ring.attach(7)
    assert producer.reader_word()[0] == 7
    (a, _), (b, _), (c, _), (d, _) = ring.spans()
    at_a = ring.hold(a)  # queued
    ring.mark_taken(ring.position(b))  # handed to a receive at once, while "a" is held
    at_c, at_d = ring.hold(c), ring.hold(d)
    ring.consume()
    assert ring.tail == at_a and not ring.spans()  # the producer keeps off "a" and after
    ring.taken(at_c)  # taken before "a": marked
    # The consumer dies here: its next process reads what it had not taken, once.
    again = Ring(buf)
    again.attach(8)
    assert producer.reader_word()[0] == 8
    assert [bytes(buf[s : s + 1]) for s, _ in again.spans()] == [b"a", b"d"]
    again.release()
    # Taken in any order, they let ``tail`` pass every record.
    ring.taken(at_a)
    assert ring.tail == at_d and ring.pending()
    ring.taken(at_d)
    assert not ring.pending()


def test_ring_corruption_is_an_error_not_a_crash() -> None:
    buf = memoryview(bytearray(ring_size(1024)))
    ring = Ring.format(buf, 1024)
    put(ring, b"hello")
    buf[DATA_OFFSET : DATA_OFFSET + 4] = (999999).to_bytes(4, "little")
    with pytest.raises(shmrdv.InternalError, match="corrupted"):
        list(ring.take())
    with pytest.raises(shmrdv.InternalError, match="not a shmrdv ring"):
        Ring(memoryview(bytearray(ring_size(1024))))


def _hammer(buf: memoryview, count: int) -> None:
    """Producer side of the two-process test: ``count`` records, each carrying its index."""
    ring = Ring(buf)
    i = 0
    while i < count:
        rec = i.to_bytes(8, "little") * (1 + i % 7)
        if put(ring, rec):
            i += 1


@pytest.mark.timeout(60)
def test_ring_across_processes_never_reads_a_torn_word() -> None:
    """A producer process appends while this one takes, for real, over one shared mapping.

    The shared words must be read and written in one access each: ``struct.pack_into``
    zeroes its target before writing it, and the consumer then saw ``head`` 0 (the soak
    test's "ring corrupted: head 0"). Thousands of wraps of a small ring in ~1 s.
    """
    import mmap

    if not hasattr(os, "fork"):
        pytest.skip("needs fork to share an anonymous mapping")
    capacity, count = 4096, 200_000
    mem = mmap.mmap(-1, ring_size(capacity))
    ring = Ring.format(memoryview(mem), capacity)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            _hammer(memoryview(mem), count)
            code = 0
        finally:
            os._exit(code)
    got = 0
    try:
        while got < count:
            for payload in ring.take():
                n = 1 + got % 7
                assert bytes(payload[: 8 * n]) == got.to_bytes(8, "little") * n, got
                got += 1
    finally:
        if got < count:  # we failed: the child would wait for room forever
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    ring.release()


@pytest.mark.parametrize(
    ("env", "expected"), [(None, 65536), ("0", 0), ("1024", 1024), ("1000000", 65536), ("x", 65536)]
)
def test_the_ring_is_on_by_default_and_bounded(
    env: str | None, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shmrdv._shm.producer import inline_max as _inline_max

    if env is None:
        monkeypatch.delenv("SHMRDV_INLINE_MAX", raising=False)
    else:
        monkeypatch.setenv("SHMRDV_INLINE_MAX", env)
    assert _inline_max() == expected


@pytest.fixture
def ns(shmrdv_namespace: str, monkeypatch: pytest.MonkeyPatch) -> str:
    # Not conftest's ``ns``: this one turns the ring on, and collects nothing afterwards, so
    # that the leak check still sees whatever a ring test leaves behind. The ring is on by
    # default; say so anyway, in case the environment turned it off (children inherit the
    # variable at spawn).
    monkeypatch.setenv("SHMRDV_INLINE_MAX", "65536")
    return shmrdv_namespace


def test_ring_small_and_large_interleave_in_fifo_order(ns: str) -> None:
    """Small tensors go inline, large ones through segments, a full ring falls back to
    segments: one key's channel stays FIFO across all three."""
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        k = make_key("mixed")
        sizes = [10, 100_000, 10, 20_000, 3, 300_000, *([8000] * 300), 5]
        for i, n in enumerate(sizes):
            producer.send(k, np.full(n, i % 256, dtype=np.uint8), step=1)
        rdv = consumer.rendezvous(1)
        for i, n in enumerate(sizes):
            got = rdv.recv(k, timeout=10).value
            assert got.shape == (n,) and (got == i % 256).all(), i
        st_ = consumer.stats()["shm"]
        assert st_["received"] == len(sizes)
        consumer.cleanup(1)


def test_ring_messages_survive_producer_sigkill(ns: str) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        producer = ChildWorker(PRODUCER, namespace=ns)
        for i in range(5):
            producer.send(make_key("k"), np.full(100, i, dtype=np.int32), step=1)
        producer.kill(signal.SIGKILL)
        rdv = consumer.rendezvous(1)
        assert [int(rdv.recv(make_key("k"), timeout=10).value[0]) for _ in range(5)] == list(
            range(5)
        )
        consumer.cleanup(1)
    shmrdv_gc(ns)


def test_ring_messages_survive_producer_close_before_consumer_starts(ns: str) -> None:
    """The consumer never saw the producer: it finds the ring by listing, meta says whose."""
    with ChildWorker(PRODUCER, namespace=ns) as producer:
        for i in range(3):
            producer.send(make_key("late"), np.full(7, i, dtype=np.float32), step=2)
    rings = [
        e for e in os.listdir("/dev/shm") if e.startswith(f"shmrdv_{shmrdv.namespace_id(ns)}_q")
    ]
    assert len(rings) == 1
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        rdv = consumer.rendezvous(2)
        assert [float(rdv.recv(make_key("late"), timeout=10).value[0]) for _ in range(3)] == [
            0.0,
            1.0,
            2.0,
        ]
        consumer.cleanup(2)
    assert not [
        e for e in os.listdir("/dev/shm") if e.startswith(f"shmrdv_{shmrdv.namespace_id(ns)}_q")
    ]


def test_ring_meta_names_its_ends(ns: str) -> None:
    with ChildWorker(PRODUCER, namespace=ns) as producer:
        producer.send(make_key("m"), np.zeros(3), step=3)
        (ring_name,) = [
            e for e in os.listdir("/dev/shm") if e.startswith(f"shmrdv_{shmrdv.namespace_id(ns)}_q")
        ]
        from shmrdv._shm.files import Segment
        from shmrdv._shm.naming import Names

        seg = Segment.attach(Names(ns), ring_name)
        ring = Ring(memoryview(seg.buf))
        meta = json.loads(ring.meta())
        ring.release()
        seg.close()
        assert meta == {
            "producer": PRODUCER,
            "incarnation": producer.incarnation,
            "consumer": CONSUMER,
        }
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        consumer.rendezvous(3).recv(make_key("m"), timeout=10)
        consumer.cleanup(3)


def shmrdv_gc(ns: str) -> None:
    from shmrdv._shm.reaper import collect

    collect(ns)


def test_ring_records_are_counted_across_dtype_changes_and_table_resets() -> None:
    """``stats()`` ``sent`` and ``sent_bytes`` count every message: ring records are counted
    per key (by its ``_KeyOut``), and the counts stay when a key's dtype changes or the
    table of keys is reset (4,096 keys)."""
    from shm_harness import Endpoint, key_between

    ns = shmrdv.new_namespace()
    with Endpoint(ns, PRODUCER) as prod, Endpoint(ns, CONSUMER) as cons:
        k = key_between(PRODUCER, CONSUMER, "counted")
        values = [
            np.arange(4, dtype=np.float32),
            np.arange(4, dtype=np.float32),
            np.arange(3, dtype=np.int64),  # another dtype: another template
            np.zeros((2, 2), np.uint8),
            np.arange(4, dtype=np.float32),  # the first again
        ]
        for v in values:
            prod.send(1, k, v)
        for v in values:
            assert cons.recv(1, k).value.tolist() == v.tolist()
        many = [key_between(PRODUCER, CONSUMER, f"many{i}") for i in range(4100)]
        for i, key in enumerate(many):  # past the table's 4,096 keys: it is reset once
            prod.send(1, key, np.array([i], dtype=np.int16))
            assert cons.recv(1, key).value.tolist() == [i]
        stats = prod.transport.stats()
        assert stats["sent"] == len(values) + len(many)
        assert stats["sent_bytes"] == sum(v.nbytes for v in values) + 2 * len(many)
        assert cons.transport.stats()["received"] == stats["sent"]
