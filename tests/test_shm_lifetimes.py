"""Lifetimes over shared memory: nothing lost, nothing leaked (issue 3 §5).

Real child processes (``ChildWorker``, spawned) are closed, exited, SIGKILLed, stopped and
restarted while a consumer in this process sends or waits. A namespace whose producer was
killed leaves that producer's presence record, doorbell and free pool slots behind: the
job's last close collects them (``test_shm_reaper.py``), or ``gc``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, REPO, make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.naming import SHM_DIR, Names
from shmrdv._shm.reaper import collect, list_objects


def kinds(ns: str) -> list[str]:
    """The kind letters of ``ns``'s objects in /dev/shm (``b`` for doorbell semaphores)."""
    prefix = Names(ns).prefix
    out = []
    for e in os.listdir(SHM_DIR):
        name = e[4:] if e.startswith("sem.") else e
        if name.startswith(prefix):
            out.append(name[len(prefix)])
    return sorted(out)


def child_exit_now(worker: shmrdv.Worker) -> None:
    """Leave without closing anything, as a crashing program does (no finalizers)."""
    os._exit(3)


def child_stats(worker: shmrdv.Worker) -> dict[str, Any]:
    return worker.stats()


# -- once send returns, the tensor is the consumer's -----------------------------------------


@pytest.mark.parametrize("pool", [True, False], ids=["pooled", "oneoff"])
@pytest.mark.parametrize("fate", ["cleanup", "close", "exit", "sigkill"])
def test_lifetime_sent_tensor_survives_the_producer(ns: str, fate: str, pool: bool) -> None:
    value = np.arange(100_000, dtype=np.float64) * (1 if pool else -1)
    key = make_key(f"survivor-{fate}")
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        producer = ChildWorker(PRODUCER, namespace=ns, shm_pool_bytes=(64 << 20) if pool else 0)
        try:
            producer.send(key, value, step=1)
            if fate == "cleanup":
                producer.cleanup(1)
            elif fate == "close":
                producer.close()
            elif fate == "exit":
                with pytest.raises(shmrdv.UnavailableError):
                    producer.call(child_exit_now)
            else:
                producer.kill(signal.SIGKILL)
            if fate != "cleanup":
                producer.process.join(10)
                assert producer.process.exitcode is not None
        finally:
            producer.close()
        got = consumer.rendezvous(1).recv(key, timeout=10)
        np.testing.assert_array_equal(got.value, value)
        del got
        consumer.cleanup(1)
    # The received segment was freed: only what a dead producer leaves for gc is there.
    assert "m" not in kinds(ns) and "h" not in kinds(ns)


def test_lifetime_consumer_cleanup_frees_unreceived(ns: str) -> None:
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        for i in range(3):
            producer.send(make_key(f"dropped{i}"), np.full(10_000, i), step=1)  # > 64 KiB: segments
        producer.send(make_key("big"), np.ones(3 << 20, dtype=np.uint8), step=1)
        producer.send(make_key("kept"), np.full(10_000, 7), step=2)
        assert kinds(ns).count("m") == 5
        consumer.cleanup(1)
        assert kinds(ns).count("m") == 1  # step 2's message stays
        with pytest.raises(shmrdv.AbortedError, match="Cleanup 1"):
            consumer.rendezvous(1).recv(make_key("dropped0"), timeout=1)
        assert consumer.rendezvous(2).recv(make_key("kept"), timeout=5).value[0] == 7
        # The pool slots went back to the producer: new sends reuse them, none is lost.
        before = producer.call(child_stats)["shm"]
        for i in range(3):
            producer.send(make_key(f"again{i}"), np.full(10_000, i), step=3)
        after = producer.call(child_stats)["shm"]
        assert after["pool_reused"] - before["pool_reused"] == 3, after
        assert after["pool_created"] == before["pool_created"]
        assert after["pool_lost"] == 0
        consumer.cleanup(2)
        consumer.cleanup(3)
        assert "m" not in kinds(ns)


