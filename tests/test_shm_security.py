"""Squatting by another local user (issue 3 §6; research/pitfalls.md §7).

As root, a child process drops to uid 65534 ("nobody") and pre-creates, with mode 0666,
an object under the exact name a worker is about to use (computed with ``Names``, as if
the attacker knew the namespace token). The worker must detect it and refuse it: it is
never written into, never read from, never posted; the legitimate side gets an error or
takes a path the attacker cannot reach; the planted object is unchanged afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import posix_ipc
import pytest
from helpers import (
    CONSUMER,
    NOBODY,
    PRODUCER,
    fork_as_nobody,
    make_key,
    remove_planted,
    run_as_nobody,
)

import shmrdv
from shmrdv._shm.naming import SHM_DIR, Names
from shmrdv._shm.reaper import list_objects

INCARNATION = 0x5EC0_0000_0000_0001
PLANTED = b"planted by uid 65534; must never change".ljust(4096, b".")

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (setuid)"),
]


def _plant_file(path: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    os.fchmod(fd, 0o666)
    os.write(fd, PLANTED)
    os.close(fd)


def _plant_semaphore(name: str) -> None:
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o666, initial_value=0)
    os.chmod(f"{SHM_DIR}/sem.{name[1:]}", 0o666)
    sem.close()


@dataclass
class Planted:
    path: str

    def assert_untouched(self) -> None:
        st = os.stat(self.path, follow_symlinks=False)
        assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o666
        with open(self.path, "rb") as f:
            assert f.read() == PLANTED


@pytest.fixture
def ns(ns: str) -> Iterator[str]:
    """conftest's ``ns``, which differs here only in that root first removes what "nobody"
    planted: ``gc`` leaves another user's objects alone, then collects what is left."""
    yield ns
    remove_planted(ns)


def plant_file(name: str) -> Planted:
    path = Names.path(name)
    run_as_nobody(_plant_file, path)
    planted = Planted(path)
    planted.assert_untouched()
    return planted


def test_security_planted_message_is_refused_by_both_sides(ns: str) -> None:
    key = make_key("secret")
    planted = plant_file(Names(ns).message(1, key, INCARNATION, 0))
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        crdv, prdv = consumer.rendezvous(1), producer.rendezvous(1)
        with pytest.raises(shmrdv.InternalError, match=r"planted|refusing"):
            crdv.recv(key, timeout=5)
        with pytest.raises(shmrdv.InternalError, match="exists already"):
            prdv.send(key, np.full(70_000, 7, dtype=np.uint8))  # > 64 KiB: a segment
        planted.assert_untouched()
        # Both skipped the squatted message: the next one goes through.
        prdv.send(key, np.full(70_000, 8, dtype=np.uint8))
        assert crdv.recv(key, timeout=5).value[0] == 8
        planted.assert_untouched()
        consumer.cleanup(1)
        producer.cleanup(1)


def test_security_planted_doorbell_is_refused(ns: str) -> None:
    names = Names(ns)
    bell = names.bell(CONSUMER)
    run_as_nobody(_plant_semaphore, bell)
    try:
        with pytest.raises(shmrdv.InternalError, match="not ours"):
            shmrdv.Worker(CONSUMER, namespace=ns)
        # A producer never posts a doorbell it does not own; its send still succeeds.
        with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
            producer.rendezvous(1).send(make_key("unposted"), np.ones(10))
            producer.cleanup(1)
        sem = posix_ipc.Semaphore(bell)
        try:
            assert sem.value == 0
        finally:
            sem.close()
        st = os.stat(names.bell_path(CONSUMER))
        assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o666
    finally:
        posix_ipc.unlink_semaphore(bell)


def test_security_planted_pool_slot_is_not_used(ns: str) -> None:
    planted = plant_file(Names(ns).pool(PRODUCER, INCARNATION, 0))
    key = make_key("pooled")
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        for i in range(3):
            producer.rendezvous(1).send(key, np.full(40_000, i, dtype=np.int16))  # > 64 KiB
            got = consumer.rendezvous(1).recv(key, timeout=5)
            assert (got.value == i).all()
            del got
        planted.assert_untouched()
        consumer.cleanup(1)
        producer.cleanup(1)
    planted.assert_untouched()


def test_security_planted_held_name_is_not_used(ns: str) -> None:
    planted = plant_file(Names(ns).held(PRODUCER, INCARNATION, 0))
    key = make_key("held")
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        producer.rendezvous(1).send(key, np.arange(10_000, dtype=np.int64))  # > 64 KiB: a slot
        got = consumer.rendezvous(1).recv(key, timeout=5)
        np.testing.assert_array_equal(got.value, np.arange(10_000))
        got.value[:] = -1  # writes go to the consumer's own segment, not the planted file
        planted.assert_untouched()
        del got
        consumer.cleanup(1)
        producer.cleanup(1)
    planted.assert_untouched()


