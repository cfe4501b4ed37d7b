"""The same-host transport end to end, between real processes (issue 3 §1-§4).

The consumer is usually a ``shmrdv.Worker`` in this process and the producer a Worker in a
spawned child (``ChildWorker``); functions the child runs (``ChildWorker.call``) are
top-level here so that the child can import them. Every value crosses a real segment in
/dev/shm, every wake-up a real semaphore. The autouse leak check proves that nothing is
left in /dev/shm and no child process survives a test.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import logging
import os
import shutil
import stat
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import posix_ipc
import pytest
from helpers import CONSUMER, PRODUCER, make_key, wait_for
from small_shm import run_with_small_dev_shm

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.naming import SHM_DIR, Names

_steps = itertools.count(1)


def ns_entries(ns: str) -> list[str]:
    """Entries of /dev/shm that belong to namespace ``ns`` (semaphores included)."""
    prefix = Names(ns).prefix
    return sorted(
        e for e in os.listdir(SHM_DIR) if e.startswith(prefix) or e.startswith("sem." + prefix)
    )


def kinds(ns: str) -> list[str]:
    """The kind letters of ``ns``'s objects (``b`` for the doorbell semaphores)."""
    prefix = Names(ns).prefix
    return sorted(e.split(prefix, 1)[1][0] for e in ns_entries(ns))


# -- functions the child runs (ChildWorker.call: fn(worker, *args)) -------------------------


def child_stats(worker: shmrdv.Worker) -> dict[str, Any]:
    return worker.stats()


def child_send_large(worker: shmrdv.Worker, step: int, key: str, nbytes: int) -> None:
    value = np.zeros(nbytes, dtype=np.uint8)  # calloc'ed: reading it costs no page faults
    value[0], value[2**31 - 1], value[2**31], value[-1] = 11, 22, 33, 44
    worker.rendezvous(step).send(key, value)


def child_send_many(worker: shmrdv.Worker, step: int, keys: list[str]) -> int:
    rdv = worker.rendezvous(step)
    for i, key in enumerate(keys):
        rdv.send(key, np.full(4, i, dtype=np.int64))
    return len(keys)


def child_idle_recv_cpu(worker: shmrdv.Worker, key: str, wait_s: float) -> tuple[float, float, str]:
    """Block in recv for ``wait_s`` seconds (it times out); return (CPU s, wall s, error type)."""
    rdv = worker.rendezvous(1)
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        rdv.recv(key, timeout=wait_s)
    except shmrdv.DeadlineExceededError as e:
        err = type(e).__name__
    else:
        err = "none"
    return time.process_time() - cpu0, time.monotonic() - wall0, err


