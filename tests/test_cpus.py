"""The usable-CPU count that turns the receiver's spin off, and the spin's off rules.

The count is read from files the kernel writes; the first tests lay those files out in a
temporary tree (``usable_cpus(root)`` reads under it), the last ones run a real child in a
real cgroup with a one-CPU quota, and a real idle receiver.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._cpus import cgroup_cpu_limit, usable_cpus

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
"""
V2_MOUNTS = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def lay_out(root: Path, mountinfo: str, cgroup: str, files: dict[str, str]) -> str:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    (root / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_cpus_v2_quota_on_the_own_cgroup_caps_the_count(tmp_path: Path) -> None:
    root = lay_out(
        tmp_path,
        V2_MOUNTS,
        "0::/job/stage\n",
        {
            "sys/fs/cgroup/job/stage/cpu.max": "150000 100000\n",
            "sys/fs/cgroup/job/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_cpu_limit(root) == 1.5
    assert usable_cpus(root) == min(os.cpu_count() or 1, 2)


def test_cpus_v1_quota_on_an_ancestor_counts_rounded_up(tmp_path: Path) -> None:
    root = lay_out(
        tmp_path,
        V1_MOUNTS,
        "5:memory:/job/stage\n4:cpu,cpuacct:/job/stage\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/job/stage/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/job/stage/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n",
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_limit(root) == 0.5
    assert usable_cpus(root) == 1


def test_cpus_the_tightest_of_both_hierarchies_wins(tmp_path: Path) -> None:
    root = lay_out(
        tmp_path,
        V1_MOUNTS + "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
        "4:cpu,cpuacct:/\n0::/a\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/unified/a/cpu.max": "200000 100000\n",
        },
    )
    assert cgroup_cpu_limit(root) == 2.0


def test_cpus_a_container_sees_its_cgroup_as_the_mount_root(tmp_path: Path) -> None:
    """In a cgroup namespace the mount's root is the container's cgroup: the own path is
    read relative to it, and nothing outside it is read."""
    root = lay_out(
        tmp_path,
        "29 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "0::/docker/abc/inner\n",
        {"sys/fs/cgroup/cpu.max": "100000 100000\n", "sys/fs/cgroup/inner/cpu.max": "max 1\n"},
    )
    assert cgroup_cpu_limit(root) == 1.0
    outside = lay_out(
        tmp_path / "outside",
        "29 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "0::/elsewhere\n",
        {"sys/fs/cgroup/cpu.max": "100000 100000\n"},
    )
    assert cgroup_cpu_limit(outside) is None


@pytest.mark.parametrize(
    "cpu_max",
    ["max 100000\n", "", "garbage\n", "0 100000\n", "100000 0\n", "-5 100000\n", "1 2 3\n"],
)
def test_cpus_no_or_malformed_quota_counts_as_none(tmp_path: Path, cpu_max: str) -> None:
    root = lay_out(tmp_path, V2_MOUNTS, "0::/\n", {"sys/fs/cgroup/cpu.max": cpu_max})
    assert cgroup_cpu_limit(root) is None
    assert usable_cpus(root) == (os.cpu_count() or 1)


def test_cpus_missing_proc_files_count_as_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(str(tmp_path)) is None
    assert usable_cpus(str(tmp_path)) == (os.cpu_count() or 1)


def test_cpus_this_machine_reads_without_error() -> None:
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


# -- a real cgroup with a one-CPU quota ---------------------------------------------------


def _cpu_cgroup_dir() -> tuple[Path, dict[str, str]] | None:
    """A directory under which this process may make a cgroup with a CPU quota (v1's
    ``cpu`` hierarchy or v2 with the ``cpu`` controller), with the quota files to write."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        own["v2" if hier == "0" else controllers] = path
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(rest) < 3 or fields[3] != "/":
            continue
        if rest[0] == "cgroup" and "cpu" in rest[2].split(","):
            path = next((p for c, p in own.items() if "cpu" in c.split(",")), None)
            if path is not None:
                quota = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
                return Path(fields[4] + path), quota
        if rest[0] == "cgroup2" and "v2" in own:
            base = Path(fields[4] + own["v2"])
            with contextlib.suppress(OSError):
                if "cpu" in (base / "cgroup.subtree_control").read_text().split():
                    return base, {"cpu.max": "100000 100000"}
    return None


@pytest.fixture
def one_cpu_cgroup() -> Iterator[Path]:
    found = _cpu_cgroup_dir()
    if found is None or os.geteuid() != 0:
        pytest.skip("no cgroup with a CPU quota can be made here")
    base, quota = found
    cg = base / f"shmrdv_test_{os.getpid()}"
    try:
        cg.mkdir()
        for name, value in quota.items():
            (cg / name).write_text(value)
    except OSError as e:
        with contextlib.suppress(OSError):
            cg.rmdir()
        pytest.skip(f"cannot make a cgroup with a CPU quota here: {e}")
    try:
        yield cg
    finally:
        cg.rmdir()  # its one process has exited (the test joins it) or was killed


def answer_pings_in_cgroup(ns: str, cgroup: str, n: int, out: Any) -> None:
    """Spawned child: join ``cgroup`` first, then be the consumer of ``n`` pings."""
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    cpus = usable_cpus()
    with shmrdv.Worker(CONSUMER, namespace=ns) as worker:
        rdv = worker.rendezvous(1)
        for i in range(n):
            got = rdv.recv(make_key(f"ping{i}"), timeout=20).value
            rdv.send(make_key(f"pong{i}", src=CONSUMER, dst=PRODUCER), got)
        shm = worker.stats()["shm"]
        worker.cleanup(1)
    out.put((cpus, shm["spins"], shm["spin_us"]))


@pytest.mark.timeout(120)
def test_cpus_a_job_with_a_one_cpu_quota_never_spins(one_cpu_cgroup: Path) -> None:
    """A receiver whose cgroup allows one CPU at a time does not spin: the sender it waits
    for could not run meanwhile (the spin only delays it)."""
    ns = shmrdv.new_namespace()
    n = 100
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=answer_pings_in_cgroup, args=(ns, str(one_cpu_cgroup), n, out))
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        rdv = producer.rendezvous(1)
        child.start()
        try:
            for i in range(n):
                rdv.send(make_key(f"ping{i}"), np.array([i]))
                assert (
                    rdv.recv(make_key(f"pong{i}", src=CONSUMER, dst=PRODUCER), timeout=30).value[0]
                    == i
                )
            cpus, spins, spin_us = out.get(timeout=30)
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
                child.join(10)
        producer.cleanup(1)
    assert cpus == 1
    assert (spins, spin_us) == (0, 0)


def test_cpus_an_unanswered_wait_turns_the_spin_off() -> None:
    """A receiver that waited a whole tick in vain spins no more until posts come again:
    an idle receiver blocked for 1.2 s (six ticks) spins once, at its first poll. (Its
    producer is up, and silent.)"""
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns),
    ):
        rdv = consumer.rendezvous(1)
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(make_key("never"), timeout=1.2)
        spins = consumer.stats()["shm"]["spins"]
        consumer.cleanup(1)
    if (os.cpu_count() or 1) > 1 and usable_cpus() > 1:
        assert spins == 1
    else:
        assert spins == 0


def test_cpus_posts_turn_the_spin_on_again() -> None:
    """After an unanswered wait, a message that comes by a post starts the spin again."""
    if usable_cpus() < 2:
        pytest.skip("the spin is off where the job has one CPU")
    ns = shmrdv.new_namespace()
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns) as producer,
    ):
        rdv, prdv = consumer.rendezvous(1), producer.rendezvous(1)
        with pytest.raises(shmrdv.DeadlineExceededError):
            rdv.recv(make_key("never"), timeout=0.5)
        before = consumer.stats()["shm"]["spins"]
        got: queue.Queue[int] = queue.Queue()
        timer = threading.Timer(0.3, prdv.send, (make_key("late"), np.array([3])))
        timer.start()
        try:
            got.put(int(rdv.recv(make_key("late"), timeout=10).value[0]))
        finally:
            timer.join(10)
        timer = threading.Timer(0.05, prdv.send, (make_key("next"), np.array([4])))
        timer.start()
        try:
            assert rdv.recv(make_key("next"), timeout=10).value[0] == 4
        finally:
            timer.join(10)
        after = consumer.stats()["shm"]["spins"]
        consumer.cleanup(1)
        producer.cleanup(1)
    assert got.get_nowait() == 3
    assert after > before
