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

Helpers only pay when there are idle CPUs: four producers on a 2-CPU machine, each with
three helpers, ran 16 copying threads on 2 CPUs and got a quarter of one memcpy's
bandwidth (issue 15 §3). So the helpers of all this user's processes share one
machine-wide budget of CPUs - 1 (at most 3): tokens that are byte-range locks on one file
per user. The kernel drops a dead process's locks, so no token is ever lost. A copy takes
the tokens it can get without waiting, and none while the machine's load average says its
CPUs are busy (unless ``SHMRDV_COPY_THREADS`` asks for helpers); with no token it is one
plain copy in the calling thread.

The file lives where no other user can write: ``$XDG_RUNTIME_DIR`` (systemd's
``/run/user/<uid>``), else ``~/.cache/shmrdv``, each used only if it is a directory of
this user (or root) that no group or other user may write. It was
``/dev/shm/.shmrdv-copiers-<uid>``: a predictable name in a world-writable directory,
where another user planted a file and so turned this user's copy helpers off for good
(64 MiB send 4.9 -> 8.6 ms, issue 20 §3). With no private directory at all, the budget
is this process's own (helpers still run, not shared with other processes).

Thread model (``docs/threads.md``): ``copy_into`` runs in the sending thread, which takes
chunks too and returns once every chunk is copied; helpers ("shmrdv-copy-<n>") wait on a
queue for jobs. Tokens are taken without waiting; no lock is held while copying.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .files import OPEN_FLAGS, is_ours

__all__ = ["PARALLEL_MIN", "TAIL", "budget_path", "copy_into", "helpers", "machine_budget"]

_log = logging.getLogger("shmrdv.shm.copier")

#: Below this many bytes a thread handoff costs more than it saves.
PARALLEL_MIN = 4 << 20
#: ``copy_into``'s ``almost`` runs with this much left to copy: about 15-30 µs of copy here,
#: which with the sender's rename and ring notice after it is about what a consumer asleep
#: on another CPU takes to run again (research/peer_numbers.md: 30-70 µs).
TAIL = 256 << 10
_CHUNK = 1 << 20  # a chunk: page-aligned, small enough that a late helper costs little
_MAX_HELPERS = 3


# The CPUs each thread may run on (``sched_getaffinity``: a system call), by thread id:
# (count, ``time.monotonic()`` when counted), counted again after ``_AFFINITY_S``.
_AFFINITY_S = 1.0
_AFFINITY_MAX = 256  # threads remembered
_affinity: dict[int, tuple[int, float]] = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_affinity.clear)  # a child counts its own


def _usable_cpus() -> int:
    """The CPUs the calling thread may run on, counted at most once a second."""
    me = threading.get_ident()
    now = time.monotonic()
    known = _affinity.get(me)
    if known is not None and now - known[1] < _AFFINITY_S:
        return known[0]
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    if len(_affinity) >= _AFFINITY_MAX:
        _affinity.clear()
    _affinity[me] = (cpus, now)
    return cpus


def helpers() -> int:
    """Helper threads a large copy uses (besides the caller): one less than the CPUs this
    thread may run on (counted at most once a second), at most 3;
    ``SHMRDV_COPY_THREADS=1`` turns them off."""
    cpus = _usable_cpus()
    wanted = os.environ.get("SHMRDV_COPY_THREADS", "")
    if wanted:
        try:
            cpus = max(1, int(wanted))
        except ValueError:
            pass
    return max(0, min(cpus - 1, _MAX_HELPERS))


def machine_budget() -> int:
    """Copy helpers all of this user's processes may run at once: CPUs - 1, at most 3."""
    return max(0, min((os.cpu_count() or 1) - 1, _MAX_HELPERS))


_TOKENS_FILE = "shmrdv-copiers"
_TOKENS_OPEN = os.O_RDWR | os.O_CREAT | OPEN_FLAGS


def _private_dir(path: str, *, ours: bool = False) -> bool:
    """Whether ``path`` is a directory (not a symlink) of this user (or, unless ``ours``,
    root) that no group or other user may write: nobody else can plant or swap a file in it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    owners = (os.geteuid(),) if ours else (os.geteuid(), 0)
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid in owners
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def budget_path() -> str | None:
    """Where this user's helper budget file is (see the module docstring), creating
    ``~/.cache/shmrdv`` (mode 0700) if need be; None if there is no private place."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and _private_dir(runtime, ours=True):
        return os.path.join(runtime, _TOKENS_FILE)
    home = os.path.expanduser("~")
    if not os.path.isabs(home):
        return None
    cache = os.path.join(home, ".cache")
    mine = os.path.join(cache, "shmrdv")
    with contextlib.suppress(OSError):
        os.makedirs(mine, mode=0o700, exist_ok=True)
    if _private_dir(home) and _private_dir(cache) and _private_dir(mine, ours=True):
        return os.path.join(mine, _TOKENS_FILE)
    return None


