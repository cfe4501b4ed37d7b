"""What dead workers left is collected: by the job itself, and by ``ls`` / ``gc`` by hand.

Real child workers are SIGKILLed, SIGTERMed, run in mismatched namespaces or out of file
descriptors; then the job's other workers close, or the next Worker starts on the host,
and nothing of the dead is left in /dev/shm. No sweep test calls ``gc``/``collect`` before
it looks. A live worker's objects are never touched, also while sweeps race its start.
The last section lists and collects planted objects by hand (``list_objects``,
``collect``): live namespaces are untouched, dead ones go whole.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import resource
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from header_corruptions import build_header, write_header
from helpers import CONSUMER, PRODUCER, SHMRDV_PATH, PresenceChild, make_key, run_as_nobody
from small_shm import run_with_small_dev_shm

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm import reaper
from shmrdv._shm.bell import Bell
from shmrdv._shm.naming import SHM_DIR, Names
from shmrdv._shm.presence import Presence, PresenceInfo, boot_id
from shmrdv._shm.reaper import ObjectInfo, collect, list_objects, unlink_if_unused

pytestmark = pytest.mark.timeout(120)


def left(ns: str) -> list[str]:
    """The names of ``ns``'s objects in /dev/shm (semaphores included)."""
    prefix = Names(ns).prefix
    return sorted(e for e in os.listdir(SHM_DIR) if prefix in e)


def kinds(ns: str) -> list[str]:
    prefix = Names(ns).prefix
    return sorted(e.split(prefix, 1)[1][0] for e in left(ns))


def child_allocate_and_hold(worker: shmrdv.Worker, key: str, nbytes: int) -> int:
    """``allocate`` a buffer and fill it, but never send it (the producer dies first)."""
    buf = worker.rendezvous(1).allocate(key, (nbytes,), np.uint8)
    buf[:] = 7
    global _held_buffer
    _held_buffer = buf
    return int(buf.nbytes)


_held_buffer: Any = None

