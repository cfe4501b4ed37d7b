"""The parallel copy behind ``send(ndarray)`` of large tensors (``_shm/producer.py``)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from shmrdv._shm import producer
from shmrdv._shm.producer import PARALLEL_MIN, copy_into


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


def test_helper_threads_are_few_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "8")
    assert producer.helpers() == 3  # one less than asked, at most 3
    src = np.ones(2 * PARALLEL_MIN, np.uint8)
    dst = np.zeros_like(src)
    for _ in range(20):
        copy_into(dst, src)
    assert len(_copy_threads()) <= 3
    assert all(t.daemon for t in _copy_threads())


def test_one_thread_means_no_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "1")
    assert producer.helpers() == 0
    monkeypatch.setenv("SHMRDV_COPY_THREADS", "nonsense")  # ignored: the CPUs decide
    assert producer.helpers() in (0, max(0, min(len(os.sched_getaffinity(0)) - 1, 3)))


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
