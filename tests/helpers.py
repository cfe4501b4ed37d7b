"""Helpers shared by the project's tests (fixtures live in conftest.py).

``make_key`` (a key between two tasks' CPUs), ``wait_for`` (poll a condition, bounded),
``free_port`` (a loopback port nobody listens on right now), ``remove_planted`` (clean up
what a test, as root, planted in /dev/shm as user ``NOBODY``), ``PresenceChild`` (a child
process holding a task's presence record, for tests below the Worker), ``reap_popen`` (kill
if need be, reap and close the pipes of a ``subprocess.Popen``), ``run_bench`` (the
``shmrdv bench`` command in a subprocess).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import shmrdv
from shmrdv._shm.naming import SHM_DIR, Names

PRODUCER = "/job:worker/replica:0/task:0"
CONSUMER = "/job:worker/replica:0/task:1"
NOBODY = 65534  # the uid a root test drops to, to act as another local user
#: The checkout these tests are in (``tools/``, ``tests/``, and the default ``shmrdv``).
REPO = Path(__file__).resolve().parents[1]
#: The directory holding the shmrdv package under test, for the children's PYTHONPATH.
SHMRDV_PATH = str(Path(shmrdv.__file__).resolve().parents[1])


def make_key(edge: str, *, src: str = PRODUCER, dst: str = CONSUMER, incarnation: int = 0) -> str:
    """The rendezvous key of ``edge`` from ``src``'s CPU to ``dst``'s CPU."""
    return shmrdv.create_key(f"{src}/device:CPU:0", incarnation, f"{dst}/device:CPU:0", edge)


def wait_for(
    predicate: Callable[[], object],
    timeout: float = 5.0,
    what: str = "the condition",
    interval: float = 0.01,
) -> None:
    """Poll ``predicate`` every ``interval`` s until it is true; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:g}s"
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fork_as_nobody(fn: Callable[[str], None], arg: str) -> int:
    """Start ``fn(arg)`` in a forked child that first drops to uid/gid ``NOBODY`` (another
    local user, for a test running as root); return its pid (the caller waits for it)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn(arg)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def run_as_nobody(fn: Callable[[str], None], arg: str) -> None:
    """``fork_as_nobody`` and wait: fails the test if ``fn`` raised."""
    _, status = os.waitpid(fork_as_nobody(fn, arg), 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child acting as another user failed"


def remove_planted(namespace: str, uid: int = NOBODY) -> None:
    """Unlink the objects of ``namespace`` in /dev/shm that belong to ``uid``.

    A test running as root plants objects as another user; ``gc`` never removes another
    user's objects, so the test removes them itself before collecting the rest.
    """
    prefix = Names(namespace).prefix
    for entry in os.listdir(SHM_DIR):
        path = os.path.join(SHM_DIR, entry)
        if prefix in entry and os.stat(path, follow_symlinks=False).st_uid == uid:
            os.unlink(path)


def run_bench(
    *args: str, timeout: float = 50, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m shmrdv bench *args`` to its end (at most ``timeout`` s), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "shmrdv", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def reap_popen(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Kill ``proc`` if it still runs, wait for it (``timeout`` s) and close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


# A worker stand-in: publishes a task's presence, says "ready", lives until its stdin closes.
# mode "fork": first forks a grandchild that also lives until stdin closes (and reports its
# pid). mode "forkexit": forks a grandchild that exits normally at once (running its atexit
# finalizers), then reports whether the record survived that.
_PRESENCE_CHILD = r"""
import os, sys, time
from shmrdv._shm.naming import Names
from shmrdv._shm.presence import Monitor, Presence, PresenceInfo, boot_id
ns, task, inc, mode = sys.argv[1:5]
names = Names(ns)
info = PresenceInfo(task, os.getpid(), boot_id(), int(inc), time.time(), ns, None)
p = Presence.publish(names, info)
extra = ""
if mode == "fork":
    pid = os.fork()
    if pid == 0:
        sys.stdin.read()
        os._exit(0)
    extra = str(pid)
elif mode == "forkexit":
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    os.waitpid(pid, 0)
    with Monitor(names) as m:
        extra = m.state(task).state
print("ready", extra, flush=True)
sys.stdin.read()
p.close()
"""


class PresenceChild:
    """A child process publishing ``task``'s presence record in ``names`` (``_PRESENCE_CHILD``);
    always reaped (and killed if need be) by ``stop``.

    A plain interpreter rather than ``shmrdv._procs.Child``: its clean exit must run the
    ``atexit`` hooks (``weakref.finalize`` included), which a multiprocessing child skips
    (it leaves through ``os._exit``), so that mode ``forkexit`` tests what a normal exit does.
    """

    def __init__(self, names: Names, task: str, incarnation: int = 1, mode: str = "plain") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PRESENCE_CHILD, names.namespace, task, str(incarnation), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=SHMRDV_PATH),
        )
        self.extra = self._ready()

    def _ready(self, timeout: float = 10.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.stop()
            raise AssertionError("child did not get ready")
        line = self.proc.stdout.readline().decode()
        if not line.startswith("ready"):
            self.stop()
            raise AssertionError(f"child said {line!r}, rc={self.proc.poll()}")
        return line.split(" ", 1)[1].strip()

    def stop(self) -> int:
        """Close its stdin (a clean exit), kill it if it lingers; return the exit code."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            rc = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(5)
        self.proc.stdout.close()
        return rc

    def kill(self) -> None:
        """SIGKILL it (its record stays behind), reap it and close its pipes."""
        self.proc.kill()
        self.proc.wait(5)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.stdout.close()