def test_security_planted_presence_record_is_refused(ns: str) -> None:
    names = Names(ns)
    planted = plant_file(names.presence(PRODUCER))
    with pytest.raises(shmrdv.InternalError, match="not ours"):
        shmrdv.Worker(PRODUCER, namespace=ns)
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        # A receive from a task whose record is squatted fails at once instead of trusting it.
        with pytest.raises((shmrdv.InternalError, shmrdv.UnavailableError), match="not ours"):
            consumer.rendezvous(1).recv(make_key("squatted"), timeout=5)
        consumer.cleanup(1)
    planted.assert_untouched()


# -- issue 13 §2: a listing of /dev/shm predicts no name of the job ------------------------


def _plant_many(paths: str) -> None:
    for path in paths.split("\n"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        os.close(fd)


def _plant_bells(names: str) -> None:
    for name in names.split("\n"):
        _plant_semaphore(name)


def test_security_listing_does_not_let_a_user_squat_the_next_worker(ns: str) -> None:
    """An attacker lists /dev/shm while task 0 of the job runs and plants the presence record
    and doorbell of task 1 under every name it can derive from what it sees (the namespace
    part of the names it read, taken as the token; the old unkeyed task hash). Task 1 must
    still start. Before issue 13 the names carried the token: this planted the exact names
    and ``Worker(task:1)`` failed with "not ours"."""
    with shmrdv.Worker(PRODUCER, namespace=ns) as first:
        # What the attacker sees of the job (other jobs' names, of parallel runs, left out).
        job = Names(ns)
        mine = {job.presence(PRODUCER), "sem." + job.bell(PRODUCER)[1:]}
        seen = [e for e in os.listdir(SHM_DIR) if e in mine]
        visible = {e.removeprefix("sem.").split("_")[1] for e in seen}
        files, bells = [], []
        for part in visible:
            try:
                guess = Names(part)  # the visible part, as if it were the token
            except shmrdv.InvalidArgumentError:
                continue
            # With the real prefix too: the visible id plus a hash the attacker computes.
            for prefix in {guess.prefix, f"shmrdv_{part}_"}:
                files.append(Names.path(prefix + guess.presence(CONSUMER).rsplit("_", 1)[1]))
                bells.append("/" + prefix + guess.bell(CONSUMER).rsplit("_", 1)[1])
        assert files, f"nothing of the job visible in {seen}"
        run_as_nobody(_plant_many, "\n".join(sorted(set(files))))
        run_as_nobody(_plant_bells, "\n".join(sorted(set(bells))))
        try:
            with shmrdv.Worker(CONSUMER, namespace=ns) as second:
                key = make_key("after-squat")
                first.rendezvous(1).send(key, np.arange(5))
                assert second.rendezvous(1).recv(key, timeout=5).value.tolist() == [0, 1, 2, 3, 4]
                second.cleanup(1)
            first.cleanup(1)
        finally:
            # Some guesses lie outside the job's prefix (another namespace id): the ns
            # fixture's sweep does not see those.
            for path in set(files):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            for bell in set(bells):
                try:
                    posix_ipc.unlink_semaphore(bell)
                except posix_ipc.ExistentialError:
                    pass


#: The consumer's poll tick (``transport._TICK``): a receive may overrun by one.
TICK_S = 0.2
FLOOD = 20_000


def _flood(ns: str) -> None:
    """``FLOOD`` message-shaped and ``FLOOD // 10`` ring-shaped files of uid 65534 under the
    job's (public) prefix."""
    prefix = Names(ns).prefix
    paths = [Names.path(f"{prefix}m{os.urandom(10).hex()}") for _ in range(FLOOD)]
    paths += [Names.path(f"{prefix}q{os.urandom(10).hex()}") for _ in range(FLOOD // 10)]
    run_as_nobody(_plant_many, "\n".join(paths))


def _timed_recv(rdv: shmrdv.Rendezvous, key: str) -> tuple[float, float]:
    t0, cpu0 = time.monotonic(), time.process_time()
    with pytest.raises(shmrdv.DeadlineExceededError):
        rdv.recv(key, timeout=3)
    took, cpu = time.monotonic() - t0, time.process_time() - cpu0
    print(f"recv(timeout=3) among {FLOOD} junk names: {took:.2f} s, {cpu:.2f} s CPU")
    return took, cpu


@pytest.mark.slow
def test_security_junk_flood_costs_a_receive_from_a_live_producer_nothing(ns: str) -> None:
    """With the producer running, a junk flood costs a receive nothing (the transport does not
    list /dev/shm), and ``list_objects`` skips the junk without opening it (issue 13 §2)."""
    _flood(ns)
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        took, _ = _timed_recv(consumer.rendezvous(1), make_key("never-sent"))
        assert took < 3 + TICK_S
        t0 = time.monotonic()
        listed = list_objects(ns)
        assert time.monotonic() - t0 < 2.0  # one parse and one lstat per junk entry
        assert {o.kind for o in listed} == {"presence", "bell"}
        consumer.cleanup(1)
        producer.cleanup(1)


@pytest.mark.slow
def test_security_junk_flood_costs_a_receive_no_more_than_its_timeout(ns: str) -> None:
    """20,000 message-shaped names of another user in the job's namespace (the prefix is
    public) must not make ``recv(timeout=3)`` from a producer that is not running overrun by
    more than a tick, nor burn a core (issue 13 §2)."""
    _flood(ns)
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        took, cpu = _timed_recv(consumer.rendezvous(1), make_key("not-running"))
        assert took < 3 + TICK_S and cpu < 0.3, (took, cpu)
        consumer.cleanup(1)


def _plant_at(paths: str) -> None:
    for path in paths.split("\n"):
        with contextlib.suppress(FileExistsError):
            _plant_file(path)


def test_security_recreated_message_names_do_not_jam_the_window(ns: str) -> None:
    """Another user re-creates each consumed message's name (issue 20 §3, done there with
    inotify): before, any file at the name counted as in flight, so after the window filled
    once every ``send(timeout=2)`` failed after 2 s with ``ResourceExhaustedError``. The
    window counts the message's own file (its inode, ours) only."""
    key = make_key("jammed")
    value = np.ones(300_000, np.uint8)  # a segment, not a ring record
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, max_inflight_bytes=2 * value.nbytes) as producer,
    ):
        out, inbox = producer.rendezvous(1), consumer.rendezvous(1)
        names = Names(ns)
        sent = 0
        for _ in range(3):
            planted = []
            for _ in range(2):
                out.send(key, value, timeout=2)
                planted.append(names.path(names.message(1, key, producer.incarnation, sent)))
                sent += 1
            for _ in range(2):
                assert inbox.recv(key, timeout=5).value[0] == 1
            run_as_nobody(_plant_at, "\n".join(planted))
            assert all(os.stat(p).st_uid == NOBODY for p in planted)
        t0 = time.monotonic()
        out.send(key, value, timeout=2)
        assert time.monotonic() - t0 < 1.0
        assert producer.stats()["shm"]["inflight_bytes"] == value.nbytes
        assert inbox.recv(key, timeout=5).value[0] == 1
        consumer.cleanup(1)
        producer.cleanup(1)


def _squat_vacated(prefix: str) -> None:
    """As "nobody": plant a file under every name of the namespace seen to vanish, until
    killed (at most 60 s)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = {e for e in os.listdir(SHM_DIR) if e.startswith(prefix)}
        for name in seen - now:
            with contextlib.suppress(OSError):
                _plant_file(os.path.join(SHM_DIR, name))
        seen |= now
        time.sleep(0.0005)


def child_pingpong_big(worker: shmrdv.Worker, n: int, nbytes: int) -> dict[str, int]:
    rdv = worker.rendezvous(1)
    for i in range(n):
        rdv.send(make_key(f"big{i}"), np.full(nbytes, i % 251, np.uint8))
        rdv.recv(make_key(f"ack{i}", src=CONSUMER, dst=PRODUCER), timeout=20)
    stats: dict[str, int] = worker.stats()["shm"]
    return stats


@pytest.mark.timeout(120)
def test_security_files_planted_under_vacated_slot_names_do_not_defeat_the_pool(ns: str) -> None:
    """Issue 20 §3: another user re-creates every name it saw vanish (a pool slot's ``p``,
    ``h``, ``r`` names); each lend of a slot has names of its own, so the pool keeps
    reusing its slots and nothing planted is ever touched."""
    from shmrdv._procs import ChildWorker

    pid = fork_as_nobody(_squat_vacated, Names(ns).prefix)
    n = 60
    try:
        with (
            shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
            ChildWorker(PRODUCER, namespace=ns) as producer,
        ):
            rdv = consumer.rendezvous(1)

            def pong() -> None:
                for i in range(n):
                    got = rdv.recv(make_key(f"big{i}"), timeout=20).value
                    assert got[0] == got[-1] == i % 251
                    del got
                    rdv.send(make_key(f"ack{i}", src=CONSUMER, dst=PRODUCER), np.array([i]))

            import threading

            t = threading.Thread(target=pong, daemon=True)
            t.start()
            stats = producer.call(child_pingpong_big, n, 4 << 20, timeout=90)
            t.join(30)
            consumer.cleanup(1)
            producer.cleanup(1)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # Before: reuse dropped to 0-98 of 200 (a planted "r" name made a slot's return fail).
    assert stats["pool_reused"] >= n - 5, stats
    assert stats["pool_created"] <= 4, stats
