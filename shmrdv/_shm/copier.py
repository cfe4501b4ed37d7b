"""Copy a large array into shared memory with more than one core.

One thread of ``np.copyto`` moves ~10-14 GB/s here (research/peer_numbers.md), which
leaves memory bandwidth unused: a 16 MiB copy split between two threads takes ~0.6 of
the time (numpy releases the GIL while it copies). ``send(ndarray)`` of a large tensor
is therefore split into 1 MiB chunks that the calling thread and a few helper threads
take one at a time (Ray's object store also copies large objects with several threads).

The helpers are daemon threads started at the first large copy (none in a process that
never sends one), at most ``helpers()`` of them per process, shared by every Worker;
a forked child starts its own. Below ``PARALLEL_MIN`` bytes, or for a non-contiguous
source, it is one plain ``np.copyto``.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["PARALLEL_MIN", "copy_into", "helpers"]

#: Below this many bytes a thread handoff costs more than it saves.
PARALLEL_MIN = 4 << 20
_CHUNK = 1 << 20  # a chunk: page-aligned, small enough that a late helper costs little
_MAX_HELPERS = 3


def helpers() -> int:
    """Helper threads a large copy uses (besides the caller): one less than the CPUs this
    process may run on, at most 3; ``SHMRDV_COPY_THREADS=1`` turns them off."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    wanted = os.environ.get("SHMRDV_COPY_THREADS", "")
    if wanted:
        try:
            cpus = max(1, int(wanted))
        except ValueError:
            pass
    return max(0, min(cpus - 1, _MAX_HELPERS))


_EMPTY: npt.NDArray[Any] = np.empty(0, np.uint8)


class _Job:
    """Chunks handed out one at a time: whoever is free takes the next one, so a helper
    that wakes late (a sleeping vCPU can take 100 µs and more to run) only copies less."""

    __slots__ = ("busy", "chunks", "dst", "error", "idle", "lock", "next", "src")

    def __init__(self, dst: npt.NDArray[Any], src: npt.NDArray[Any], chunks: list[slice]) -> None:
        self.dst, self.src, self.chunks = dst, src, chunks
        self.next = 0
        self.busy = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)

    def work(self) -> None:
        """Copy chunks until none is left."""
        while True:
            with self.lock:
                if self.next >= len(self.chunks) or self.error is not None:
                    return
                part = self.chunks[self.next]
                self.next += 1
                self.busy += 1
            try:
                np.copyto(self.dst[part], self.src[part], casting="no")
            except BaseException as e:  # pragma: no cover - same dtype, contiguous
                with self.lock:
                    self.error = e
            finally:
                with self.lock:
                    self.busy -= 1
                    if self.busy == 0:
                        self.idle.notify_all()

    def finish(self) -> None:
        """Stop handing out chunks; wait until no helper is still copying one."""
        with self.lock:
            self.next = len(self.chunks)
            while self.busy:
                self.idle.wait()
            # A helper that takes the job later finds nothing to do; it must not keep the
            # buffers exported either (a segment's mapping cannot close under a view).
            self.dst = self.src = _EMPTY


class _Helpers:
    """The helper threads of this process (recreated in a forked child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()

    def offer(self, job: _Job, n: int) -> None:
        """Let ``n`` helpers join ``job`` (starting them the first time)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the threads stayed with the parent
                self._queue = queue.SimpleQueue()
                self._threads = []
                self._pid = os.getpid()
            while len(self._threads) < n:
                t = threading.Thread(
                    target=self._run,
                    args=(self._queue,),
                    name=f"shmrdv-copy-{len(self._threads)}",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)
            q = self._queue
        for _ in range(n):
            q.put(job)

    @staticmethod
    def _run(q: queue.SimpleQueue[_Job]) -> None:
        while True:
            q.get().work()  # a finished job hands out nothing: returns at once


_helpers = _Helpers()


def copy_into(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """``np.copyto(dst, src, casting="no")``, split across threads when it is large.

    ``dst`` and ``src`` have the same shape and dtype; ``dst`` is C-contiguous. Returns
    once every byte is copied (also when interrupted: no helper writes ``dst`` after).
    """
    nbytes = src.nbytes
    # Size first: every send comes here, and helpers() costs a system call.
    n = 0 if nbytes < PARALLEL_MIN or not src.flags.c_contiguous else helpers()
    if n == 0:
        np.copyto(dst, src, casting="no")
        return
    d = dst.reshape(-1).view(np.uint8)
    s = src.reshape(-1).view(np.uint8)
    chunks = [slice(i, min(i + _CHUNK, nbytes)) for i in range(0, nbytes, _CHUNK)]
    job = _Job(d, s, chunks)
    _helpers.offer(job, n)
    try:
        job.work()
    finally:
        job.finish()
    if job.error is not None:  # pragma: no cover - see _Job.work
        raise job.error