def child_stream(worker: shmrdv.Worker, n: int, nbytes: int) -> int:
    """Send ``n`` arrays of ``nbytes`` on one key as fast as the window allows."""
    rdv = worker.rendezvous(1)
    src = np.zeros(nbytes // 4, np.float32)
    for j in range(n):
        src[0] = j
        rdv.send(make_key("stream"), src, timeout=60)
    return n


def child_pingpong_pinned(worker: shmrdv.Worker, n: int) -> int:
    """Pinned to one CPU, answer ``n`` pings; return the time its receives spent spinning."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    rdv = worker.rendezvous(1)
    for i in range(n):
        got = rdv.recv(make_key(f"ping{i}", src=PRODUCER, dst=CONSUMER), timeout=20).value
        rdv.send(make_key(f"pong{i}", src=CONSUMER, dst=PRODUCER), got)
    return int(worker.stats()["shm"]["spin_us"])


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[ChildWorker, shmrdv.Worker]]:
    """A producer in a spawned child and a consumer here, in one namespace, for the module."""
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        yield producer, consumer


@pytest.fixture
def step(pair: tuple[ChildWorker, shmrdv.Worker]) -> Iterator[int]:
    """A fresh step of ``pair``, cleaned up on both sides afterwards."""
    producer, consumer = pair
    s = next(_steps)
    yield s
    consumer.cleanup(s)
    producer.cleanup(s)


def writeable(arr: npt.NDArray[Any]) -> bool:
    return bool(arr.flags.writeable)


def shm_stats(worker: shmrdv.Worker) -> dict[str, int]:
    stats: dict[str, int] = worker.stats()["shm"]
    return stats


def wait_held_zero(worker: shmrdv.Worker, within: float = 2.0) -> None:
    """Wait until ``worker`` holds no pool slot (the dispatcher thread may still be
    returning from the ``done`` that woke us, holding the value for a moment)."""
    wait_for(lambda: shm_stats(worker)["held"] == 0, within, "no pool slot held")


# -- §1 routing -----------------------------------------------------------------------------


def test_routing_same_worker_stays_in_process() -> None:
    ns = shmrdv.new_namespace()
    with shmrdv.Worker(PRODUCER, namespace=ns) as w:
        rdv = w.rendezvous(1)
        key = make_key("self", dst=PRODUCER)
        value = np.arange(1000, dtype=np.float32)
        rdv.send(key, value)
        got = rdv.recv(key, timeout=5)
        np.testing.assert_array_equal(got.value, value)
        st = shm_stats(w)
        assert st["sent"] == st["received"] == 0
        assert st["pool_created"] == 0
        assert w.stats()["local"]["received"] == 1
        # Only the worker's own presence record and doorbell: no segment was created.
        assert kinds(ns) == ["b", "w"]


def test_routing_other_process_goes_through_shm(
    pair: tuple[ChildWorker, shmrdv.Worker], step: int
) -> None:
    producer, consumer = pair
    before_c, before_p = shm_stats(consumer), producer.call(child_stats)["shm"]
    value = np.arange(12, dtype=np.int16).reshape(3, 4)
    producer.send(make_key("routed"), value, step=step)
    got = consumer.rendezvous(step).recv(make_key("routed"), timeout=10)
    np.testing.assert_array_equal(got.value, value)
    assert shm_stats(consumer)["received"] == before_c["received"] + 1
    assert producer.call(child_stats)["shm"]["sent"] == before_p["sent"] + 1
    assert consumer.stats()["local"].get("received", 0) == 0


def test_routing_grpc_only_turns_shm_off() -> None:
    if importlib.util.find_spec("shmrdv._rpc.transport") is None:
        pytest.skip("the gRPC transport (shmrdv/_rpc/transport.py) does not exist yet")
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer,
        ChildWorker(PRODUCER, namespace=ns, transports=("grpc",)) as producer,
    ):
        assert "shm" not in consumer.stats()
        value = np.arange(10, dtype=np.float64)
        producer.send(make_key("grpc"), value, step=1)
        got = consumer.rendezvous(1).recv(make_key("grpc"), timeout=20)
        np.testing.assert_array_equal(got.value, value)
        assert "shm" not in producer.call(child_stats)
        assert not [k for k in kinds(ns) if k in "mtphr"]
        consumer.cleanup(1)


# -- §2 segments ----------------------------------------------------------------------------


def test_segment_names_carry_namespace_and_are_0600(
    pair: tuple[ChildWorker, shmrdv.Worker], step: int
) -> None:
    producer, consumer = pair
    ns = consumer.namespace
    key = make_key("named")
    # Above the ring's limit (64 KiB), so that the tensor gets a segment of its own; a
    # small one goes inline through the producer's ring, also a 0600 file of the namespace.
    producer.send(make_key("small"), np.ones(100, dtype=np.uint8), step=step)
    producer.send(key, np.ones(100_000, dtype=np.uint8), step=step)
    message = Names(ns).message(step, key, producer.incarnation, 0)
    assert message in ns_entries(ns)
    assert message.startswith(Names(ns).prefix + "m")
    for entry in ns_entries(ns):
        st = os.stat(os.path.join(SHM_DIR, entry), follow_symlinks=False)
        assert stat.S_ISREG(st.st_mode), entry
        assert stat.S_IMODE(st.st_mode) == 0o600, (entry, oct(st.st_mode))
        assert st.st_uid == os.geteuid()
    got = consumer.rendezvous(step).recv(key, timeout=10)
    assert got.value.sum() == 100_000
    assert message not in ns_entries(ns)  # taken: the name is gone (held or unlinked)
    assert consumer.rendezvous(step).recv(make_key("small"), timeout=10).value.sum() == 100


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_segment_larger_than_2gib_end_to_end(
    pair: tuple[ChildWorker, shmrdv.Worker], step: int
) -> None:
    free = shutil.disk_usage(SHM_DIR).free
    if free < 5 * 2**30:
        pytest.skip(f"{SHM_DIR} has only {free} bytes free; the test needs 5 GiB")
    producer, consumer = pair
    nbytes = 2**31 + 8
    key = make_key("huge")
    producer.call(child_send_large, step, key, nbytes, timeout=100)
    got = consumer.rendezvous(step).recv(key, timeout=30)
    arr = got.value
    assert arr.dtype == np.uint8 and arr.shape == (nbytes,)
    assert (arr[0], arr[2**31 - 1], arr[2**31], arr[-1]) == (11, 22, 33, 44)
    assert arr[1] == 0 and arr[2**31 + 1] == 0 and arr[nbytes // 2] == 0
    del got, arr


_ENOSPC_CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import shmrdv

    def segments():
        return sorted(e for e in os.listdir("/dev/shm") if e.split("_")[-1][:1] in "mtphr")

    ns = shmrdv.new_namespace()
    key = shmrdv.create_key("/job:w/replica:0/task:0/cpu:0", 0, "/job:w/replica:0/task:1/cpu:0", "big")
    with shmrdv.Worker("/job:w/task:1", namespace=ns) as consumer, \\
            shmrdv.Worker("/job:w/task:0", namespace=ns) as producer:
        prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
        for attempt in range(2):  # the pool path, then again (the pool must not be stuck)
            try:
                prdv.send(key, np.ones(16 << 20, dtype=np.uint8))
            except shmrdv.ResourceExhaustedError as e:
                msg = str(e)
                assert "bytes" in msg and "free" in msg, msg
            else:
                sys.exit("no ResourceExhaustedError")
            assert segments() == [], segments()
        small = np.arange(1 << 20, dtype=np.uint8)
        prdv.send(key, small)  # the worker is still usable
        got = crdv.recv(key, timeout=10)
        assert np.array_equal(got.value, small)
        del got
        stats = producer.stats()["shm"]
        assert stats["sent"] == 1, stats
        consumer.cleanup(1)
        producer.cleanup(1)
    left = os.listdir("/dev/shm")
    assert left == [], left
    print("child ok")
    """
)


