"""Lifetimes over shared memory: nothing lost, nothing leaked (issue 3 §5).

Real child processes (``ChildWorker``, spawned) are closed, exited, SIGKILLed, stopped and
restarted while a consumer in this process sends or waits. A namespace whose producer was
killed leaves that producer's presence record, doorbell and free pool slots behind: the
job's last close collects them (``test_shm_reaper.py``), or ``gc``.
"""

from __future__ import annotations

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
from shmrdv._shm.registry import collect, list_objects


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
    # reaper.GRACE_S), then the next Worker's sweep or gc takes it.
    assert set(kinds(ns)) == {"m"}
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
