"""When the reaper's work runs: a bounded share at once, the rest in a thread of the process.

/dev/shm is world-writable: another local user can fill it with any number of names, and
a listing of 300,000 names takes longer than a Worker may take to start or close. So the
directory is read a bounded number of entries at a time (``DirScan``: ``os.scandir``, the
names grouped by namespace id as they come), and the reaper's jobs run over the names once
they are all read:

* ``run`` (a Worker's start or close, a consumer done with a producer run) reads at most
  ``SYNC_ENTRIES`` entries and runs the jobs for at most about ``SYNC_SECONDS``: a
  directory of usual size is swept then and there, as before;
* what remains (the rest of the directory, a job that a bound stopped) goes to one
  background thread per process, which reads ``_SLICE_ENTRIES`` entries at a time with a
  pause between two slices, then runs the jobs again until each is done or makes no
  progress. It lives while a Worker of this process does (``use`` / ``done_using``): the
  last Worker's close stops it, and whatever it had not done is left to the next sweep.

Jobs are the reaper's (``reaper.py``): ``job(groups, deadline)`` does what it can over
the listing's ``groups`` (namespace id -> names) before ``deadline`` (``time.monotonic``)
and says whether it is done; called again with the same groups, it goes on where it
stopped.

Thread model (docs/threads.md): any thread may call ``run``, ``use`` and
``done_using``; the background thread is the only one that reads a listing handed to it.
One lock guards the queue, the counters and the thread's handle; no job runs under it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

from .._cluster import NAMESPACE_ID_HEX
from .naming import PREFIX, SEM_PREFIX, SHM_DIR

__all__ = [
    "SYNC_ENTRIES",
    "SYNC_SECONDS",
    "DirScan",
    "Groups",
    "Job",
    "done_using",
    "entries_read",
    "idle",
    "run",
    "use",
]

_log = logging.getLogger("shmrdv.shm.reaper")

#: A Worker's start or close reads at most this many directory entries itself...
SYNC_ENTRIES = 16384
#: ...and spends at most about this long on the reaper's jobs (listing, then removing).
SYNC_SECONDS = 0.02
# The background thread starts this long after it is asked to (the Worker that asked is
# still starting), then reads this many entries at a time and pauses between two slices
# at least this long, and as long as the slice took (the process's other threads run
# meanwhile).
_FIRST_PAUSE = 0.05
_SLICE_ENTRIES = 4096
_SLICE_PAUSE = 0.005
# A background run of the jobs takes at most about this long before it pauses.
_RUN_SECONDS = 0.02
# Directory entries read between two looks at the clock.
_CLOCK_EVERY = 256
# What names of semaphores (doorbells) start with.
_SEM_NAMES = SEM_PREFIX + PREFIX

#: A listing: namespace id -> the shmrdv-looking names of that namespace (as listed).
Groups = dict[str, list[str]]
#: ``job(groups, deadline)``: do what it can before ``deadline``; True once done.
Job = Callable[[Groups, float], bool]


class DirScan:
    """The shmrdv-looking names of ``shm_dir`` by namespace id (string slicing only: names
    are parsed later, and only where it matters), read a bounded number of entries at a
    time. Not thread-safe: one reader at a time."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self.groups: Groups = defaultdict(list)
        self.done = False
        self._it: Iterator[os.DirEntry[str]] | None = None

    def read(self, max_entries: float, deadline: float) -> int:
        """Read up to ``max_entries`` more entries, fewer if ``deadline`` (``time.monotonic``)
        passes first; return how many were read (``done`` tells whether that was the last)."""
        if self.done:
            return 0
        if self._it is None:
            try:
                self._it = os.scandir(self.shm_dir)
            except OSError:
                self.done = True
                return 0
        groups = self.groups
        plain, sem = len(PREFIX), len(SEM_PREFIX) + len(PREFIX)
        id_len = NAMESPACE_ID_HEX
        n = 0
        try:
            for entry in self._it:
                name = entry.name
                if name.startswith(PREFIX):
                    groups[name[plain : plain + id_len]].append(name)
                elif name.startswith(_SEM_NAMES):
                    groups[name[sem : sem + id_len]].append(name)
                n += 1
                if n >= max_entries or (n % _CLOCK_EVERY == 0 and time.monotonic() > deadline):
                    return n
        except OSError as e:  # the directory went away meanwhile: what was read stands
            _log.debug("listing %s: %s", self.shm_dir, e)
        self.done = True
        self.close()
        return n

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None:
            it.close()  # type: ignore[attr-defined]  # os.scandir's iterator


