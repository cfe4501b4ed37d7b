"""A pytest plugin for testing code built on shmrdv (registered as ``pytest11`` entry ``shmrdv``).

It is loaded through the entry point, but its leak check stays off until ``--shmrdv`` is
given or the ini option ``shmrdv = true`` is set. Fixtures: ``shmrdv_namespace`` (a fresh
namespace token), ``shmrdv_child_worker`` (a factory of Workers running in real child
processes), and, when enabled, the autouse ``shmrdv_leak_check`` (fails a test that
leaves shmrdv objects of a dead namespace in /dev/shm or child processes running) and a
session-wide check. Leaked objects are named by namespace id, kind and, where their
header or record tells, key, step, task and pid; leaked children are ended (SIGTERM,
then SIGKILL; only those, by pid), so that none outlives the session or holds up its
exit. ``shmrdv.testing`` has the conformance battery and ``run_in_worker``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ._shm.registry import ObjectInfo

__all__ = ["child_pids", "describe_objects", "end_children", "how_to_fix", "leftover_objects"]

SHM_DIR = "/dev/shm"
# How long a leaked child has to exit after SIGTERM (a Worker in it closes), then SIGKILL.
_TERM_GRACE_S = 2.0
_KILL_WAIT_S = 2.0


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


def child_pids() -> set[int]:
    """Pids of live (non-zombie) children of this process, from /proc.

    multiprocessing's resource tracker, started by the first ``spawn``, is not counted.
    """
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # pragma: no cover
        return set()
    return {pid for pid in pids if _is_live_child(pid)} - _helper_pids()


def _wait_exits(fds: dict[int, int], timeout: float) -> None:
    """Wait up to ``timeout`` s until every pidfd in ``fds`` (pid -> fd) is readable
    (its process exited); drop those from ``fds``."""
    deadline = time.monotonic() + timeout
    while fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        poller = select.poll()
        for fd in fds.values():
            poller.register(fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(left * 1000)}
        for pid in [p for p, fd in fds.items() if fd in ready]:
            os.close(fds.pop(pid))


def end_children(pids: Sequence[int] | set[int]) -> dict[int, str]:
    """End those of ``pids`` that are still live children of this process; say how.

    Each gets SIGTERM (a shmrdv child then closes its Worker), and SIGKILL if it is still
    running ``_TERM_GRACE_S`` later. Signals go through a pidfd taken while the pid was
    checked to be our child, so a pid reused meanwhile is never signalled. The exited
    children are not reaped: their owners (a ``multiprocessing.Process``, a ``Popen``) do
    that. Returns pid -> ``"SIGTERM"``, ``"SIGKILL"``, ``"gone"`` or ``"still running"``.
    """
    how: dict[int, str] = {}
    fds: dict[int, int] = {}
    for pid in sorted(pids):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            how[pid] = "gone"
            continue
        if not _is_live_child(pid):  # checked after the pidfd pins the process
            os.close(fd)
            how[pid] = "gone"
            continue
        fds[pid] = fd
    try:
        for sig, wait in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, _KILL_WAIT_S)):
            for pid, fd in fds.items():
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, sig)
                how[pid] = sig.name
            _wait_exits(fds, wait)
        for pid in fds:
            how[pid] = "still running"
    finally:
        for fd in fds.values():
            os.close(fd)
    return how


def how_to_fix(names: set[str], listing: list[ObjectInfo]) -> str:
    """What to change in a test that left ``names`` behind, by the kinds among them."""
    kinds = {o.kind for o in listing if o.name in names}
    fixes = []
    if "message" in kinds or "ring" in kinds:
        fixes.append(
            "values were sent and never received: receive them, or call "
            "Worker.cleanup(step) on the consumer's Worker for the step they were sent in"
        )
    if kinds - {"message", "ring"} or not kinds:
        fixes.append(
            "a Worker was not closed: close every Worker the test makes "
            "(use 'with shmrdv.Worker(...) as w:')"
        )
    return "To fix: " + "; ".join(fixes) + "."


def describe_objects(names: set[str], listing: list[ObjectInfo] | None = None) -> list[str]:
    """Each of ``names`` (entries of /dev/shm) as "<kind> of namespace id <id>", with the
    key, step, task and pid where its header or record says them, and the raw name.

    ``listing`` is a ``list_objects()`` taken beforehand (one is taken if None).
    """
    from ._shm.naming import parse_name

    if listing is None:
        from ._shm.registry import list_objects

        listing = list_objects()
    known = {o.name: o for o in listing}
    out = []
    for name in sorted(names):
        info = known.get(name)
        parsed = parse_name(name)
        if info is not None:
            kind, ns = info.kind, info.namespace
        elif parsed is not None:
            kind, ns = parsed.kind, parsed.namespace
        else:
            out.append(name)
            continue
        parts = [f"{kind} of namespace id {ns}"]
        if info is not None:
            if info.key is not None:
                parts.append(f"key {info.key!r}")
            if info.step_id is not None:
                parts.append(f"step {info.step_id}")
            if info.task is not None:
                parts.append(f"task {info.task}")
            if info.owner_pid is not None:
                parts.append(f"pid {info.owner_pid}")
        out.append(", ".join(parts) + f" ({name})")
    return out


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


def _dead_leftovers(names: set[str]) -> tuple[set[str], list[ObjectInfo]]:
    """Those of ``names`` whose namespace has no live worker (a live one still owns its
    objects), and the listing that judged them."""
    if not names:
        return set(), []
    from ._shm.registry import list_objects

    # Judged by namespace, never by name: a live job's pool slot is renamed p -> m -> h -> r
    # and may be missing from any one listing. A name that vanished was cleaned up by its
    # owner; anything else still there, of a namespace nobody runs, is left over.
    listing = list_objects()
    live = {o.namespace for o in listing if o.alive}
    dead = {
        n
        for n in names
        if _namespace_of(n) not in live and os.path.lexists(os.path.join(SHM_DIR, n))
    }
    return dead, listing


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
    dead, listing = _dead_leftovers(objs)
    if dead:
        pytest.fail(
            f"shmrdv leak check: the session left in {SHM_DIR}: "
            f"{'; '.join(describe_objects(dead, listing)[:20])}. {how_to_fix(dead, listing)}",
            pytrace=False,
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
    dead, listing, kids = _wait_leftovers(before_objects, before_children, grace=3.0)
    problems = []
    if kids:
        # Ended, not only reported: a leaked multiprocessing child holds up pytest's exit
        # (its atexit joins it), and any other outlives the session.
        how = end_children(kids)
        ended = ", ".join(f"{pid} ({how[pid]})" for pid in sorted(kids))
        problems.append(
            f"child processes still running, ended by the leak check: {ended} (join or stop "
            "every process the test starts, e.g. a ChildWorker in a with block)"
        )
        # What an ended child left of a namespace nobody runs now is left over too.
        dead, listing, _ = _wait_leftovers(before_objects, child_pids(), grace=1.0)
    if dead:
        shown = describe_objects(dead, listing)
        problems.append(f"left in {SHM_DIR}: {'; '.join(shown[:20])}. {how_to_fix(dead, listing)}")
        _remove(dead)
    if problems:
        pytest.fail("shmrdv leak check: " + "; ".join(problems), pytrace=False)


def _wait_leftovers(
    before_objects: set[str], before_children: set[int], grace: float
) -> tuple[set[str], list[ObjectInfo], set[int]]:
    """Wait up to ``grace`` s for new objects (of dead namespaces) and children to go;
    return the objects left, the listing that judged them, and the children left."""
    deadline = time.monotonic() + grace
    while True:
        objs, kids = wait_clean(before_objects, before_children, grace=0.0)
        dead, listing = _dead_leftovers(objs)
        if (not dead and not kids) or time.monotonic() > deadline:
            return dead, listing, kids
        time.sleep(0.05)


@pytest.fixture
def shmrdv_namespace() -> str:
    """A fresh namespace token (``shmrdv.new_namespace()``)."""
    from ._cluster import new_namespace

    return new_namespace()


@pytest.fixture
def shmrdv_child_worker(shmrdv_namespace: str) -> Iterator[Callable[..., Any]]:
    """A factory: ``shmrdv_child_worker(task, **worker_kwargs)`` starts a real child process
    holding a ``Worker`` for ``task`` in the test's namespace and returns its
    ``shmrdv.testing.ChildWorker`` handle (send, recv, call, kill, ...). Every child is
    closed at teardown."""
    from ._procs import ChildWorker

    children: list[ChildWorker] = []

    def make(task: str, **worker_kwargs: Any) -> ChildWorker:
        worker_kwargs.setdefault("namespace", shmrdv_namespace)
        child = ChildWorker(task, **worker_kwargs)
        children.append(child)
        return child

    yield make
    for child in reversed(children):
        child.close()