def test_lifetime_cleanup_during_a_drain_frees_what_the_drain_queues(ns: str) -> None:
    # Worker.cleanup(1) lands while a drain holds the consumer's lock, between the drain's
    # "is step 1 cleaned up?" (not yet) and its queueing of step 1's message: the cleanup
    # must wait for the drain and then free that message, not see an empty step and go.
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        producer.send(make_key("warm"), np.full(10, 1), step=2)
        assert consumer.rendezvous(2).recv(make_key("warm"), timeout=10).value[0] == 1
        shm = next(t for t in consumer._active if t.name == "shm")
        cons = shm._consumer
        looked = cons._ctx.cleaned_up
        cleanups: list[threading.Thread] = []

        def cleaned_up(step: int) -> bool:
            answer = looked(step)  # what the drain acts on
            if step == 1 and not cleanups:
                cleanups.append(threading.Thread(target=consumer.cleanup, args=(1,)))
                cleanups[0].start()
                time.sleep(0.2)  # the cleanup runs now, the drain still in its lock
            return answer

        cons._ctx = dataclasses.replace(cons._ctx, cleaned_up=cleaned_up)
        producer.send(make_key("late"), np.full(10_000, 1), step=1)  # a segment and a notice
        shm._bell.drain()  # its post taken here, so the cleanup sees no post pending
        cons.scan()
        assert cleanups, "the drain never looked at step 1"
        cleanups[0].join(10)
        assert not cleanups[0].is_alive()
        assert "m" not in kinds(ns)  # the message the drain queued was freed
        with pytest.raises(shmrdv.AbortedError, match="Cleanup 1"):
            consumer.rendezvous(1).recv(make_key("late"), timeout=1)


# -- a consumer killed and restarted takes what its task was sent and did not take -----------


def child_take(
    worker: shmrdv.Worker, edge: str, count: int, log: str = "", until: int = -1
) -> list[int]:
    """Receive ``count`` values of ``edge`` (step 1), or up to the one numbered ``until``;
    return their numbers, each checked whole. With ``log``, each number is appended to that
    file as soon as it is received, and a millisecond passes before the next receive."""
    rdv = worker.rendezvous(1)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if log else -1
    got: list[int] = []
    try:
        while len(got) < count:
            value = rdv.recv(make_key(edge), timeout=30).value
            n = int(value[0])
            assert (value == n).all(), f"message {n} of {edge} arrived corrupt"
            del value
            got.append(n)
            if fd >= 0:
                os.write(fd, f"{n}\n".encode())
                time.sleep(0.001)
            if n == until:
                break
    finally:
        if fd >= 0:
            os.close(fd)
    return got


def child_nothing_more(worker: shmrdv.Worker, edge: str) -> bool:
    """Whether a receive of ``edge`` finds nothing (its timeout expires)."""
    try:
        worker.rendezvous(1).recv(make_key(edge), timeout=0.3)
    except shmrdv.DeadlineExceededError:
        return True
    return False


@pytest.mark.parametrize("size", [16, 100_000], ids=["ring", "segment"])
def test_lifetime_restarted_consumer_takes_what_its_killed_run_did_not(ns: str, size: int) -> None:
    # Two keys, interleaved, 40 values each. The consumer takes 15 of "a" and is SIGKILLed:
    # it had read every record into its process (the rest of "a", all of "b"). The task's
    # next process gets every value its killed run did not take, once, in order, whole;
    # it got none (each wait ended in UnavailableError once the producer closed).
    n = 40
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        out = producer.rendezvous(1)
        consumer = ChildWorker(CONSUMER, namespace=ns)
        try:
            for i in range(n):
                out.send(make_key("a"), np.full(size, i, np.uint32))
                out.send(make_key("b"), np.full(size, i, np.uint32))
            assert consumer.call(child_take, "a", 15) == list(range(15))
            consumer.kill(signal.SIGKILL)
        finally:
            consumer.close()
        with ChildWorker(CONSUMER, namespace=ns) as again:
            assert again.call(child_take, "a", n - 15) == list(range(15, n))
            assert again.call(child_take, "b", n) == list(range(n))
            assert again.call(child_nothing_more, "a") and again.call(child_nothing_more, "b")
            # The producer follows the new run's doorbell: what it sends now arrives too.
            out.send(make_key("a"), np.full(size, n, np.uint32))
            assert again.call(child_take, "a", 1) == [n]


