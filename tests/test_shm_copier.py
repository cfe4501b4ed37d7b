"""The parallel copy behind ``send(ndarray)`` of large tensors (``_shm/copier.py``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shmrdv._shm import copier
from shmrdv._shm.copier import PARALLEL_MIN, TAIL, copy_into


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shmrdv-copy-")]


@pytest.mark.parametrize(
    "nbytes",
    [0, 8, PARALLEL_MIN - 8, PARALLEL_MIN, PARALLEL_MIN + 8, 3 * PARALLEL_MIN + 4096 + 24],
)
def test_copy_into_copies_every_byte(nbytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "3")
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 2**63, size=nbytes // 8, dtype=np.int64)
    dst = np.zeros_like(src)
    copy_into(dst, src)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize(
    "dtype", [np.float32, np.bool_, np.complex128, np.dtype([("a", "<i2"), ("b", "<f8")])]
)
def test_copy_into_any_dtype_and_shape(dtype: np.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "2")
    shape = (3, 1 + PARALLEL_MIN // (3 * np.dtype(dtype).itemsize) + 7)
    src = np.frombuffer(
        np.random.default_rng(1).bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype
    ).reshape(shape)
    dst = np.zeros(shape, dtype)
    copy_into(dst, src)
    assert dst.tobytes() == src.tobytes()


def test_non_contiguous_source_is_copied_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "3")
    base = np.arange(2 * PARALLEL_MIN // 4, dtype=np.float32).reshape(-1, 2)
    src = base[:, 1]  # every other element
    dst = np.empty(src.shape, src.dtype)
    copy_into(dst, src)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("threads", ["1", "3"])
def test_almost_runs_once_with_only_the_tail_left(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A large send wakes its consumer from here (producer.py): every byte but the last
    # TAIL is in place then, the tail is not yet, and the copy is whole afterwards.
    monkeypatch.setenv("SHMRDV_COPY_THREADS", threads)
    src = np.arange(3 * PARALLEL_MIN // 8 + 5, dtype=np.float64).reshape(-1, 1)
    dst = np.zeros_like(src)
    seen: list[tuple[bool, bool]] = []

    def almost() -> None:
        d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
        cut = src.nbytes - TAIL
        seen.append((bool(np.array_equal(d[:cut], s[:cut])), not d[cut + 8 :].any()))

    copy_into(dst, src, almost)
    assert seen == [(True, True)]
    assert np.array_equal(dst, src)


def test_almost_is_not_called_for_small_or_strided_copies() -> None:
    calls: list[int] = []
    small = np.ones(PARALLEL_MIN // 8 - 1, np.float64)
    copy_into(np.zeros_like(small), small, lambda: calls.append(1))
    strided = np.ones((2 * PARALLEL_MIN // 8, 2), np.float64)[:, 0]
    out = np.zeros_like(strided)
    copy_into(out, strided, lambda: calls.append(2))
    assert calls == []
    assert out.all()


def test_helper_threads_are_few_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "8")
    assert copier.helpers() == 3  # one less than asked, at most 3
    src = np.ones(2 * PARALLEL_MIN, np.uint8)
    dst = np.zeros_like(src)
    for _ in range(20):
        copy_into(dst, src)
    assert len(_copy_threads()) <= 3
    assert all(t.daemon for t in _copy_threads())


def test_one_thread_means_no_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "1")
    assert copier.helpers() == 0
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "nonsense")  # ignored: the CPUs decide
    assert copier.helpers() == max(0, min(len(os.sched_getaffinity(0)) - 1, 3))


@pytest.mark.timeout(60)
def test_a_forked_child_copies_with_its_own_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "2")
    src = np.arange(3 * PARALLEL_MIN // 8, dtype=np.int64)
    copy_into(np.empty_like(src), src)  # helpers started in this process
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            dst = np.zeros_like(src)
            copy_into(dst, src)  # the parent's helpers do not exist here: would hang
            ok = bool(np.array_equal(dst, src)) and len(_copy_threads()) >= 1
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's copy hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0


_HOLD_ALL_TOKENS = r"""
import fcntl, os, sys
from shmrdv._shm import copier
path = copier.budget_path()
assert path is not None, "no private directory for the budget"
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
for i in range(copier.machine_budget()):
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, i)
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_helpers_share_one_budget_across_processes() -> None:
    """Another process holding every helper token leaves this one plain copies; its death
    gives the tokens back (issue 15 §3: 4 producers on 2 CPUs ran 16 copying threads)."""
    import subprocess
    import sys

    if copier.machine_budget() == 0:
        pytest.skip("one CPU: no helpers at all")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_ALL_TOKENS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "holding"
        assert copier._tokens.take(3, check_load=False) == []
        src = np.arange(2 * PARALLEL_MIN // 8, dtype=np.int64)
        dst = np.zeros_like(src)
        copy_into(dst, src)  # a plain copy, still every byte
        assert np.array_equal(dst, src)
    finally:
        child.kill()
        child.communicate()
    got = copier._tokens.take(3, check_load=False)
    try:
        assert 1 <= len(got) <= copier.machine_budget()
    finally:
        copier._tokens.give(got)


def test_budget_file_lives_in_a_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # $XDG_RUNTIME_DIR if it is this user's and nobody else may write it, else ~/.cache/shmrdv
    # (made 0700); a directory others may write is never used (issue 20 §3).
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert copier.budget_path() == str(runtime / "shmrdv-copiers")
    os.chmod(runtime, 0o1777)  # shared, like /tmp or /dev/shm
    cache = home / ".cache" / "shmrdv"
    assert copier.budget_path() == str(cache) + "/shmrdv-copiers"
    assert (cache.stat().st_mode & 0o777) == 0o700
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert copier.budget_path() == str(cache) + "/shmrdv-copiers"
    os.chmod(home / ".cache", 0o777)
    assert copier.budget_path() is None


def test_budget_without_a_private_directory_is_the_processs_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if copier.machine_budget() == 0:
        pytest.skip("one CPU: no helper budget to take")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setenv("HOME", str(shared))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    tokens = copier._Tokens()
    got = tokens.take(1, check_load=False)
    try:
        assert got == [0] and not tokens.shared
    finally:
        tokens.give(got)


def test_budget_file_loosened_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if copier.machine_budget() == 0:
        pytest.skip("one CPU: no helper budget to take")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = copier.budget_path()
    assert path is not None
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    os.fchmod(fd, 0o644)
    os.close(fd)
    tokens = copier._Tokens()
    got = tokens.take(1, check_load=False)
    tokens.give(got)
    assert not tokens.shared  # not counted on; helpers still run, per process
    os.chmod(path, 0o600)
    tokens = copier._Tokens()
    got = tokens.take(1, check_load=False)
    try:
        assert got == [0] and tokens.shared
    finally:
        tokens.give(got)
