"""The pytest plugin for code built on shmrdv (``pytest11`` entry point ``shmrdv``).

Fixtures ``shmrdv_namespace`` (a fresh token) and ``shmrdv_child_worker`` (a factory of
``ChildWorker``s, closed at teardown). With ``--shmrdv`` or ini ``shmrdv = true``, a leak
check fails a test, or the session, that leaves objects of a dead namespace in /dev/shm
(then removes them) or child processes running (then ends them by pidfd), saying how to
fix it. Thread model (``docs/threads.md``): it starts no threads.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from ._cluster import new_namespace
from ._procs import ChildWorker
from ._shm.naming import SHM_DIR, parse_name
from ._shm.reaper import ObjectInfo, list_objects, object_names, unlink_if_unused

__all__ = ["shmrdv_child_worker", "shmrdv_namespace"]


def _is_live_child(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) child of this process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) state ppid ...": comm may hold spaces and parens; split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return len(fields) >= 2 and int(fields[1]) == os.getpid() and fields[0] != b"Z"


def _children() -> set[int]:
    """Live children of this process, but multiprocessing's resource tracker (started by the
    first ``spawn``, it lives as long as this process)."""
    from multiprocessing import resource_tracker

    tracker = getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)
    pids = (int(p) for p in os.listdir("/proc") if p.isdigit())
    return {pid for pid in pids if pid != tracker and _is_live_child(pid)}


def _end(pids: Iterable[int]) -> dict[int, str]:
    """SIGTERM those of ``pids`` still live children of this process, SIGKILL them 2 s later;
    how each ended. Through a pidfd taken before the pid is checked to be our child, so a
    reused pid is never signalled; their owners reap them."""
    how = dict.fromkeys(pids, "gone")
    fds: dict[int, int] = {}
    for pid in sorted(how):
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(pid)
            if _is_live_child(pid):  # checked after the pidfd pins the process
                fds[pid] = fd
            else:
                os.close(fd)
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + 2.0
            for pid, fd in fds.items():
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, sig)
                how[pid] = sig.name
            for pid, fd in list(fds.items()):
                exited = select.poll()  # a pidfd is readable once its process exited
                exited.register(fd, select.POLLIN)
                if exited.poll(max(0.0, deadline - time.monotonic()) * 1000):
                    os.close(fds.pop(pid))
        how.update((pid, "still running") for pid in fds)
    finally:
        for fd in fds.values():
            os.close(fd)
    return how


def _dead_leftovers(names: set[str]) -> tuple[set[str], list[ObjectInfo]]:
    """Those of ``names`` still there whose namespace has no live worker, and the listing."""
    if not names:
        return set(), []
    # Judged by namespace, never by name: a live job's pool slot is renamed as it goes and
    # may be missing from any one listing.
    listing = list_objects()
    live = {o.namespace for o in listing if o.alive}
    dead = {
        n
        for n in names
        if (p := parse_name(n)) and p.namespace not in live and os.path.lexists(f"{SHM_DIR}/{n}")
    }
    return dead, listing


def _leftovers(
    objects: set[str], children: set[int], grace: float
) -> tuple[set[str], list[ObjectInfo], set[int]]:
    """Wait up to ``grace`` s for new objects of dead namespaces and new children to go;
    what is left, and the listing that judged it."""
    deadline = time.monotonic() + grace
    collected = False
    while True:
        dead, listing = _dead_leftovers(object_names() - objects)
        kids = _children() - children
        if (not dead and not kids) or time.monotonic() > deadline:
            return dead, listing, kids
        if not collected:
            # Only when something is left (a full collection takes a while): it runs the
            # finalizers of unreachable Workers and segments.
            gc.collect()
            collected = True
        else:
            time.sleep(0.05)


def _left_in_shm(names: set[str], listing: list[ObjectInfo]) -> str:
    """The leaked ``names`` (kind, namespace id, key, step, task, pid), and how to fix it."""
    known = {o.name: o for o in listing}
    shown = []
    for name in sorted(names)[:20]:
        if (o := known.get(name)) is None:
            shown.append(name)  # not in the listing (renamed meanwhile): the name says the rest
            continue
        details = [("key", None if o.key is None else repr(o.key)), ("step", o.step_id)]
        details += [("task", o.task), ("pid", o.owner_pid)]
        said = "".join(f", {what} {value}" for what, value in details if value is not None)
        shown.append(f"{o.kind} of namespace id {o.namespace}{said} ({name})")
    kinds = {o.kind for o in listing if o.name in names}
    fixes = []
    if kinds & {"message", "ring"}:
        fixes.append(
            "values were sent and never received: receive them, or call "
            "Worker.cleanup(step) on the consumer's Worker for the step they were sent in"
        )
    if kinds - {"message", "ring"} or not kinds:
        fixes.append(
            "a Worker was not closed: close every Worker the test makes "
            "(use 'with shmrdv.Worker(...) as w:')"
        )
    return f"left in {SHM_DIR}: {'; '.join(shown)}. To fix: {'; '.join(fixes)}."


def _remove(names: set[str]) -> None:
    """Remove the leaked ``names`` (by the reaper's rule), so that one leak does not fail
    every later test."""
    for name in names:
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            unlink_if_unused(path, (st.st_dev, st.st_ino), mapped_ok=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shmrdv")
    group.addoption(
        "--shmrdv",
        action="store_true",
        default=False,
        help="enable shmrdv's leak check (objects in /dev/shm, child processes)",
    )
    parser.addini("shmrdv", "enable the shmrdv leak check (true/false)", type="bool", default=False)


def _enabled(config: pytest.Config) -> bool:
    if getattr(config.option, "shmrdv", False):
        return True
    try:
        return bool(config.getini("shmrdv"))
    except ValueError:  # registered after option parsing (a bare checkout's conftest)
        return False


@pytest.fixture(scope="session", autouse=True)
def shmrdv_session_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """At the end of the session, nothing the tests created may be left in /dev/shm."""
    if not _enabled(request.config):
        yield
        return
    before = object_names()
    yield
    # A namespace with a live worker now is another session's: ours are all closed.
    dead, listing, _ = _leftovers(before, _children(), grace=3.0)
    if dead:
        pytest.fail(f"shmrdv leak check: the session {_left_in_shm(dead, listing)}", pytrace=False)


@pytest.fixture(autouse=True)
def shmrdv_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it left shmrdv objects of a dead namespace in /dev/shm or child
    processes running (a live namespace's objects are left to the session check)."""
    if not _enabled(request.config):
        yield
        return
    objects, children = object_names(), _children()
    yield
    dead, listing, kids = _leftovers(objects, children, grace=3.0)
    problems = []
    if kids:
        # Ended, not only reported: a leaked multiprocessing child holds up pytest's exit
        # (its atexit joins it), and any other outlives the session.
        how = _end(kids)
        ended = ", ".join(f"{pid} ({how[pid]})" for pid in sorted(kids))
        problems.append(
            f"child processes still running, ended by the leak check: {ended} (join or stop "
            "every process the test starts, e.g. a ChildWorker in a with block)"
        )
        # What an ended child left of a namespace nobody runs now is left over too.
        dead, listing, _ = _leftovers(objects, _children(), grace=1.0)
    if dead:
        problems.append(_left_in_shm(dead, listing))
        _remove(dead)
    if problems:
        pytest.fail("shmrdv leak check: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def shmrdv_namespace() -> str:
    """A fresh namespace token (``shmrdv.new_namespace()``)."""
    return new_namespace()


@pytest.fixture
def shmrdv_child_worker(shmrdv_namespace: str) -> Iterator[Callable[..., ChildWorker]]:
    """``shmrdv_child_worker(task, **worker_kwargs)``: a ``ChildWorker`` for ``task`` in the
    test's namespace, closed at teardown."""
    children: list[ChildWorker] = []

    def make(task: str, **worker_kwargs: Any) -> ChildWorker:
        worker_kwargs.setdefault("namespace", shmrdv_namespace)
        children.append(ChildWorker(task, **worker_kwargs))
        return children[-1]

    yield make
    for child in reversed(children):
        child.close()
