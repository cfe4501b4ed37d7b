"""Child processes that die with their parent, each with a control pipe and bounded waits.

The one process harness of the library, the demo, the benchmarks and the tests:

* ``Child(name, target, *args)`` spawns ``target(conn, *args)`` in a new process. In the
  child, SIGINT is ignored (the parent handles Ctrl-C and stops it), SIGTERM raises
  ``SystemExit`` (so ``with Worker(...)`` blocks close), and Linux is asked to SIGTERM
  the child when the parent dies (``PR_SET_PDEATHSIG``). If ``target`` raises, the child
  sends ``("error", traceback_text)`` and exits 1. ``cpus=`` pins the child to those CPUs
  before ``target`` starts (the threads it starts inherit the mask).
* ``Child.recv(timeout)`` waits for the next message, at most ``timeout`` seconds:
  ``ChildTimeout`` on silence, ``ChildFailed`` on death or an ``error`` message.
* ``Child.stop(grace)`` / ``reap(children, grace)``: join within ``grace``, then SIGTERM,
  then SIGKILL; only the processes started here, by their pid.
* ``ChildGroup`` holds named children and forwards to them.
* ``wait_for_close(conn)`` in a child blocks until the parent sends ``("close",)`` or is
  gone: the parent decides the order in which children close (consumers before the
  producers they pull from, so that no channel sees its server go away mid-call).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import UnavailableError
from ._rendezvous import Closing, Received

__all__ = [
    "Child",
    "ChildError",
    "ChildFailed",
    "ChildGroup",
    "ChildTimeout",
    "ChildWorker",
    "child_setup",
    "exit_reason",
    "reap",
    "wait_for_close",
]

# linux/prctl.h
_PR_SET_PDEATHSIG = 1


class ChildFailed(Exception):
    """A child raised (its traceback is in the message), died, or stayed silent too long."""


class ChildTimeout(ChildFailed):
    """A child stayed silent longer than the wait allowed (it may still be working)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def child_setup(parent_pid: int) -> None:
    """Run first in a child: ignore SIGINT, turn SIGTERM into ``SystemExit``, die with the parent.

    ``PR_SET_PDEATHSIG`` fires when the parent *thread* exits; a child whose parent is
    already gone (``getppid`` changed before the request took effect) exits at once.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    with contextlib.suppress(Exception):  # not Linux, or no libc symbol: best effort
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _entry(
    target: Callable[..., None],
    conn: Connection,
    parent_pid: int,
    cpus: frozenset[int] | None,
    *args: Any,
) -> None:
    child_setup(parent_pid)
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        target(conn, *args)
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()


def exit_reason(proc: multiprocessing.process.BaseProcess) -> str:
    """``"still running"``, ``"exit code N"`` or ``"killed by signal N"``."""
    code = proc.exitcode
    if code is None:
        return "still running"
    return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


def wait_for_close(conn: Connection) -> None:
    """In a child: block until the parent sends ``("close",)`` or is gone."""
    with contextlib.suppress(EOFError, OSError):
        while conn.recv()[0] != "close":
            pass


class Child:
    """One spawned process running ``target(conn, *args)``, and the parent's end of its pipe.

    ``target`` and ``args`` must pickle (spawn starts a fresh interpreter): a top-level
    function. ``daemon=True`` (the default) also stops it when the parent exits normally;
    a daemon cannot start children of its own. ``cpus``: pin the child to these CPUs
    (``os.sched_setaffinity``; one this process may not use fails the child). Use it as
    a context manager: leaving stops it (``stop(grace=5)``).
    """

    def __init__(
        self,
        name: str,
        target: Callable[..., None],
        *args: Any,
        start_method: str = "spawn",
        daemon: bool = True,
        cpus: Iterable[int] | None = None,
    ) -> None:
        pinned = None if cpus is None else frozenset(cpus)
        if pinned is not None and not pinned:
            raise ValueError(f"{name}: cpus must name at least one CPU, or be None")
        ctx: Any = multiprocessing.get_context(start_method)
        self.name = name
        parent, child = ctx.Pipe()
        self.conn: Connection = parent
        self.process: multiprocessing.process.BaseProcess = ctx.Process(
            target=_entry,
            args=(target, child, os.getpid(), pinned, *args),
            name=name,
            daemon=daemon,
        )
        try:
            self.process.start()
        finally:
            child.close()  # only the child keeps its end: its death shows up here as EOF
        self._closed = False

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None  # started in __init__
        return pid

    def __repr__(self) -> str:
        return f"<Child {self.name} pid={self.process.pid} {exit_reason(self.process)}>"

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(5.0)

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send ``msg`` to the child; ``ChildFailed`` if it is gone."""
        try:
            self.conn.send(msg)
        except (OSError, ValueError) as e:
            raise ChildFailed(f"{self.name} is gone ({exit_reason(self.process)})") from e

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message (or EOF) is there to read, waiting at most ``timeout`` s."""
        try:
            return self.conn.poll(timeout)
        except (OSError, ValueError):
            return True  # closed: the next recv reports why

    def recv(self, timeout: float, what: str = "a message") -> tuple[Any, ...]:
        """The child's next message within ``timeout`` s.

        Raises ``ChildTimeout`` if none came, ``ChildFailed`` if the child died (its exit
        code or signal in the message) or sent ``("error", traceback)``.
        """
        return self._recv_by(time.monotonic() + timeout, timeout, what)

    def _recv_by(self, deadline: float, timeout: float, what: str) -> tuple[Any, ...]:
        while True:
            remaining = deadline - time.monotonic()
            if self.poll(max(0.0, min(remaining, 0.5))):
                break
            if self.process.exitcode is not None and not self.poll():
                raise ChildFailed(f"{self.name} died ({exit_reason(self.process)})")
            if remaining <= 0:
                raise ChildTimeout(f"no {what} from {self.name} within {timeout:g} s (hung?)")
        try:
            msg: tuple[Any, ...] = tuple(self.conn.recv())
        except (EOFError, OSError, ValueError):
            self.process.join(5)
            raise ChildFailed(f"{self.name} died ({exit_reason(self.process)})") from None
        if msg and msg[0] == "error":
            raise ChildFailed(f"{self.name} failed:\n{msg[1]}")
        return msg

    def expect(
        self,
        kind: str,
        timeout: float,
        other: Callable[[tuple[Any, ...]], bool] | None = None,
    ) -> tuple[Any, ...]:
        """The next message of ``kind`` (its first item), within ``timeout`` s in all.

        A message of another kind goes to ``other`` (progress reports, say), which returns
        True to keep waiting; without ``other``, or if it returns False, ``ChildFailed``.
        """
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv_by(deadline, timeout, repr(kind))
            if msg[0] == kind:
                return msg
            if other is None or not other(msg):
                raise ChildFailed(f"expected {kind!r} from {self.name}, got {msg!r}")

    def signal(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to this child (by its pid), unless it has exited."""
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, grace: float, term_wait: float = 5.0) -> bool:
        """Close the pipe (a child in ``wait_for_close`` or ``recv`` sees EOF and returns),
        join within ``grace`` s, then SIGTERM, then (``term_wait`` s later) SIGKILL; True
        if it had to be stopped."""
        self.close()
        return reap([self], grace, term_wait) > 0

    def close(self) -> None:
        """Close the parent's end of the pipe (idempotent); the process is left alone."""
        if not self._closed:
            self._closed = True
            self.conn.close()