class _Background:
    """The process's background sweeps (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.queue: list[tuple[DirScan | None, list[Job]]] = []
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.stop_now = threading.Event()  # set by ``stop``: its pauses end at once
        self.pid = os.getpid()
        self.read = {"sync": 0, "background": 0}

    def submit(self, scan: DirScan | None, jobs: list[Job]) -> bool:
        """Queue ``jobs`` (with the listing ``scan`` begun, if any); False (nothing queued)
        while no Worker of this process uses sweeps."""
        with self.lock:
            self._after_fork()
            if self.users <= 0 or self.stopping:
                return False
            if self.queue:
                # Work that has not started yet lists the directory after this request: it
                # takes these jobs too (one more pass over a flooded directory costs).
                self.queue[-1][1].extend(jobs)
                if scan is not None:
                    scan.close()
                return True
            self.queue.append((scan, jobs))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._loop, name="shmrdv-sweeper", daemon=True
                )
                self.thread.start()
            return True

    def _after_fork(self) -> None:
        """(Under the lock) a fork child has no thread of its parent's, nor its users."""
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.users = 0
            self.queue = []
            self.thread = None
            self.stopping = False
            self.stop_now = threading.Event()

    def _loop(self) -> None:
        self.stop_now.wait(_FIRST_PAUSE)
        while True:
            with self.lock:
                if self.stopping or not self.queue:
                    self.thread = None
                    for scan, _ in self.queue:
                        if scan is not None:
                            scan.close()
                    self.queue = []
                    return
                scan, jobs = self.queue.pop(0)
            try:
                self._work(scan or DirScan(), jobs)
            except Exception:  # pragma: no cover - jobs never raise for what they find
                _log.exception("background sweep of /dev/shm")

    def _work(self, scan: DirScan, jobs: list[Job]) -> None:
        try:
            while not scan.done:
                if self.stopping:
                    return
                t0 = time.monotonic()
                n = scan.read(_SLICE_ENTRIES, t0 + _RUN_SECONDS)
                self.count("background", n)
                self._pause(t0)
        finally:
            scan.close()
        while jobs and not self.stopping:
            t0 = time.monotonic()
            jobs = [job for job in jobs if not job(scan.groups, t0 + _RUN_SECONDS)]
            if jobs:
                self._pause(t0)

    def _pause(self, since: float) -> None:
        """Pause at least as long as the slice that began at ``since`` took: the sweeps
        take at most half of what the process could run meanwhile."""
        self.stop_now.wait(max(_SLICE_PAUSE, time.monotonic() - since))

    def count(self, where: str, n: int) -> None:
        with self.lock:
            self.read[where] += n

    def stop(self) -> None:
        """Stop the thread (after its current slice) and wait for it."""
        with self.lock:
            thread = self.thread
            if thread is None:
                return
            self.stopping = True
            self.stop_now.set()
        thread.join()
        with self.lock:
            self.stopping = False
            self.stop_now.clear()


_BACKGROUND = _Background()


def use() -> None:
    """A Worker of this process starts using sweeps (its start)."""
    with _BACKGROUND.lock:
        _BACKGROUND._after_fork()
        _BACKGROUND.users += 1


def done_using() -> None:
    """A Worker of this process is done with sweeps (its close, after its last ``run``): the
    last one stops the background thread, and what it had not done is left to later sweeps."""
    with _BACKGROUND.lock:
        _BACKGROUND._after_fork()
        _BACKGROUND.users -= 1
        last = _BACKGROUND.users <= 0
    if last:
        _BACKGROUND.stop()


def run(jobs: list[Job], shm_dir: str = SHM_DIR) -> bool:
    """Run ``jobs`` over a listing of ``shm_dir``, within ``SYNC_ENTRIES`` entries read and
    about ``SYNC_SECONDS`` spent here; hand what remains to the background thread. Returns
    whether everything was done here."""
    start = time.monotonic()
    scan = DirScan(shm_dir)
    n = scan.read(SYNC_ENTRIES, start + SYNC_SECONDS)
    _BACKGROUND.count("sync", n)
    if not scan.done:
        if not _BACKGROUND.submit(scan, jobs):
            scan.close()
        return False
    deadline = max(time.monotonic(), start + SYNC_SECONDS / 2) + SYNC_SECONDS / 2
    left = [job for job in jobs if not job(scan.groups, deadline)]
    if left:
        # A bound stopped them: the background lists again (the directory changes).
        _BACKGROUND.submit(None, left)
        return False
    return True


def entries_read() -> dict[str, int]:
    """Directory entries this process's sweeps have read: ``sync`` by the calls of ``run``
    (a Worker's start and close), ``background`` by the background thread."""
    with _BACKGROUND.lock:
        return dict(_BACKGROUND.read)


def idle(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the background thread to have nothing left to do;
    whether it has (for tests and tools: the sweeps' work is never waited for otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        with _BACKGROUND.lock:
            thread = _BACKGROUND.thread
        if thread is None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        thread.join(min(left, 0.05))