@pytest.mark.root
@pytest.mark.timeout(60)
def test_segment_full_dev_shm_is_resource_exhausted() -> None:
    run_with_small_dev_shm(_ENOSPC_CHILD)


def test_pool_recycles_slots(pair: tuple[ChildWorker, shmrdv.Worker], step: int) -> None:
    producer, consumer = pair
    rdv = consumer.rendezvous(step)
    before = producer.call(child_stats)["shm"]
    key = make_key("pooled")
    for i in range(200):
        producer.send(key, np.full(1 << 20, i % 251, dtype=np.uint8), step=step)
        got = rdv.recv(key, timeout=10)
        assert got.value[0] == got.value[-1] == i % 251
        del got  # gives the slot back
    after = producer.call(child_stats)["shm"]
    assert after["pool_created"] - before["pool_created"] <= 2, after
    assert after["pool_reused"] - before["pool_reused"] >= 198, after
    assert after["pool_lost"] == before["pool_lost"]


# -- §3 zero copy ---------------------------------------------------------------------------


def test_zero_copy_received_array_is_writable_and_the_consumers_own(
    pair: tuple[ChildWorker, shmrdv.Worker], step: int
) -> None:
    producer, consumer = pair
    rdv = consumer.rendezvous(step)
    key = make_key("owned")
    producer.send(key, np.ones(1 << 16, dtype=np.int32), step=step)
    first = rdv.recv(key, timeout=10).value
    assert first.flags.writeable
    assert not first.flags.owndata  # a view over the mapped segment: no copy was made
    first[:] = 7
    # While the consumer holds it, the producer never writes into that memory again.
    seen: list[npt.NDArray[Any]] = []
    for i in range(5):
        producer.send(key, np.full(1 << 16, 100 + i, dtype=np.int32), step=step)
        got = rdv.recv(key, timeout=10).value
        assert (got == 100 + i).all()
        assert not any(np.shares_memory(got, other) for other in [first, *seen])
        seen.append(got)
        assert (first == 7).all()
    del seen, got
    # Once released, the slot is reused and carries the new value, not the consumer's writes.
    reused = producer.call(child_stats)["shm"]["pool_reused"]
    del first
    producer.send(key, np.full(1 << 16, 3, dtype=np.int32), step=step)
    assert (rdv.recv(key, timeout=10).value == 3).all()
    assert producer.call(child_stats)["shm"]["pool_reused"] > reused
    wait_held_zero(consumer)