@pytest.mark.parametrize("size", [16, 100_000], ids=["ring", "segment"])
def test_lifetime_consumer_killed_mid_stream_loses_nothing_it_did_not_take(
    ns: str, size: int, tmp_path: Any
) -> None:
    # A producer streams 600 values faster than the consumer takes them; the consumer
    # writes each number down as it gets it, and is SIGKILLed mid-stream (after 200, then
    # after 400: with values read into its process and not taken) and restarted. The
    # values arrive in order, none twice, and none is missing but, at a kill, the one the
    # killed run may have taken without writing it down yet.
    n = 600
    log = str(tmp_path / "taken")
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        out = producer.rendezvous(1)
        sender = threading.Thread(
            target=lambda: [out.send(make_key("s"), np.full(size, i, np.uint32)) for i in range(n)],
            daemon=True,
        )
        sender.start()
        for upto in (200, 400):
            consumer = ChildWorker(CONSUMER, namespace=ns)
            try:
                runner = threading.Thread(
                    target=_call_quietly, args=(consumer, child_take, "s", n, log), daemon=True
                )
                runner.start()
                deadline = time.monotonic() + 60
                while len(_taken(log)) < upto:
                    assert time.monotonic() < deadline, f"{len(_taken(log))} taken, not {upto}"
                    time.sleep(0.002)
                consumer.kill(signal.SIGKILL)
                runner.join(30)
            finally:
                consumer.close()
        sender.join(60)
        assert not sender.is_alive()
        taken = _taken(log)
        assert taken[-1] < n - 1, "the consumer was not killed mid-stream"
        with ChildWorker(CONSUMER, namespace=ns) as last:
            rest = last.call(child_take, "s", n, "", n - 1)
            assert last.call(child_nothing_more, "s")
    got = taken + rest
    assert got == sorted(set(got)), "out of order, or twice"
    missing = sorted(set(range(n)) - set(got))
    assert len(missing) <= 2, missing  # one per kill at most
    for m in missing:
        assert m - 1 in taken and m + 1 in got, (m, missing)


def test_lifetime_a_value_left_untaken_never_fills_the_ring(ns: str) -> None:
    # One value nobody receives for a while, then 12,000 small ones (several times what a
    # ring holds) that are received: the ring keeps the untaken record until it needs the
    # room, then its consumer moves it out, to a message of its own. The producer never
    # finds the ring full, and the value still reaches the task's next process after a
    # SIGKILL, once, whole.
    n = 12_000
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        out = producer.rendezvous(1)
        consumer = ChildWorker(CONSUMER, namespace=ns)
        try:
            out.send(make_key("late"), np.full(16, 7, np.uint32))
            for chunk in range(0, n, 1000):
                for i in range(chunk, chunk + 1000):
                    out.send(make_key("busy"), np.full(16, i, np.uint32))
                assert consumer.call(child_take, "busy", 1000) == list(range(chunk, chunk + 1000))
            assert producer.stats()["shm"]["ring_full"] == 0
            assert "m" in kinds(ns)  # the late value, moved out of the ring
            consumer.kill(signal.SIGKILL)
        finally:
            consumer.close()
        with ChildWorker(CONSUMER, namespace=ns) as again:
            assert again.call(child_take, "late", 1) == [7]
            assert again.call(child_nothing_more, "late") and again.call(child_nothing_more, "busy")
            assert "m" not in kinds(ns)