class _Tokens:
    """This process's handle on the machine-wide helper budget (see the module docstring).

    One descriptor per process, kept open: closing any descriptor of the file would drop
    every POSIX lock this process holds on it. A forked child opens its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one copy of this process holds tokens at a time
        self._fd: int | None = None
        self._pid = 0
        #: Whether the budget is shared with this user's other processes (the file opened).
        self.shared = False

    def _open(self) -> int | None:
        if self._pid == os.getpid():
            return self._fd
        self._pid, self._fd = os.getpid(), None
        self.shared = False
        path = budget_path()
        if path is None:
            _log.debug("no private directory for the copy helper budget: this process's own")
            return None
        try:
            fd = os.open(path, _TOKENS_OPEN, 0o600)
        except OSError as e:
            _log.debug("no shared copy helper budget (%s): this process's own", e)
            return None
        st = os.fstat(fd)
        if not is_ours(st):
            # Loosened (a private directory keeps other users out): not ours to count on.
            _log.warning(
                "refusing %s (uid %d, mode 0o%o): the copy helper budget is this process's own",
                path,
                st.st_uid,
                st.st_mode,
            )
            os.close(fd)
            return None
        self._fd = fd
        self.shared = True
        return fd

    def take(self, wanted: int, check_load: bool) -> list[int]:
        """Up to ``wanted`` tokens, without waiting (none when ``check_load`` and the
        machine's CPUs are busy)."""
        if wanted <= 0 or not self._lock.acquire(blocking=False):
            return []
        try:
            budget = machine_budget()
            cpus = os.cpu_count() or 1
            if budget == 0 or (check_load and os.getloadavg()[0] >= cpus):
                self._lock.release()
                return []
            fd = self._open()
            got: list[int] = []
            if fd is None:
                got = list(range(min(wanted, budget)))  # this process's own budget
            else:
                for i in range(budget):
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i)
                    except OSError as e:
                        if e.errno not in (errno.EAGAIN, errno.EACCES):
                            _log.debug("copy token %d: %s", i, e)
                        continue
                    got.append(i)
                    if len(got) == wanted:
                        break
        except BaseException:
            self._lock.release()
            raise
        if not got:
            self._lock.release()
        return got

    def give(self, tokens: list[int]) -> None:
        if not tokens:
            return
        fd = self._fd
        try:
            if fd is not None:
                for i in tokens:
                    with contextlib.suppress(OSError):
                        fcntl.lockf(fd, fcntl.LOCK_UN, 1, i)
        finally:
            self._lock.release()


_tokens = _Tokens()


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


def copy_into(
    dst: npt.NDArray[Any], src: npt.NDArray[Any], almost: Callable[[], object] | None = None
) -> None:
    """``np.copyto(dst, src, casting="no")``, split across threads when it is large.

    ``dst`` and ``src`` have the same shape and dtype; ``dst`` is C-contiguous. Returns
    once every byte is copied (also when interrupted: no helper writes ``dst`` after).

    ``almost``: called once when only the last ``TAIL`` bytes are left to copy, for a
    contiguous copy of ``PARALLEL_MIN`` bytes or more (the sender wakes its consumer then,
    so that the wake-up, tens of µs, runs while the copy ends; not called otherwise).
    """
    if almost is not None and src.nbytes >= PARALLEL_MIN and src.flags.c_contiguous:
        d = dst.reshape(-1).view(np.uint8)
        s = src.reshape(-1).view(np.uint8)
        cut = src.nbytes - TAIL
        _copy(d[:cut], s[:cut])
        almost()
        np.copyto(d[cut:], s[cut:], casting="no")
        return
    _copy(dst, src)


def _copy(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """``copy_into`` without ``almost``."""
    nbytes = src.nbytes
    # Size first: every send comes here, and helpers() reads the clock and the environment.
    n = 0 if nbytes < PARALLEL_MIN or not src.flags.c_contiguous else helpers()
    if n == 0:
        np.copyto(dst, src, casting="no")
        return
    # An explicit SHMRDV_COPY_THREADS is obeyed whatever the load (the budget still holds).
    tokens = _tokens.take(n, check_load=not os.environ.get("SHMRDV_COPY_THREADS"))
    if not tokens:
        np.copyto(dst, src, casting="no")
        return
    try:
        d = dst.reshape(-1).view(np.uint8)
        s = src.reshape(-1).view(np.uint8)
        chunks = [slice(i, min(i + _CHUNK, nbytes)) for i in range(0, nbytes, _CHUNK)]
        job = _Job(d, s, chunks)
        _helpers.offer(job, len(tokens))
        try:
            job.work()
        finally:
            job.finish()
    finally:
        _tokens.give(tokens)
    if job.error is not None:  # pragma: no cover - see _Job.work
        raise job.error