# (message bytes, messages sent, sent with allocate)
CASES = {
    "64B": (64, 200, False),
    "1MiB": (1 << 20, 12, False),
    "32MiB-allocate": (32 << 20, 4, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reaper_sigkilled_producer_leaves_nothing_once_its_consumer_closes(
    ns: str, case: str
) -> None:
    nbytes, count, allocate = CASES[case]
    consumer = shmrdv.Worker(CONSUMER, namespace=ns)
    try:
        producer = ChildWorker(PRODUCER, namespace=ns)
        try:
            out = producer.producer(1, allocate=allocate)
            for i in range(count):
                out.send(make_key(f"m{i}"), np.full(nbytes, i % 251, np.uint8))
            if allocate:
                producer.call(child_allocate_and_hold, make_key("unsent"), nbytes)
            got = consumer.rendezvous(1).recv(make_key("m0"), timeout=10)
            assert got.value[0] == 0
            del got
            producer.kill(signal.SIGKILL)
        finally:
            producer.close()
        assert "w" in kinds(ns)  # the dead producer's record is still there
    finally:
        consumer.close()
    assert left(ns) == []


_PLAIN_WORKER = """
import sys, numpy as np, shmrdv
ns, task, key = sys.argv[1:4]
w = shmrdv.Worker(task, namespace=ns)
w.rendezvous(1).send(key, np.ones(100_000))
print("ready", flush=True)
sys.stdin.read()
"""


class PlainWorker:
    """A plain Python program holding a Worker that sent one 800 kB message: no signal
    handler of ours, so SIGTERM ends it as it ends most programs (no cleanup at all)."""

    def __init__(self, ns: str, task: str, key: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PLAIN_WORKER, ns, task, key],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=SHMRDV_PATH),
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        assert ready and self.proc.stdout.readline() == b"ready\n"

    def terminate(self) -> None:
        """SIGTERM (plain ``kill``), then reap it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.terminate()
        assert self.proc.wait(10) == -signal.SIGTERM
        self.proc.stdin.close()
        self.proc.stdout.close()


def test_reaper_sigtermed_worker_is_collected_when_the_job_closes(ns: str) -> None:
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        PlainWorker(ns, PRODUCER, make_key("x")).terminate()
        assert {"b", "w"} <= set(kinds(ns))  # what plain `kill` leaves
        assert consumer.rendezvous(1).recv(make_key("x"), timeout=10).value[0] == 1
    assert left(ns) == []


def test_reaper_next_worker_on_the_host_collects_a_dead_job(
    ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    PlainWorker(ns, PRODUCER, make_key("lost")).terminate()  # its message is never taken
    assert {"b", "m", "w"} <= set(kinds(ns))
    # The next Worker on the host, right away: the dead worker's record and doorbell go; the
    # message (and ring) it sent may be for a consumer about to start, and wait (GRACE_S).
    with shmrdv.Worker("/job:other/replica:0/task:0", namespace=shmrdv.new_namespace()):
        assert kinds(ns) == ["m", "q"]
    # The next Worker once that wait is over (set to 0 here rather than waited for).
    monkeypatch.setattr(reaper, "GRACE_S", 0.0)
    with shmrdv.Worker("/job:other/replica:0/task:0", namespace=shmrdv.new_namespace()):
        assert left(ns) == []


def test_reaper_values_wait_for_a_consumer_that_starts_later(ns: str) -> None:
    # A producer sends and closes before its consumer starts; Workers of other jobs start
    # and close meanwhile: the values (ring and segment) wait for the consumer.
    with ChildWorker(PRODUCER, namespace=ns) as producer:
        producer.send(make_key("small"), np.full(4, 1.0), step=1)
        producer.send(make_key("big"), np.full(300_000, 2, np.uint8), step=1)
    assert sorted(set(kinds(ns))) == ["m", "q"]
    for _ in range(2):
        with shmrdv.Worker("/job:other/replica:0/task:0", namespace=shmrdv.new_namespace()):
            pass
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        inbox = consumer.rendezvous(1)
        assert inbox.recv(make_key("small"), timeout=10).value[0] == 1.0
        assert inbox.recv(make_key("big"), timeout=10).value[0] == 2
    assert left(ns) == []


def set_grace(worker: shmrdv.Worker, seconds: float) -> None:
    """In a child: its sweeps keep what is waiting for a consumer ``seconds`` (not 30 s)."""
    reaper.GRACE_S = seconds


@pytest.mark.parametrize("nbytes", [64, 1 << 20], ids=["ring", "segment"])
def test_reaper_values_sent_before_a_clean_close_wait_after_the_last_send(
    ns: str, nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sequence that lost values, the wait scaled from 30 s to GRACE: a producer sends
    # at t0 and again at t0 + 1.5 GRACE, then closes (its own close sweeps its namespace,
    # dead now); a consumer that starts a moment later gets both values. tmpfs does not
    # update a file's mtime for writes through a mapping: taken as the last write, the
    # ring's looked older than GRACE, and the close deleted the producer's own values.
    grace = 2.0
    monkeypatch.setattr(reaper, "GRACE_S", grace)  # the consumer's start sweep, here
    with ChildWorker(PRODUCER, namespace=ns) as producer:
        producer.call(set_grace, grace)
        producer.send(make_key("t0"), np.full(nbytes, 1, np.uint8), step=1)
        time.sleep(1.5 * grace)
        producer.send(make_key("t1"), np.full(nbytes, 2, np.uint8), step=1)
    time.sleep(grace / 4)
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        inbox = consumer.rendezvous(1)
        first = inbox.recv(make_key("t0"), timeout=10).value
        assert first.shape == (nbytes,) and first[0] == 1 and first[-1] == 1
        second = inbox.recv(make_key("t1"), timeout=10).value
        assert second.shape == (nbytes,) and second[0] == 2 and second[-1] == 2
        del first, second
    assert left(ns) == []


def test_reaper_mismatched_namespaces_leave_nothing(
    ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The consumer runs in another namespace: the producer's ring and its 1.1 MiB message
    # are never taken (issue 20 §1: each such run left 1 MiB + 1.1 MiB). They are addressed
    # to a task that may still start in the producer's namespace, so they wait GRACE_S
    # (set to 0 here: "the next Worker on the host, later").
    theirs = shmrdv.new_namespace()
    with shmrdv.Worker(CONSUMER, namespace=theirs) as consumer:
        with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
            out = producer.rendezvous(0)
            out.send(make_key("small"), np.ones(4))
            out.send(make_key("big"), np.ones(int(1.1 * (1 << 20)), np.uint8))
            assert {"m", "q"} <= set(kinds(ns))
            with pytest.raises(shmrdv.DeadlineExceededError):
                consumer.rendezvous(0).recv(make_key("small"), timeout=0.2)
        assert sorted(set(kinds(ns))) == ["m", "q"]
    assert left(theirs) == []
    monkeypatch.setattr(reaper, "GRACE_S", 0.0)
    with shmrdv.Worker("/job:other/replica:0/task:0", namespace=shmrdv.new_namespace()):
        assert left(ns) == []


def _exhaust_fds_then_close(ns: str, q: Any) -> None:
    """In a child: send 1.1 MiB to a consumer that cannot open it (no fds left), then close."""
    try:
        with (
            shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
            shmrdv.Worker(PRODUCER, namespace=ns) as producer,
        ):
            producer.rendezvous(0).send(make_key("big"), np.ones(int(1.1 * (1 << 20)), np.uint8))
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
            held = []
            try:
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            try:
                consumer.rendezvous(0).recv(make_key("big"), timeout=1)
                outcome = "received"
            except shmrdv.RendezvousError as e:
                outcome = type(e).__name__
            finally:
                for fd in held:
                    os.close(fd)
        q.put((outcome, left(ns)))
    except BaseException as e:  # pragma: no cover - reported to the test
        q.put((repr(e), None))


def test_reaper_fd_exhaustion_leaves_nothing_after_both_close(ns: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_exhaust_fds_then_close, args=(ns, q))
    p.start()
    try:
        outcome, remaining = q.get(timeout=60)
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert outcome in ("received", "ResourceExhaustedError", "DeadlineExceededError"), outcome
    assert remaining == []
    assert left(ns) == []


# -- the consumer's part: what is left of one dead producer run ------------------------------


def test_reaper_collect_producer_frees_what_a_dead_run_left(ns: str) -> None:
    names = Names(ns)
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        mine = set(left(ns))  # the consumer's own record and doorbell
        producer = ChildWorker(PRODUCER, namespace=ns)
        try:
            inc = producer.incarnation
            for i in range(4):
                producer.send(make_key(f"v{i}"), np.full(300_000, i, np.uint8), step=1)
            assert reaper.collect_producer(names, PRODUCER, inc, CONSUMER) == 0  # alive
            for i in range(4):
                got = consumer.rendezvous(1).recv(make_key(f"v{i}"), timeout=10)
                assert got.value[0] == i
                del got
            producer.kill(signal.SIGKILL)
        finally:
            producer.close()
        assert set(left(ns)) > mine
        removed = reaper.collect_producer(names, PRODUCER, inc, CONSUMER)
        assert removed >= 3  # its slots, doorbell and record
        assert set(left(ns)) == mine
        # The consumer still works: a new producer run is received as before.
        with ChildWorker(PRODUCER, namespace=ns) as again:
            again.send(make_key("after"), np.full(300_000, 9, np.uint8), step=2)
            assert consumer.rendezvous(2).recv(make_key("after"), timeout=10).value[0] == 9
    assert left(ns) == []


def test_reaper_collect_producer_keeps_other_consumers_messages(ns: str) -> None:
    names = Names(ns)
    other = "/job:worker/replica:0/task:2"
    with shmrdv.Worker(CONSUMER, namespace=ns), shmrdv.Worker(other, namespace=ns) as them:
        producer = ChildWorker(PRODUCER, namespace=ns, shm_pool_bytes=0)
        try:
            inc = producer.incarnation
            key = make_key("theirs", dst=other)
            producer.send(key, np.full(300_000, 5, np.uint8), step=1)
            producer.kill(signal.SIGKILL)
        finally:
            producer.close()
        reaper.collect_producer(names, PRODUCER, inc, CONSUMER)
        assert "m" in kinds(ns)
        assert them.rendezvous(1).recv(key, timeout=10).value[0] == 5


# -- never a live worker's ------------------------------------------------------------------


def _job_loop(ns: str, rounds: int, q: Any) -> None:
    """Start, use and close a two-worker job ``rounds`` times (its namespace dies in between)."""
    try:
        for r in range(rounds):
            with (
                shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
                shmrdv.Worker(PRODUCER, namespace=ns) as producer,
            ):
                out, inbox = producer.rendezvous(r), consumer.rendezvous(r)
                for i, n in enumerate((16, 100_000, 1_200_000)):
                    out.send(make_key(f"k{i}"), np.full(n, r % 250, np.uint8))
                for i in range(3):
                    got = inbox.recv(make_key(f"k{i}"), timeout=10)
                    assert got.value[0] == r % 250 and got.value[-1] == r % 250
                    del got
        q.put("ok")
    except BaseException as e:
        q.put(repr(e))


def test_reaper_leaves_what_a_process_still_has_open(names: Names) -> None:
    # A namespace without a locked record, whose files a process still uses: a worker that
    # is starting (its record written under a temporary name, open and locked, not linked
    # yet), a doorbell a process has open, a segment a process has mapped. "No live record"
    # alone would take them; the reaper asks the kernel whether they are in use.
    import mmap

    import posix_ipc

    starting = names.path(names.temp())
    fd = os.open(starting, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    bell = posix_ipc.Semaphore(names.bell(PRODUCER), posix_ipc.O_CREX, mode=0o600)
    seg_path = names.path(names.message(1, "k", 1, 0))
    seg_fd = os.open(seg_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(seg_fd, 4096)
    mapped = mmap.mmap(seg_fd, 4096)
    os.close(seg_fd)
    try:
        assert collect(names.namespace) == []
        assert os.path.exists(starting) and os.path.exists(seg_path)
        assert os.path.exists(names.bell_path(PRODUCER))
    finally:
        os.close(fd)
        bell.close()
        mapped.close()
    # Nobody uses them any more: the next collection takes them.
    assert len(collect(names.namespace)) == 3
    assert left(names.namespace) == []


def test_reaper_never_touches_a_live_workers_objects_while_sweeps_race(ns: str) -> None:
    # A live pair holds every kind of object (a received array over a pool slot, a message
    # waiting, its ring, pool slots, records, doorbells) while another job starts and closes
    # again and again in its own namespace (dead between rounds), and another process starts
    # and closes Workers (each start and close sweeps) without pause.
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    looping = shmrdv.new_namespace()
    job = ctx.Process(target=_job_loop, args=(looping, 25, q))
    stop = ctx.Event()
    sweeper = ctx.Process(target=_sweep_until, args=(stop,))
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        ChildWorker(PRODUCER, namespace=ns) as producer,
    ):
        producer.send(make_key("held"), np.full(300_000, 1, np.uint8), step=1)
        producer.send(make_key("waiting"), np.full(300_000, 2, np.uint8), step=1)
        producer.send(make_key("small"), np.full(8, 3, np.uint8), step=1)
        held = consumer.rendezvous(1).recv(make_key("held"), timeout=10).value
        before = left(ns)
        job.start()
        sweeper.start()
        try:
            result = q.get(timeout=100)
        finally:
            stop.set()
            sweeper.join(30)
            job.join(30)
        assert result == "ok"
        assert sweeper.exitcode == 0
        assert left(ns) == before
        inbox = consumer.rendezvous(1)
        assert inbox.recv(make_key("waiting"), timeout=10).value[0] == 2
        assert inbox.recv(make_key("small"), timeout=10).value[0] == 3
        assert held[0] == 1
        del held
    assert left(ns) == [] and left(looping) == []


def _sweep_until(stop: Any) -> None:
    while not stop.is_set():
        with shmrdv.Worker("/job:sweeper/replica:0/task:0", namespace=shmrdv.new_namespace()):
            pass


_FLOODED = """
import os, threading, time
import shmrdv
from shmrdv._shm import reaper
from shmrdv._shm.naming import Names

def entries():
    return reaper.entries_read()["sync"]

# What a dead job left, made first: tmpfs lists the newest names first, so a sweep meets
# the flood before it.
dead = Names(shmrdv.new_namespace())
left = [dead.presence("/job:dead/replica:0/task:0"), dead.temp()]
for name in left:
    os.close(os.open("/dev/shm/" + name, os.O_CREAT | os.O_WRONLY, 0o600))
for i in range(JUNK):
    os.close(os.open(f"/dev/shm/junk{i}", os.O_CREAT | os.O_WRONLY, 0o600))
for round in range(2):
    before = entries()
    t0 = time.monotonic()
    w = shmrdv.Worker("/job:w/replica:0/task:0", namespace=shmrdv.new_namespace())
    started = time.monotonic() - t0
    at_start = entries() - before
    assert at_start <= reaper.SYNC_ENTRIES, at_start
    # The rest of the sweep goes on in the background while the Worker lives.
    assert reaper.idle(60), "the background sweep did not finish"
    assert not any(os.path.exists("/dev/shm/" + name) for name in left), os.listdir("/dev/shm")[:5]
    before = entries()
    t0 = time.monotonic()
    w.close()
    closed = time.monotonic() - t0
    at_close = entries() - before
    assert at_close <= reaper.SYNC_ENTRIES, at_close
    assert not [t for t in threading.enumerate() if t.name == "shmrdv-sweeper"]
    print(f"round {round}: start {started * 1000:.1f} ms, {at_start} entries; "
          f"close {closed * 1000:.1f} ms, {at_close} entries")
assert reaper.entries_read()["background"] >= JUNK - reaper.SYNC_ENTRIES
print("child ok")
"""


def test_reaper_a_flooded_dev_shm_costs_start_and_close_a_bounded_listing() -> None:
    # 100,000 junk names (any local user can make them) in a /dev/shm of its own (a
    # private tmpfs, gone with the test): a Worker's start and close each read at most
    # SYNC_ENTRIES directory entries (they listed the whole directory, twice or more).
    # The sweep's other work goes on in a thread of
    # the process, which collects what a dead job left behind the flood and stops with
    # the last Worker's close.
    out = run_with_small_dev_shm(_FLOODED.replace("JUNK", "100_000"), size="64m")
    assert out.count("round") == 2, out


def test_reaper_can_be_turned_off(ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(reaper.ENV_VAR, "0")
    victim = ChildWorker(PRODUCER, namespace=ns)
    try:
        victim.kill(signal.SIGKILL)
    finally:
        victim.close()
    with shmrdv.Worker(CONSUMER, namespace=shmrdv.new_namespace()):
        pass
    assert "w" in kinds(ns)


def _plant_junk(spec: str) -> None:
    directory, names = spec.split("\n", 1)
    for name in names.split("\n"):
        fd = os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (setuid)")
def test_reaper_other_users_junk_namespaces_do_not_stop_the_sweep() -> None:
    # Another user plants shmrdv-shaped names (presence records included) under many fake
    # namespace ids: they are neither opened nor removed, and a dead namespace of ours
    # behind them is still collected.
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(dir=SHM_DIR)  # a directory nobody can reach, as /dev/shm
    os.chmod(directory, 0o1777)
    try:
        _sweep_among_junk(directory)
    finally:
        shutil.rmtree(directory)


def _sweep_among_junk(directory: str) -> None:
    # Ours first: tmpfs lists the newest names first, so the sweep meets the junk first.
    ours = Names(shmrdv.new_namespace())
    for name in (ours.presence(PRODUCER), ours.temp()):
        os.close(os.open(os.path.join(directory, name), os.O_CREAT | os.O_WRONLY, 0o600))
    junk = []
    for _ in range(48):
        fake = Names(shmrdv.new_namespace())
        junk += [fake.presence(PRODUCER), fake.temp(), fake.message(1, "k", 1, 0)]
    run_as_nobody(_plant_junk, directory + "\n" + "\n".join(junk))
    assert len(collect(shm_dir=directory)) == 2
    assert sorted(os.listdir(directory)) == sorted(junk)


def test_reaper_collect_producer_leaves_a_successors_record(names: Names) -> None:
    # A dead run's record is replaced by its successor's: collecting the first run never
    # takes the successor's record, alive or dead.
    record = names.path(names.presence(PRODUCER))
    first = PresenceChild(names, PRODUCER, incarnation=5)
    first.kill()
    second = PresenceChild(names, PRODUCER, incarnation=6)  # replaces the stale record
    try:
        assert reaper.collect_producer(names, PRODUCER, 5, CONSUMER) == 0
        assert reaper.collect_producer(names, PRODUCER, 6, CONSUMER) == 0  # alive
    finally:
        second.kill()
    assert reaper.collect_producer(names, PRODUCER, 5, CONSUMER) == 0
    assert os.path.exists(record)
    assert reaper.collect_producer(names, PRODUCER, 6, CONSUMER) == 1
    assert not os.path.exists(record)


def test_reaper_restarted_producer_frees_its_predecessors_pool(ns: str) -> None:
    # A service restarts a killed producer while its consumer runs on: each dead run left
    # its warm pool slots (up to shm_pool_bytes). The next run of the task frees them at its
    # start; what the dead run sent stays for the consumer.
    with shmrdv.Worker(CONSUMER, namespace=ns) as consumer:
        inbox = consumer.rendezvous(1)
        for run in range(2):
            producer = ChildWorker(PRODUCER, namespace=ns)
            try:
                for i in range(3):
                    producer.send(make_key(f"r{run}-{i}"), np.full(300_000, i, np.uint8), step=1)
                got = inbox.recv(make_key(f"r{run}-0"), timeout=10)
                del got  # its slot goes back to the (soon dead) producer: "returned"
                producer.kill(signal.SIGKILL)
            finally:
                producer.close()
        # The second run's start took the first run's slot; the second run's is left.
        assert kinds(ns).count("r") == 1
        with ChildWorker(PRODUCER, namespace=ns):
            assert kinds(ns).count("p") + kinds(ns).count("r") == 0
            # What the dead runs sent is still the consumer's.
            for run in range(2):
                for i in (1, 2):
                    assert inbox.recv(make_key(f"r{run}-{i}"), timeout=10).value[0] == i


# -- ls and gc: what a dead namespace left, listed and collected by hand --------------------

KEY = (
    "/job:worker/replica:0/task:0/device:CPU:0;0000000000000001;"
    "/job:worker/replica:0/task:1/device:CPU:0;x;0:0"
)


def _fresh() -> Names:
    return Names(secrets.token_hex(13))


def _ours(names: Names, directory: str = SHM_DIR) -> set[str]:
    return {e for e in os.listdir(directory) if names.prefix in e}


@pytest.fixture
def other() -> Iterator[Names]:
    n = _fresh()
    yield n
    for entry in _ours(n):
        os.unlink(os.path.join(SHM_DIR, entry))


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _segments(names: Names, directory: str = SHM_DIR, step_id: int = 3) -> None:
    """A published message with a real header, and an unwritten temp segment."""
    header = build_header(
        key=KEY,
        dtype=np.dtype("<f4"),
        shape=(4,),
        step_id=step_id,
        seq=0,
        producer_incarnation=1,
        producer_pid=4242,
    )
    buf = bytearray(header.segment_size)
    write_header(buf, header)
    _write(os.path.join(directory, names.message(step_id, KEY, 1, 0)), bytes(buf))
    _write(os.path.join(directory, names.temp()), bytes(256))


def _by_kind(infos: list[ObjectInfo]) -> dict[str, ObjectInfo]:
    out = {i.kind: i for i in infos}
    assert len(out) == len(infos)
    return out


def test_reaper_ls_shows_a_live_namespace_gc_keeps_it(names: Names) -> None:
    worker = PresenceChild(names, CONSUMER, incarnation=5)
    bell = Bell.create(names, CONSUMER)
    try:
        _segments(names)
        infos = list_objects(names.namespace)
        kinds = _by_kind(infos)
        assert set(kinds) == {"presence", "bell", "message", "temp"}
        assert all(i.namespace == names.namespace_id and i.alive for i in infos)
        presence = kinds["presence"]
        assert presence.owner_pid == worker.proc.pid and presence.task == CONSUMER
        assert presence.path == names.path(names.presence(CONSUMER))
        assert kinds["bell"].task == CONSUMER and kinds["bell"].owner_pid == worker.proc.pid
        assert kinds["bell"].name == "sem." + names.bell(CONSUMER)[1:]
        message = kinds["message"]
        assert (message.step_id, message.key, message.owner_pid) == (3, KEY, 4242)
        assert message.size >= 64 and 0 <= message.age_s < 60
        temp = kinds["temp"]
        assert (temp.step_id, temp.key, temp.owner_pid) == (None, None, None)

        assert collect(names.namespace) == []
        assert collect(names.namespace, dry_run=True) == []
        assert len(list_objects(names.namespace)) == 4
    finally:
        bell.close()
        bell.unlink()
        worker.stop()
    # The worker's clean exit removed its record; what is left is a dead namespace's.
    removed = collect(names.namespace)
    assert {i.kind for i in removed} == {"message", "temp"}
    assert not _ours(names)


def test_reaper_gc_collects_a_dead_namespace_whole(names: Names, other: Names) -> None:
    worker = PresenceChild(names, CONSUMER, incarnation=5)
    bell = Bell.create(names, CONSUMER)
    bell.close()
    _segments(names)
    worker.kill()  # leaves its presence record, unlocked
    # Another namespace, alive (in this process) and one dead but not asked for.
    live = Presence.publish(
        other, PresenceInfo(CONSUMER, os.getpid(), boot_id(), 1, time.time(), other.namespace)
    )
    third = _fresh()
    _segments(third)
    try:
        _segments(other)
        infos = list_objects(names.namespace)
        assert {i.kind for i in infos} == {"presence", "bell", "message", "temp"}
        assert not any(i.alive for i in infos)
        assert _by_kind(infos)["presence"].owner_pid == worker.proc.pid

        would = collect(names.namespace, dry_run=True)
        assert [i.name for i in would] == [i.name for i in infos]
        assert len(_ours(names)) == 4

        removed = collect(names.namespace)
        assert [i.name for i in removed] == [i.name for i in infos]
        assert not _ours(names)
        assert len(_ours(other)) == 3
        assert len(_ours(third)) == 2
        assert collect(other.namespace) == []
    finally:
        live.close()
        for entry in _ours(third):
            os.unlink(os.path.join(SHM_DIR, entry))


def test_reaper_gc_collects_every_dead_namespace(tmp_path: Path) -> None:
    # A private directory: collect() over every namespace of the real /dev/shm would take
    # other tests' objects.
    directory = str(tmp_path)
    dead, live = _fresh(), _fresh()
    for n in (dead, live):
        _segments(n, directory)
        record = os.path.join(directory, n.presence(CONSUMER))
        _write(record, PresenceInfo(CONSUMER, 1, boot_id(), 1, 0.0, n.namespace).to_json())
    (tmp_path / "unrelated").write_bytes(b"x")
    (tmp_path / "shmrdv_notanamespace").write_bytes(b"x")
    fd = os.open(os.path.join(directory, live.presence(CONSUMER)), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert len(list_objects(shm_dir=directory)) == 6
        removed = collect(shm_dir=directory)
        assert {i.namespace for i in removed} == {dead.namespace_id}
        assert len(removed) == 3
        assert _ours(dead, directory) == set()
        assert len(_ours(live, directory)) == 3
        assert {"unrelated", "shmrdv_notanamespace"} <= set(os.listdir(directory))
    finally:
        os.close(fd)
    assert len(collect(shm_dir=directory)) == 3


def test_reaper_corrupt_record_still_counts_by_lock(tmp_path: Path) -> None:
    directory = str(tmp_path)
    n = _fresh()
    record = os.path.join(directory, n.presence(CONSUMER))
    _write(record, b"not json")
    fd = os.open(record, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        [info] = list_objects(shm_dir=directory)
        assert info.alive is True and info.owner_pid is None and info.task is None
        assert collect(shm_dir=directory) == []
    finally:
        os.close(fd)
    [gone] = collect(shm_dir=directory)
    assert gone.kind == "presence" and gone.alive is False


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_reaper_other_users_objects_untouched(names: Names) -> None:
    _segments(names)
    foreign = names.path(names.message(9, KEY, 1, 1))
    _write(foreign, bytes(64))
    os.chown(foreign, 65534, 65534)
    try:
        assert foreign not in {i.path for i in list_objects(names.namespace)}
        assert {i.kind for i in collect(names.namespace)} == {"message", "temp"}
        assert os.path.exists(foreign)
    finally:
        os.unlink(foreign)


def test_reaper_symlinks_ignored(names: Names, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x")
    link = names.path(names.temp())
    os.symlink(target, link)
    try:
        assert list_objects(names.namespace) == []
        assert collect(names.namespace) == []
        assert os.path.islink(link) and target.exists()
    finally:
        os.unlink(link)


def test_reaper_collect_skips_replaced_file(tmp_path: Path) -> None:
    # A file replaced between the listing and its removal (a worker restarting meanwhile)
    # is not taken: removal compares the inode with the listed one.
    directory = str(tmp_path)
    n = _fresh()
    _segments(n, directory)
    paths = [o.path for o in list_objects(n.namespace, shm_dir=directory)]
    assert len(paths) == 2
    listed = []
    for path in paths:
        st = os.stat(path)
        listed.append((path, (st.st_dev, st.st_ino)))
        _write(path + ".new", b"new")  # a new inode while the old one still exists
        os.rename(path + ".new", path)
    assert not any(unlink_if_unused(path, ino) for path, ino in listed)
    assert len(_ours(n, directory)) == 2
    assert len(collect(shm_dir=directory)) == 2