def reap(
    children: Iterable[Child | multiprocessing.process.BaseProcess],
    grace: float,
    term_wait: float = 5.0,
) -> int:
    """Join every process within ``grace`` s in all, then SIGTERM, then SIGKILL the rest.

    Returns how many had to be terminated. Each wait is bounded: ``term_wait`` s after
    SIGTERM (time for ``with`` blocks to close), 5 s after SIGKILL.
    """
    procs = [c.process if isinstance(c, Child) else c for c in children]
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stopped = [p for p in procs if p.exitcode is None]
    for p in stopped:
        p.terminate()
    term_deadline = time.monotonic() + term_wait
    for p in stopped:
        p.join(max(0.0, term_deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(5)
    return len(stopped)


class ChildGroup:
    """Named children started together and stopped together (``reap``)."""

    def __init__(self, start_method: str = "spawn") -> None:
        self._start_method = start_method
        self.children: dict[str, Child] = {}

    def __enter__(self) -> ChildGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reap(5.0)

    def __getitem__(self, name: str) -> Child:
        return self.children[name]

    def __iter__(self) -> Iterator[Child]:
        return iter(list(self.children.values()))

    def start(
        self,
        name: str,
        target: Callable[..., None],
        *args: Any,
        cpus: Iterable[int] | None = None,
    ) -> Child:
        """Start ``Child(name, target, *args, cpus=cpus)`` in this group."""
        if name in self.children:
            raise ValueError(f"a child named {name!r} was already started")
        child = Child(name, target, *args, start_method=self._start_method, cpus=cpus)
        self.children[name] = child
        return child

    def check_alive(self, names: Iterable[str] | None = None) -> None:
        """``ChildFailed`` if a child (of ``names``, default all) failed or sent anything meanwhile."""
        chosen = self.children.values() if names is None else [self.children[n] for n in names]
        for child in chosen:
            if child.poll():
                try:
                    msg = child.conn.recv()
                except (EOFError, OSError, ValueError):
                    child.process.join(5)
                    if child.process.exitcode not in (0, None):
                        raise ChildFailed(
                            f"{child.name} died ({exit_reason(child.process)})"
                        ) from None
                    continue
                if msg[0] == "error":
                    raise ChildFailed(f"{child.name} failed:\n{msg[1]}")
                raise ChildFailed(f"unexpected message from {child.name}: {msg!r}")
            if child.process.exitcode not in (0, None):
                raise ChildFailed(f"{child.name} died ({exit_reason(child.process)})")

    def alive(self) -> int:
        return sum(1 for c in self.children.values() if c.process.exitcode is None)

    def reap(self, grace: float) -> int:
        """Stop every child (close its pipe, join within ``grace``, then SIGTERM, then SIGKILL);
        how many had to be stopped."""
        for child in self.children.values():
            child.close()
        return reap(self.children.values(), grace)


# Seconds the parent waits for a command's answer before declaring the child hung.
_DEFAULT_REPLY_S = 60.0


class ChildError(Exception):
    """An exception raised in the child that could not be sent back as itself."""


def _child_main(
    conn: multiprocessing.connection.Connection, task: str, kwargs: dict[str, Any]
) -> None:
    import shmrdv

    try:
        worker = shmrdv.Worker(task, **kwargs)
    except BaseException as e:  # report why it could not start
        conn.send(("err", _portable(e)))
        return
    conn.send(("ok", (worker.incarnation, worker.address)))
    with worker:
        while True:
            try:
                cmd, args = conn.recv()
            except (EOFError, OSError):
                return  # parent gone
            if cmd == "close":
                worker.close()
                conn.send(("ok", None))
                return
            try:
                result = _run(worker, cmd, args)
            except BaseException as e:
                conn.send(("err", _portable(e)))
            else:
                conn.send(("ok", result))


def _run(worker: Any, cmd: str, args: tuple[Any, ...]) -> Any:
    if cmd == "send":
        step, key, value, is_dead = args
        worker.rendezvous(step).send(key, value, is_dead=is_dead)
        return None
    if cmd == "send_allocated":
        step, key, value, is_dead = args
        rdv = worker.rendezvous(step)
        buf = rdv.allocate(key, value.shape, value.dtype)
        buf[...] = value
        rdv.send(key, buf, is_dead=is_dead)
        return None
    if cmd == "recv":
        step, key, timeout = args
        # copy=True: the value is pickled back to the parent, the segment freed at once.
        return worker.rendezvous(step).recv(key, timeout=timeout, copy=True)
    if cmd == "cleanup":
        worker.cleanup(args[0])
        return None
    if cmd == "call":
        fn, fargs = args
        return fn(worker, *fargs)
    raise ValueError(f"unknown child command {cmd!r}")


def _portable(e: BaseException) -> BaseException:
    """The exception itself if it pickles, else a ChildError carrying its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return ChildError(f"{type(e).__name__}: {e}\n{text}")


class _ChildProducer:
    """The ``Producer`` of a conformance pair, in a child process."""

    def __init__(self, child: ChildWorker, step: int, allocate: bool) -> None:
        self._child, self._step, self._allocate = child, step, allocate

    def send(self, key: str, value: npt.NDArray[Any], *, is_dead: bool = False) -> None:
        # Only plain arrays go through allocate: what send refuses or converts (object
        # dtypes, ndarray subclasses) must meet send itself.
        if self._allocate and type(value) is np.ndarray and not value.dtype.hasobject:
            self._child.send_allocated(key, value, is_dead=is_dead, step=self._step)
        else:
            self._child.send(key, value, is_dead=is_dead, step=self._step)


class ChildWorker(Closing):
    """A ``shmrdv.Worker`` for ``task`` in a child process (spawn by default).

    Each method sends one command and blocks until the child answers (at most
    ``reply_timeout`` seconds); the child's exception is re-raised here. ``kill()``
    sends a signal (SIGKILL by default); ``close()`` closes the child's Worker, waits for
    the process and is idempotent. Use it as a context manager.
    """

    def __init__(
        self,
        task: str,
        *,
        start_method: str = "spawn",
        reply_timeout: float = _DEFAULT_REPLY_S,
        **worker_kwargs: Any,
    ) -> None:
        self.task = task
        self._reply_timeout = reply_timeout
        self._lock = threading.Lock()
        self._child = Child(
            f"shmrdv-child {task}", _child_main, task, worker_kwargs, start_method=start_method
        )
        self.pid = self._child.pid
        self._closed = False
        try:
            self.incarnation, self.address = self._reply("start")
        except BaseException:
            self.kill()
            raise

    def __repr__(self) -> str:
        return f"<ChildWorker {self.task} pid={self.pid} alive={self.process.is_alive()}>"

    def _reply(self, what: str, timeout: float | None = None) -> Any:
        t = self._reply_timeout if timeout is None else timeout
        try:
            status, payload = self._child.recv(t, f"answer to {what!r}")
        except ChildTimeout:
            raise TimeoutError(
                f"child {self.task} (pid {self.pid}) did not answer {what!r} within {t:g}s"
            ) from None
        except ChildFailed as e:
            raise UnavailableError(
                f"child {self.task} (pid {self.pid}) died during {what!r} ({e})"
            ) from e
        if status == "err":
            raise payload
        return payload

    def _call(self, cmd: str, *args: Any, timeout: float | None = None) -> Any:
        with self._lock:
            if self._closed:
                raise UnavailableError(f"child {self.task} is closed")
            try:
                self._child.send((cmd, args))
            except ChildFailed as e:
                raise UnavailableError(f"child {self.task} (pid {self.pid}) is gone") from e
            return self._reply(cmd, timeout)

    def send(self, key: str, value: Any, *, is_dead: bool = False, step: int = 0) -> None:
        """``worker.rendezvous(step).send(key, value)`` in the child."""
        self._call("send", step, key, value, is_dead)

    def send_allocated(
        self, key: str, value: npt.NDArray[Any], *, is_dead: bool = False, step: int = 0
    ) -> None:
        """``allocate`` a buffer in the child, copy ``value`` into it, and send the buffer."""
        self._call("send_allocated", step, key, value, is_dead)

    def recv(self, key: str, *, timeout: float | None = None, step: int = 0) -> Received:
        """``worker.rendezvous(step).recv(key, timeout=...)`` in the child; the value comes back by pickle."""
        wait = None if timeout is None else timeout + self._reply_timeout
        result: Received = self._call("recv", step, key, timeout, timeout=wait)
        return result

    def cleanup(self, step: int) -> None:
        self._call("cleanup", step)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run ``fn(worker, *args)`` in the child (``fn`` must be importable by name) and return its result."""
        return self._call("call", fn, args, timeout=timeout)

    def producer(self, step: int = 0, *, allocate: bool = False) -> _ChildProducer:
        """A conformance-pair producer sending from this child (``allocate=True``: zero-copy sends)."""
        return _ChildProducer(self, step, allocate)

    @property
    def process(self) -> multiprocessing.process.BaseProcess:
        return self._child.process

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child (only the child we started, by its pid)."""
        self._child.signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.process.join(10)
            self._closed = True
            self._child.close()

    def close(self, timeout: float = 10.0) -> None:
        """Close the child's Worker and wait for the process; kill it if it does not exit."""
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    self._child.send(("close", ()))
                    self._child.recv(timeout, "answer to 'close'")
                except ChildFailed:
                    pass  # gone already, or hung: stop() below ends it
        self._child.stop(timeout)