def test_zero_copy_recv_copy_returns_private_copy(
    pair: tuple[ChildWorker, shmrdv.Worker], step: int
) -> None:
    producer, consumer = pair
    key = make_key("copied")
    value = np.arange(5000, dtype=np.float64)
    producer.send(key, value, step=step)
    got = consumer.rendezvous(step).recv(key, timeout=10, copy=True)
    np.testing.assert_array_equal(got.value, value)
    assert got.value.flags.owndata and got.value.flags.writeable
    # The segment went back at once: nothing is held or left under a ``held`` name.
    wait_held_zero(consumer)
    assert "h" not in kinds(consumer.namespace)


def test_zero_copy_allocate_send_publishes_without_copy() -> None:
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns) as producer,
    ):
        prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
        key, other = make_key("alloc"), make_key("other")
        buf = prdv.allocate(key, (256, 256), np.float32)
        assert writeable(buf)
        buf[:] = 2.5
        prdv.send(key, buf)
        assert shm_stats(producer)["sent_zero_copy"] == 1
        assert not writeable(buf)  # the consumer's memory now
        with pytest.raises(ValueError):
            buf[0, 0] = 1.0
        with pytest.raises(shmrdv.InvalidArgumentError, match="already sent"):
            prdv.send(key, buf)
        got = crdv.recv(key, timeout=5).value
        assert got.shape == (256, 256) and (got == 2.5).all()
        assert not np.shares_memory(got, buf)  # another mapping: only the consumer writes it
        got[:] = 9.0
        assert got.flags.writeable
        buf2 = prdv.allocate(key, 8, np.int8)
        with pytest.raises(shmrdv.InvalidArgumentError, match="allocated for key"):
            prdv.send(other, buf2)
        assert shm_stats(producer)["sent_zero_copy"] == 1
        del buf2
        # A plain ndarray copies once and is not frozen.
        plain = np.zeros(10)
        prdv.send(key, plain)
        assert plain.flags.writeable
        assert shm_stats(producer)["sent_zero_copy"] == 1
        assert crdv.recv(key, timeout=5).value.sum() == 0
        del got, buf
        consumer.cleanup(1)
        producer.cleanup(1)


def test_zero_copy_sent_buffer_never_shows_a_later_message() -> None:
    # An allocate()d buffer kept after its send, or a view of it, used to show the next
    # message once the consumer gave the slot back and the producer wrote into it again.
    # The slot now waits for the producer's array (and its views) to be collected.
    ns = shmrdv.new_namespace()
    n = 1 << 20
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns) as producer,
    ):
        prdv, crdv = producer.rendezvous(1), consumer.rendezvous(1)
        key = make_key("kept")
        buf = prdv.allocate(key, (n,), np.uint8)
        buf[:] = 1
        view = buf[10:20]
        prdv.send(key, buf)
        got = crdv.recv(key, timeout=10).value
        assert (got == 1).all()
        del got  # given back: the consumer's array is collected
        buf2 = prdv.allocate(key, (n,), np.uint8)
        assert not np.shares_memory(buf, buf2)
        buf2[:] = 2
        prdv.send(key, buf2)
        got = crdv.recv(key, timeout=10).value
        assert (got == 2).all() and (buf == 1).all() and (view == 1).all()
        del got, buf2
        assert shm_stats(producer)["pool_created"] == 2
        del buf  # the view still reads the slot: it stays out of the pool
        buf3 = prdv.allocate(key, (n,), np.uint8)
        assert not np.shares_memory(view, buf3)
        del buf3, view  # now neither is read here: both slots serve again
        for i in range(3, 6):
            buf = prdv.allocate(key, (n,), np.uint8)
            buf[:] = i
            prdv.send(key, buf)
            del buf
            got = crdv.recv(key, timeout=10).value
            assert (got == i).all()
            del got
        assert shm_stats(producer)["pool_created"] == 2
        consumer.cleanup(1)
        producer.cleanup(1)


# -- §4 notification -----------------------------------------------------------------------


