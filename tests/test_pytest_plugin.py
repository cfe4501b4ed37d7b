"""The shipped pytest plugin, used the way a user would: pytester runs a user's test file."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

import shmrdv
from shmrdv.testing import ChildWorker, run_in_worker

pytest_plugins = ["pytester"]


def _double(worker: shmrdv.Worker, x: int) -> int:
    return 2 * x + (worker.incarnation > 0)


def _fail(worker: shmrdv.Worker) -> None:
    raise shmrdv.InvalidArgumentError(f"from {worker.task}")


def test_plugin_run_in_worker_returns_and_raises(shmrdv_namespace: str) -> None:
    assert run_in_worker("/job:t/task:0", _double, 20, namespace=shmrdv_namespace) == 41
    with pytest.raises(shmrdv.InvalidArgumentError, match="/job:t/replica:0/task:0"):
        run_in_worker("/job:t/task:0", _fail, namespace=shmrdv_namespace)


def test_plugin_child_worker_fixture_talks_to_parent(
    shmrdv_child_worker, shmrdv_namespace: str
) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    child: ChildWorker = shmrdv_child_worker("/job:t/task:1")
    key = shmrdv.create_key(
        "/job:t/replica:0/task:1/device:CPU:0", 0, "/job:t/replica:0/task:2/device:CPU:0", "e"
    )
    with shmrdv.Worker("/job:t/task:2", namespace=shmrdv_namespace) as w:
        child.send(key, np.arange(5))
        assert w.rendezvous(0).recv(key, timeout=10).value.tolist() == [0, 1, 2, 3, 4]
        w.cleanup(0)


USER_TESTS = """
import os, shmrdv

def test_leaks_a_segment(shmrdv_namespace):
    # A user's bug: an object of a namespace nobody runs any more.
    nsid = shmrdv.namespace_id(shmrdv_namespace)
    fd = os.open(f"/dev/shm/shmrdv_{nsid}_t{'dead' * 5}", os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)

def test_clean(shmrdv_namespace):
    with shmrdv.Worker("/job:u/task:0", namespace=shmrdv_namespace) as w:
        w.rendezvous(0)
"""


@pytest.mark.slow
def test_plugin_leak_check_off_by_default(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    # The leaked object was the user's; remove it.
    import glob
    import os

    for path in glob.glob("/dev/shm/shmrdv_*_t" + "dead" * 5):
        os.unlink(path)


@pytest.mark.slow
def test_plugin_leak_check_fails_the_leaking_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shmrdv")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*shmrdv leak check*tdeaddead*To fix: *"])


UNRECEIVED_TESTS = """
import numpy as np, shmrdv

def test_sends_and_never_receives(shmrdv_namespace):
    # A user's bug: a value for a consumer that never runs stays for it to take.
    key = shmrdv.create_key("/job:u/task:0/cpu:0", 0, "/job:u/task:1/cpu:0", "lost")
    cluster = shmrdv.ClusterSpec({"u": ["127.0.0.1:1", "127.0.0.1:2"]})
    with shmrdv.Worker("/job:u/task:0", namespace=shmrdv_namespace, cluster=cluster) as w:
        w.rendezvous(3).send(key, np.zeros(1 << 20))
"""


@pytest.mark.slow
def test_plugin_leak_check_says_how_to_fix_an_unreceived_value(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(UNRECEIVED_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shmrdv", timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*shmrdv leak check*message of namespace id*To fix: values were sent and never "
            "received: receive them, or call Worker.cleanup(step)*"
        ]
    )


LEAKY_TESTS = """
import multiprocessing, os, subprocess, sys, time
from shmrdv.testing import ChildWorker

def _note(pid):
    with open(os.environ["SHMRDV_TEST_LEAK_PIDS"], "a") as f:
        f.write(f"{pid}\\n")

def test_leaks_children():
    # A user's bugs: children never joined. pytest joins the first at exit; the second
    # would outlive the session.
    p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    p.start()
    q = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # leaked"])
    _note(p.pid)
    _note(q.pid)

def test_leaks_a_dead_worker(shmrdv_namespace):
    child = ChildWorker("/job:u/task:5", namespace=shmrdv_namespace)
    child.kill()  # SIGKILL: its presence record and doorbell stay
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.slow
def test_plugin_ends_leaked_children_and_names_leaked_objects(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("SHMRDV_TEST_LEAK_PIDS", str(pids_file))
    pytester.makepyfile(LEAKY_TESTS)
    t0 = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shmrdv", timeout=150)
    elapsed = time.monotonic() - t0
    pids = [int(p) for p in pids_file.read_text().split()]
    try:
        result.assert_outcomes(passed=2, errors=2)
        result.stdout.fnmatch_lines(
            [
                f"*shmrdv leak check: child processes still running, ended by the leak check: "
                f"{min(pids)} (SIGTERM), {max(pids)} (SIGTERM)*"
            ]
        )
        result.stdout.fnmatch_lines(
            [
                "*left in /dev/shm: *presence of namespace id *, task /job:u/replica:0/task:5, "
                "pid *(shmrdv_*"
            ]
        )
        # Neither outlived the session, nor held up its exit (60 s sleeps).
        assert not [pid for pid in pids if _alive(pid)]
        assert elapsed < 30
    finally:
        for pid in pids:  # what a plugin that only reports leaves running (orphans now)
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                if b"sleep(60)" in cmdline or b"multiprocessing" in cmdline:
                    os.kill(pid, signal.SIGKILL)