def test_lifetime_restarted_consumer_takes_what_was_moved_out_of_the_ring_first(ns: str) -> None:
    # The consumer takes 500 of 1,000 values of one key (it read them all), 2,000 more come,
    # and a look for another key reads them too: more than half the ring is held, so the
    # oldest it holds move out to messages of their own. SIGKILLed, the task's next process
    # gets the other 2,500 once, in order: those moved out (found by name, after the 500
    # its predecessor took) before those still in the ring.
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        out = producer.rendezvous(1)
        consumer = ChildWorker(CONSUMER, namespace=ns)
        try:
            for i in range(1000):
                out.send(make_key("a"), np.full(16, i, np.uint32))
            assert consumer.call(child_take, "a", 500) == list(range(500))
            for i in range(1000, 3000):
                out.send(make_key("a"), np.full(16, i, np.uint32))
            assert consumer.call(child_nothing_more, "b")
            assert "m" in kinds(ns)  # the values moved out of the ring
            assert consumer.call(child_stats)["shm"]["moved_out"] > 0
            consumer.kill(signal.SIGKILL)
        finally:
            consumer.close()
        with ChildWorker(CONSUMER, namespace=ns) as again:
            assert again.call(child_take, "a", 2500) == list(range(500, 3000))
            assert again.call(child_nothing_more, "a")
            assert "m" not in kinds(ns)


def child_send_each(worker: shmrdv.Worker, edges: list[str], n: int, start: int = 0) -> int:
    """Send ``n`` values of each of ``edges`` in turn (step 1), numbered from ``start`` in
    the order sent; the worker's ``ring_full``."""
    rdv = worker.rendezvous(1)
    for i in range(start, start + n * len(edges)):
        rdv.send(make_key(edges[i % len(edges)]), np.full(16, i, np.uint32))
    return int(worker.stats()["shm"]["ring_full"])