@pytest.mark.slow
def test_notify_raising_callback_is_logged_and_the_next_receive_gets_its_value(
    pair: tuple[ChildWorker, shmrdv.Worker], step: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``recv_async`` callback that raises, run by the poller (``deliver``) for a value
    that arrives later: the exception is logged (``shmrdv.callbacks``), never propagated,
    and the poller goes on to deliver the next message."""
    producer, consumer = pair
    rdv = consumer.rendezvous(step)
    called = threading.Event()

    def done(error: BaseException | None, received: shmrdv.Received | None) -> None:
        called.set()
        raise RuntimeError("boom in done")

    with caplog.at_level(logging.ERROR, logger="shmrdv.callbacks"):
        rdv.recv_async(make_key("raises"), done)
        producer.send(make_key("raises"), np.array([1]), step=step)
        assert called.wait(10)
        wait_for(
            lambda: any("boom in done" in (r.exc_text or "") for r in caplog.records),
            5.0,
            "the callback's exception logged",
        )
    producer.send(make_key("after"), np.array([2]), step=step)
    assert rdv.recv(make_key("after"), timeout=10).value[0] == 2


def test_notify_blocked_recv_does_not_spin() -> None:
    ns = shmrdv.new_namespace()
    with ChildWorker(CONSUMER, namespace=ns) as consumer:
        cpu, wall, err = consumer.call(child_idle_recv_cpu, make_key("idle"), 2.0, timeout=30)
    assert err == "DeadlineExceededError"
    assert wall >= 1.9
    assert cpu < 0.05 * wall, f"a consumer blocked {wall:.2f}s used {cpu:.3f}s of CPU"


def test_notify_busy_poll_polls_until_the_value_comes_and_reports_it() -> None:
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns, busy_poll=5.0) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        rdv = consumer.rendezvous(1)
        # A first message starts the busy-poll budget (polling lasts busy_poll after one).
        producer.send(make_key("first"), np.array([1]), step=1)
        assert rdv.recv(make_key("first"), timeout=10).value[0] == 1
        timer = threading.Timer(0.3, producer.send, (make_key("late"), np.array([7])), {"step": 1})
        cpu0, t0 = time.thread_time(), time.monotonic()
        timer.start()
        try:
            assert rdv.recv(make_key("late"), timeout=10).value[0] == 7
        finally:
            timer.join(10)
        cpu, wall = time.thread_time() - cpu0, time.monotonic() - t0
        st = shm_stats(consumer)
        # It polled rather than slept, and says how long (the CPU it got is a share of
        # the wall time on a loaded machine, but far more than a sleeper's).
        assert st["spin_us"] >= 0.5 * wall * 1e6, st
        assert cpu >= 0.1 * wall, (cpu, wall)
        consumer.cleanup(1)
        producer.cleanup(1)


@pytest.mark.timeout(120)
def test_stream_overflowing_the_ring_arrives_whole_and_in_order() -> None:
    """1,000 arrays of 64 KiB (inline-sized) sent faster than they are received: the ring
    overflows, some go by segment (found by a listing), the rest inline. A listing that
    stashed a later message once made the consumer skip one still in the ring (lost)."""
    ns = shmrdv.new_namespace()
    n = 1000
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns, max_inflight_bytes=64 << 20) as producer,
    ):
        rdv = consumer.rendezvous(1)
        result: list[Any] = []
        t = threading.Thread(
            target=lambda: result.append(producer.call(child_stream, n, 64 << 10, timeout=90)),
            daemon=True,
        )
        t.start()
        for j in range(n):
            got = rdv.recv(make_key("stream"), timeout=20).value
            assert int(got[0]) == j, f"message {j} arrived as {int(got[0])}"
            del got
        t.join(30)
        assert result == [n]
        consumer.cleanup(1)
        producer.cleanup(1)


def test_notify_a_burst_of_small_sends_leaves_one_doorbell_post() -> None:
    """200 small sends while nobody receives: the consumer's doorbell holds one post (the
    first: whoever takes it drains the ring), not one per message; all 200 arrive."""
    ns = shmrdv.new_namespace()
    keys = [make_key(f"burst{i}") for i in range(200)]
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        assert producer.call(child_send_many, 1, keys, timeout=60) == len(keys)
        sem = posix_ipc.Semaphore(Names(ns).bell(CONSUMER))
        try:
            posts = sem.value
        finally:
            sem.close()
        assert posts == 1, f"{posts} doorbell posts waiting after {len(keys)} sends"
        rdv = consumer.rendezvous(1)
        for i, key in enumerate(keys):
            assert int(rdv.recv(key, timeout=10).value[0]) == i
        consumer.cleanup(1)
        producer.cleanup(1)


@pytest.mark.parametrize("bad", [-1, "fast", float("nan"), True, 1e9])
def test_notify_busy_poll_refuses_bad_values(bad: Any) -> None:
    with pytest.raises(shmrdv.InvalidArgumentError, match="busy_poll"):
        shmrdv.Worker(CONSUMER, namespace=shmrdv.new_namespace(), busy_poll=bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_notify_a_receiver_pinned_to_one_cpu_still_spins() -> None:
    """A stage pinned to a CPU of its own, its peer on another, is where a spin pays: the
    spin is off only where the job has one CPU, not where this process is pinned to one."""
    ns = shmrdv.new_namespace()
    n = 200
    with (
        shmrdv.Worker(PRODUCER, namespace=ns) as producer,
        ChildWorker(CONSUMER, namespace=ns) as consumer,
    ):
        rdv = producer.rendezvous(1)

        def ping() -> None:
            for i in range(n):
                rdv.send(make_key(f"ping{i}"), np.array([i]))
                rdv.recv(make_key(f"pong{i}", src=CONSUMER, dst=PRODUCER), timeout=20)

        t = threading.Thread(target=ping, daemon=True)
        t.start()
        spun = consumer.call(child_pingpong_pinned, n, timeout=60)
        t.join(20)
        assert spun > 0
        producer.cleanup(1)
        consumer.cleanup(1)


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_notify_10000_pending_futures_few_threads() -> None:
    n = 10_000
    ns = shmrdv.new_namespace()
    threads_before = threading.active_count()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        rdv = consumer.rendezvous(1)
        keys = [make_key(f"k{i}") for i in range(n)]
        futures = [rdv.recv_future(k, copy=True) for k in keys]
        assert shm_stats(consumer)["pending_keys"] == n
        assert threading.active_count() - threads_before <= 4
        assert producer.call(child_send_many, 1, keys, timeout=60) == n
        done, not_done = concurrent.futures.wait(futures, timeout=60)
        assert not not_done, f"{len(not_done)} of {n} futures still pending"
        assert threading.active_count() - threads_before <= 4
        for i, fut in enumerate(futures):
            value = fut.result().value
            assert value[0] == i and value.shape == (4,)
        del futures, done
        assert shm_stats(consumer)["pending_keys"] == 0
        consumer.cleanup(1)
        producer.cleanup(1)


def test_notify_timeout_removes_the_waiter(
    pair: tuple[ChildWorker, shmrdv.Worker], step: int
) -> None:
    producer, consumer = pair
    rdv = consumer.rendezvous(step)
    key = make_key("expire")
    t0 = time.monotonic()
    with pytest.raises(shmrdv.DeadlineExceededError):
        rdv.recv(key, timeout=0.2)
    assert time.monotonic() - t0 < 2.0
    st = shm_stats(consumer)
    assert st["pending_receives"] == 0 and st["pending_keys"] == 0
    # The expired waiter does not swallow the next value.
    producer.send(key, np.array([42]), step=step)
    assert rdv.recv(key, timeout=10).value[0] == 42


@pytest.mark.parametrize("how", ["start_abort", "cleanup"])
def test_notify_abort_wakes_blocked_receiver_at_once(
    pair: tuple[ChildWorker, shmrdv.Worker], how: str
) -> None:
    producer, consumer = pair
    s = next(_steps)
    rdv = consumer.rendezvous(s)
    box: dict[str, Any] = {}

    def receive() -> None:
        try:
            rdv.recv(make_key("never"), timeout=20)
        except BaseException as e:
            box["error"], box["at"] = e, time.monotonic()

    t = threading.Thread(target=receive)
    t.start()
    time.sleep(0.3)
    assert shm_stats(consumer)["pending_receives"] >= 1
    t0 = time.monotonic()
    if how == "start_abort":
        rdv.start_abort(shmrdv.CancelledError("stop now"))
    else:
        consumer.cleanup(s)
    t.join(5)
    assert not t.is_alive()
    assert box["at"] - t0 < 0.5
    expected = shmrdv.CancelledError if how == "start_abort" else shmrdv.AbortedError
    assert isinstance(box["error"], expected), box["error"]
    consumer.cleanup(s)
    producer.cleanup(s)
