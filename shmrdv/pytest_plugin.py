"""A pytest plugin for testing code built on shmrdv (registered as ``pytest11`` entry ``shmrdv``).

It is loaded through the entry point, but its leak check stays off until ``--shmrdv`` is
given or the ini option ``shmrdv = true`` is set. Fixtures: ``shmrdv_namespace`` (a fresh
namespace token), ``shmrdv_child_worker`` (a factory of Workers running in real child
processes), and, when enabled, the autouse ``shmrdv_leak_check`` (fails a test that
leaves shmrdv objects of a dead namespace in /dev/shm or child processes running) and a
session-wide check. ``shmrdv.testing`` has the conformance battery and ``run_in_worker``.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["child_pids", "leftover_objects"]

SHM_DIR = "/dev/shm"


def leftover_objects(prefix: str = "shmrdv_") -> set[str]:
    """Names in /dev/shm (segments, records, ``sem.`` semaphores) that start with ``prefix``.

    Only names shmrdv makes (``parse_name``) and files of this user count: /dev/shm is
    world-writable, and another user's junk ``shmrdv_...`` files are neither this test's
    leak nor for it to remove. One string parse per entry, one ``lstat`` per shmrdv name.
    """
    from ._shm.naming import parse_name

    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return set()
    uid = os.geteuid()
    out = set()
    for e in entries:
        if not (e.startswith(prefix) or e.startswith("sem." + prefix)) or parse_name(e) is None:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, e), follow_symlinks=False).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        out.add(e)
    return out


def _helper_pids() -> set[int]:
    """Long-lived helpers multiprocessing starts once per process (not a test's leak)."""
    pids: set[int] = set()
    try:
        from multiprocessing import resource_tracker

        pid = getattr(resource_tracker._resource_tracker, "_pid", None)
        if pid:
            pids.add(pid)
    except Exception:  # pragma: no cover - private API moved
        pass
    return pids


def child_pids() -> set[int]:
    """Pids of live (non-zombie) children of this process, from /proc.

    multiprocessing's resource tracker, started by the first ``spawn``, is not counted.
    """
    me = os.getpid()
    out: set[int] = set()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # pragma: no cover
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parens; split after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 2 and int(fields[1]) == me and fields[0] != b"Z":
            out.add(pid)
    return out - _helper_pids()


def wait_clean(
    before_objects: set[str], before_children: set[int], grace: float = 3.0
) -> tuple[set[str], set[int]]:
    """Wait up to ``grace`` seconds for new objects and children to go; return what is left."""
    deadline = time.monotonic() + grace
    collected = False
    while True:
        objs = leftover_objects() - before_objects
        kids = child_pids() - before_children
        if not objs and not kids:
            return objs, kids
        if not collected:
            # Only when something is left: a full collection costs ~10 ms, and most tests
            # leave nothing. It runs finalizers of unreachable Workers and segments.
            gc.collect()
            collected = True
            continue
        if time.monotonic() > deadline:
            return objs, kids
        time.sleep(0.05)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shmrdv")
    group.addoption(
        "--shmrdv",
        action="store_true",
        default=False,
        help="enable shmrdv's fixtures and its leak check (objects in /dev/shm, child processes)",
    )
    parser.addini("shmrdv", "enable the shmrdv plugin (true/false)", type="bool", default=False)


def _enabled(config: pytest.Config) -> bool:
    if getattr(config.option, "shmrdv", False):
        return True
    try:
        return bool(config.getini("shmrdv"))
    except ValueError:  # registered after option parsing (a bare checkout's conftest)
        return False


def _dead_leftovers(names: set[str]) -> set[str]:
    """Those of ``names`` whose namespace has no live worker (a live one still owns its objects)."""
    if not names:
        return set()
    from ._shm.registry import list_objects

    # Judged by namespace, never by name: a live job's pool slot is renamed p -> m -> h -> r
    # and may be missing from any one listing. A name that vanished was cleaned up by its
    # owner; anything else still there, of a namespace nobody runs, is left over.
    live = {o.namespace for o in list_objects() if o.alive}
    return {
        n
        for n in names
        if _namespace_of(n) not in live and os.path.lexists(os.path.join(SHM_DIR, n))
    }


def _namespace_of(name: str) -> str:
    """The namespace id in ``shmrdv_<namespace id>_...`` (or ``sem.shmrdv_...``)."""
    return name.removeprefix("sem.").removeprefix("shmrdv_").split("_", 1)[0]


def _remove(names: set[str]) -> None:
    for name in names:  # so that one leak does not fail every later test
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


@pytest.fixture(scope="session", autouse=True)
def shmrdv_session_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """At the end of the session, nothing the tests created may be left in /dev/shm."""
    if not _enabled(request.config):
        yield
        return
    before = leftover_objects()
    yield
    objs, _ = wait_clean(before, child_pids())
    # Objects of a namespace with a live worker belong to a process still running (another
    # session on this machine); ours are all closed by now.
    dead = _dead_leftovers(objs)
    if dead:
        pytest.fail(
            f"shmrdv leak check: the session left in {SHM_DIR}: {sorted(dead)[:20]}", pytrace=False
        )


@pytest.fixture(autouse=True)
def shmrdv_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it left shmrdv objects in /dev/shm or child processes running.

    Objects of a namespace that still has a live worker (one a longer-lived fixture
    holds) are that worker's, not leaks; the session check catches them at the end.
    """
    if not _enabled(request.config):
        yield
        return
    before_objects, before_children = leftover_objects(), child_pids()
    yield
    deadline = time.monotonic() + 3.0
    while True:
        objs, kids = wait_clean(before_objects, before_children, grace=0.0)
        dead = _dead_leftovers(objs)
        if (not dead and not kids) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if dead:
        problems.append(f"left in {SHM_DIR}: {sorted(dead)[:20]}")
        _remove(dead)
    if kids:
        problems.append(f"child processes still running: {sorted(kids)}")
    if problems:
        pytest.fail("shmrdv leak check: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def shmrdv_namespace() -> str:
    """A fresh namespace token (``shmrdv.new_namespace()``)."""
    from ._namespace import new_namespace

    return new_namespace()


@pytest.fixture
def shmrdv_child_worker(shmrdv_namespace: str) -> Iterator[Callable[..., Any]]:
    """A factory: ``shmrdv_child_worker(task, **worker_kwargs)`` starts a real child process
    holding a ``Worker`` for ``task`` in the test's namespace and returns its
    ``shmrdv.testing.ChildWorker`` handle (send, recv, call, kill, ...). Every child is
    closed at teardown."""
    from ._child import ChildWorker

    children: list[ChildWorker] = []

    def make(task: str, **worker_kwargs: Any) -> ChildWorker:
        worker_kwargs.setdefault("namespace", shmrdv_namespace)
        child = ChildWorker(task, **worker_kwargs)
        children.append(child)
        return child

    yield make
    for child in reversed(children):
        child.close()