@pytest.mark.parametrize("keys", ["same", "fresh"])
def test_lifetime_a_burst_read_at_once_moves_nothing_out(ns: str, keys: str) -> None:
    # 2,000 small values, more than half the ring, sent before the consumer asks: what one
    # drain read is about to be taken, so none is moved out to a segment of its own.
    edges = ["a"] if keys == "same" else [f"a{i}" for i in range(2000)]
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        assert producer.call(child_send_each, edges, 2000 // len(edges)) == 0
        rdv = consumer.rendezvous(1)
        got = [int(rdv.recv(make_key(edges[i % len(edges)]), timeout=30).value[0])
               for i in range(2000)]  # fmt: skip
        assert got == list(range(2000))
        stats = consumer.stats()["shm"]
        assert stats["moved_out"] == 0 and stats["tick_finds"] == 0  # none waited for a tick
        assert "m" not in kinds(ns) and "t" not in kinds(ns)


def child_take_a_then_clean_up(worker: shmrdv.Worker) -> int:
    rdv = worker.rendezvous(1)
    got = int(rdv.recv(make_key("a"), timeout=30).value[0])
    worker.cleanup(1)
    return got


def child_look_for_x(worker: shmrdv.Worker) -> int | None:
    try:
        return int(worker.rendezvous(1).recv(make_key("x"), timeout=1).value[0])
    except shmrdv.DeadlineExceededError:
        return None


@pytest.mark.parametrize("end", ["close", "SIGKILL"])
def test_lifetime_values_a_cleanup_freed_unread_stay_freed(ns: str, end: str) -> None:
    # Step 1 brings "a" and 400 "x"; the consumer takes "a" (its drain may stop reading
    # there) and cleans step 1 up, then ends. The task's next process gets no "x" of step
    # 1: the cleanup freed them, read or not.
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        out = producer.rendezvous(1)
        consumer = ChildWorker(CONSUMER, namespace=ns)
        try:
            out.send(make_key("a"), np.full(16, 7, np.uint32))
            for i in range(400):
                out.send(make_key("x"), np.full(16, i, np.uint32))
            assert consumer.call(child_take_a_then_clean_up) == 7
            if end == "SIGKILL":
                consumer.kill(signal.SIGKILL)
        finally:
            consumer.close()
        with ChildWorker(CONSUMER, namespace=ns) as again:
            assert again.call(child_look_for_x) is None
        producer.cleanup(1)


def test_lifetime_a_pool_slot_found_by_name_and_cleaned_up_goes_back(ns: str) -> None:
    # The ring is full when a large value is sent, so its notice goes by name only; a later
    # record shows the gap, filled by name; the step is cleaned up unreceived: its pool slot
    # goes back to the producer (not unlinked, which would lose it from the pool).
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns) as producer,
    ):
        out, inn = producer.rendezvous(1), consumer.rendezvous(1)
        n = 0
        while producer.stats()["shm"]["ring_full"] == 0:
            out.send(make_key("fill"), np.full(16, n, np.uint32))
            n += 1
        out.send(make_key("big"), np.full(300_000, 0, np.uint32))  # no room for its record
        assert [int(inn.recv(make_key("fill"), timeout=10).value[0]) for _ in range(n)] == (
            list(range(n))
        )
        out.send(make_key("big"), np.full(300_000, 1, np.uint32))  # a record after a gap
        with pytest.raises(shmrdv.DeadlineExceededError):
            inn.recv(make_key("other"), timeout=0.5)  # a drain reads it, fills the gap
        consumer.cleanup(1)
        # Large values keep the pool busy past the producer's check of its lent slots (a
        # second after a look): one unlinked instead of given back would count as lost.
        out2, inn2 = producer.rendezvous(2), consumer.rendezvous(2)
        until = time.monotonic() + 2 * pool_lost_check_s()
        while time.monotonic() < until:
            out2.send(make_key("b2"), np.full(300_000, 2, np.uint32))
            inn2.recv(make_key("b2"), timeout=10)
            time.sleep(0.05)
        stats = producer.stats()["shm"]
        assert stats["pool_lost"] == 0 and stats["pool_reused"] > 0, stats
        consumer.cleanup(2)
        producer.cleanup(1)
        producer.cleanup(2)


def pool_lost_check_s() -> float:
    from shmrdv._shm import pool

    return float(pool._LOST_CHECK_S)


def test_lifetime_values_held_or_moved_out_outlive_a_killed_producer(ns: str) -> None:
    # The consumer reads 1,000 values and takes 500; 2,000 more come and a look for another
    # key reads them: past half the ring, the 500 read before move out. The producer is
    # SIGKILLed: the 2,500 values held or moved out still arrive, once, in order.
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        rdv = consumer.rendezvous(1)
        producer = ChildWorker(PRODUCER, namespace=ns)
        try:
            assert producer.call(child_send_each, ["a"], 1000) == 0
            assert [int(rdv.recv(make_key("a"), timeout=30).value[0]) for _ in range(500)] == (
                list(range(500))
            )
            assert producer.call(child_send_each, ["a"], 2000, 1000) == 0
            with pytest.raises(shmrdv.DeadlineExceededError):
                rdv.recv(make_key("b"), timeout=0.3)
            assert consumer.stats()["shm"]["moved_out"] > 0
            producer.kill(signal.SIGKILL)
        finally:
            producer.close()
        got = [int(rdv.recv(make_key("a"), timeout=30).value[0]) for _ in range(2500)]
        assert got == list(range(500, 3000))
        with pytest.raises((shmrdv.UnavailableError, shmrdv.DeadlineExceededError)):
            rdv.recv(make_key("a"), timeout=5)
        consumer.cleanup(1)


def _taken(log: str) -> list[int]:
    try:
        with open(log) as f:
            return [int(line) for line in f.read().split("\n") if line]
    except FileNotFoundError:
        return []


def _call_quietly(child: ChildWorker, fn: Any, *args: Any) -> None:
    try:
        child.call(fn, *args)
    except shmrdv.RendezvousError:
        pass  # killed: the test reads what it wrote down


@pytest.mark.slow
def test_lifetime_consumer_exit_holding_array_leaves_nothing(ns: str) -> None:
    """A consumer process that ends while holding received arrays leaves no ``held`` name."""
    with ChildWorker(PRODUCER, namespace=ns) as producer:
        consumer = ChildWorker(CONSUMER, namespace=ns)
        try:
            producer.send(make_key("held"), np.ones(10_000), step=1)  # > 64 KiB: a pool slot
            assert consumer.call(child_recv_and_keep, 1, make_key("held")) == 1
            assert "h" in kinds(ns)
        finally:
            consumer.close()
        assert "h" not in kinds(ns)
        # The producer notices the slot is gone (checked at most once a second per slot)
        # and forgets it instead of waiting for it forever.
        deadline = time.monotonic() + 5
        while True:
            producer.send(make_key("next"), np.ones(10_000), step=2)
            stats = producer.call(child_stats)["shm"]
            if stats["pool_lost"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert stats["pool_lost"] == 1, stats
        producer.cleanup(2)
    # Sent to a consumer that is gone: it waits for another run of that consumer (for
    # reaper.GRACE_S), then the next Worker's sweep or gc takes it, and the ring with its
    # notices of it (records not taken).
    assert set(kinds(ns)) == {"m", "q"}
    collect(ns)
    assert kinds(ns) == []


_kept: list[Any] = []


def child_recv_and_keep(worker: shmrdv.Worker, step: int, key: str) -> int:
    got = worker.rendezvous(step).recv(key, timeout=10)
    _kept.append(got.value)  # still alive when the process exits
    return len(_kept)


# -- liveness -------------------------------------------------------------------------------


def _recv_in_thread(rdv: Any, key: str, timeout: float) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = rdv.recv(key, timeout=timeout).value
        except BaseException as e:
            box["error"] = e
        box["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_lifetime_recv_fails_unavailable_when_producer_dies(ns: str, delay: float) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        producer = ChildWorker(PRODUCER, namespace=ns)
        try:
            t, box = _recv_in_thread(consumer.rendezvous(1), make_key("orphan"), 20)
            # The receive must be waiting while the producer is alive: the case is "alive,
            # then died" (a record left by a producer that was dead all along is not it).
            deadline = time.monotonic() + 5
            while not consumer.stats()["shm"]["pending_receives"] and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(delay)
            killed_at = time.monotonic()
            producer.kill(signal.SIGKILL)
            t.join(5)
        finally:
            producer.close()
        assert not t.is_alive()
        err = box.get("error")
        assert isinstance(err, shmrdv.UnavailableError), box
        assert PRODUCER in str(err) and "orphan" in str(err)
        assert box["at"] - killed_at < 1.0
        consumer.cleanup(1)


@pytest.mark.slow
def test_lifetime_stopped_producer_is_not_dead(ns: str) -> None:
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        t, box = _recv_in_thread(consumer.rendezvous(1), make_key("paused"), 20)
        time.sleep(0.1)
        producer.kill(signal.SIGSTOP)
        try:
            time.sleep(1.2)
            assert t.is_alive() and not box, box
        finally:
            producer.kill(signal.SIGCONT)
        producer.send(make_key("paused"), np.array([5, 6]), step=1)
        t.join(10)
        assert "error" not in box, box
        assert list(box["value"]) == [5, 6]
        consumer.cleanup(1)
        producer.cleanup(1)


def test_lifetime_restarted_producer_old_incarnation_aborted(ns: str) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        with ChildWorker(PRODUCER, namespace=ns) as first:
            old = first.incarnation
            first.send(make_key("before", incarnation=old), np.array([1]), step=1)
        with ChildWorker(PRODUCER, namespace=ns) as second:
            new = second.incarnation
            assert new != old
            rdv = consumer.rendezvous(1)
            # Sent by the old run before it ended: still delivered.
            assert rdv.recv(make_key("before", incarnation=old), timeout=5).value[0] == 1
            # Anything else of the old run: the producer was restarted.
            t0 = time.monotonic()
            with pytest.raises(shmrdv.AbortedError, match="incarnation") as info:
                rdv.recv(make_key("after", incarnation=old), timeout=10)
            assert time.monotonic() - t0 < 1.0
            assert PRODUCER in str(info.value)
            second.send(make_key("after", incarnation=new), np.array([2]), step=1)
            assert rdv.recv(make_key("after", incarnation=new), timeout=5).value[0] == 2
            # A waiter already queued when the restart happens fails too.
            t, box = _recv_in_thread(rdv, make_key("late", incarnation=new), 20)
            time.sleep(0.2)
        with ChildWorker(PRODUCER, namespace=ns):
            t.join(5)
            assert isinstance(box.get("error"), (shmrdv.AbortedError, shmrdv.UnavailableError)), box
        consumer.cleanup(1)


# -- ls and gc --------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmrdv", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=str(REPO),
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


@pytest.mark.slow
def test_lifetime_ls_and_gc_remove_only_dead_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers' own sweeps would collect the dead namespace first (test_shm_reaper.py):
    # turned off here, to see what ls and gc do with it.
    monkeypatch.setenv("SHMRDV_AUTO_GC", "0")
    dead, live = shmrdv.new_namespace(), shmrdv.new_namespace()
    try:
        with shmrdv.Worker(CONSUMER, namespace=live) as consumer:
            # A dead namespace: its only worker sent a message nobody took, then was killed.
            victim = ChildWorker(PRODUCER, namespace=dead)
            try:
                victim.send(make_key("lost"), np.ones(10_000), step=4)
                victim.kill(signal.SIGKILL)
            finally:
                victim.close()
            assert set(kinds(dead)) >= {"b", "m", "w"}
            # A live namespace with an unreceived message of a producer that has gone.
            with ChildWorker(PRODUCER, namespace=live) as producer:
                producer.send(make_key("waiting"), np.full(10_000, 3), step=5)
            live_before = kinds(live)
            assert "m" in live_before

            out = _cli("ls", "--namespace", shmrdv.namespace_id(dead))  # an id, or a token
            assert out.returncode == 0, out.stderr
            lines = [ln for ln in out.stdout.splitlines() if shmrdv.namespace_id(dead) in ln]
            assert {ln.split()[0] for ln in lines} >= {"bell", "message", "presence"}
            message = next(ln for ln in lines if ln.startswith("message"))
            assert " 4 " in message and " no " in message and "lost" in message
            out = _cli("ls", "--namespace", live)
            assert any(
                ln.startswith("presence") and " yes " in ln for ln in out.stdout.splitlines()
            )

            dry = _cli("gc", "--namespace", dead, "--dry-run")
            assert dry.returncode == 0 and "would remove" in dry.stdout
            assert set(kinds(dead)) >= {"b", "m", "w"}
            # gc of the live namespace removes nothing.
            assert collect(live) == []
            assert kinds(live) == live_before
            out = _cli("gc", "--namespace", dead)
            assert out.returncode == 0, out.stderr
            assert kinds(dead) == []
            assert {o.namespace for o in list_objects(live)} == {shmrdv.namespace_id(live)}
            # The live namespace's message is still there and still received.
            assert consumer.rendezvous(5).recv(make_key("waiting"), timeout=5).value[0] == 3
            consumer.cleanup(5)
    finally:
        collect(dead)
        collect(live)
    assert kinds(live) == []
