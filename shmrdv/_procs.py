"""Child processes that die with their parent, each with a control pipe and bounded waits.

The process harness of the benchmarks and the tests: a ``Child`` ignores SIGINT (the
parent handles it), turns SIGTERM into ``SystemExit`` (so ``with`` blocks close), gets
SIGTERM when its parent dies and reports a failure as ``("error", traceback)``. Only pids
started here are signalled. ``ChildWorker`` drives a ``shmrdv.Worker`` in a child.
Thread model (``docs/threads.md``): no threads; a ``ChildWorker`` may be called from any
thread, one command at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ._errors import UnavailableError
from ._rendezvous import Closing, Received
from ._worker import Worker

__all__ = ["Child", "ChildError", "ChildFailed", "ChildTimeout", "ChildWorker"]
__all__ += ["exit_reason", "reap", "wait_for_close"]

_T = TypeVar("_T")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ChildFailed(Exception):
    """A child raised (its traceback is in the message), died, or stayed silent too long."""


class ChildTimeout(ChildFailed):
    """A child stayed silent longer than the wait allowed (it may still be working)."""


class ChildError(Exception):
    """An exception raised in the child that could not be sent back as itself."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _entry(
    target: Callable[..., None],
    conn: Connection,
    parent: int,
    cpus: frozenset[int] | None,
    *args: Any,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    with contextlib.suppress(Exception):  # not Linux, or no libc symbol: best effort
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # before target: the threads it starts inherit it
        target(conn, *args)
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        conn.close()


def exit_reason(proc: BaseProcess) -> str:
    """``"still running"``, ``"exit code N"`` or ``"killed by signal N"``."""
    code = proc.exitcode
    if code is None:
        return "still running"
    return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"


def wait_for_close(conn: Connection) -> None:
    """In a child: block until the parent sends ``("close",)`` or is gone (the parent
    closes consumers before the producers they pull from)."""
    with contextlib.suppress(EOFError, OSError):
        while conn.recv()[0] != "close":
            pass


class Child:
    """A spawned process running ``target(conn, *args)`` (top-level, arguments that
    pickle) and the parent's end of its pipe; ``cpus`` pins it; ``with`` stops it.
    ``daemon=False`` lets it start children of its own."""

    def __init__(
        self,
        name: str,
        target: Callable[..., None],
        *args: Any,
        daemon: bool = True,
        cpus: Iterable[int] | None = None,
    ) -> None:
        pinned = None if cpus is None else frozenset(cpus)
        if pinned is not None and not pinned:
            raise ValueError(f"{name}: cpus must name at least one CPU, or be None")
        ctx: Any = multiprocessing.get_context("spawn")
        self.name = name
        self._closed = False
        self.conn: Connection
        self.conn, child = ctx.Pipe()
        self.process: BaseProcess = ctx.Process(
            target=_entry,
            args=(target, child, os.getpid(), pinned, *args),
            name=name,
            daemon=daemon,
        )
        try:
            self.process.start()
        finally:
            child.close()  # only the child keeps its end: its death shows up here as EOF
        self.pid = cast(int, self.process.pid)  # set by start()

    def __repr__(self) -> str:
        return f"<Child {self.name} pid={self.pid} {exit_reason(self.process)}>"

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
        """Whether a message (or EOF) is there, waiting at most ``timeout`` s."""
        try:
            return self.conn.poll(timeout)
        except (OSError, ValueError):
            return True  # closed: the next recv reports why

    def recv(self, timeout: float, what: str = "a message") -> tuple[Any, ...]:
        """The child's next message within ``timeout`` s; ``ChildTimeout`` if none came,
        ``ChildFailed`` if it died or sent an error."""
        return self._recv_by(time.monotonic() + timeout, timeout, what)

    def _recv_by(self, deadline: float, timeout: float, what: str) -> tuple[Any, ...]:
        while not self.poll(max(0.0, min(deadline - time.monotonic(), 0.5))):
            if self.process.exitcode is not None and not self.poll():
                raise ChildFailed(f"{self.name} died ({exit_reason(self.process)})")
            if time.monotonic() >= deadline:
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
        self, kind: str, timeout: float, other: Callable[[tuple[Any, ...]], bool] | None = None
    ) -> tuple[Any, ...]:
        """The next message of ``kind`` within ``timeout`` s in all; another kind goes to
        ``other``, which returns True to keep waiting (else ``ChildFailed``)."""
        deadline = time.monotonic() + timeout
        while (msg := self._recv_by(deadline, timeout, repr(kind)))[0] != kind:
            if other is None or not other(msg):
                raise ChildFailed(f"expected {kind!r} from {self.name}, got {msg!r}")
        return msg

    def signal(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to this child, unless it has exited."""
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, grace: float, term_wait: float = 5.0) -> bool:
        """Close the pipe, then ``reap`` the child; whether it had to be signalled."""
        self.close()
        return reap([self], grace, term_wait) > 0

    def close(self) -> None:
        """Close the parent's end of the pipe (idempotent); the process is left alone."""
        if not self._closed:
            self._closed = True
            self.conn.close()


def reap(children: Iterable[Child], grace: float, term_wait: float = 5.0) -> int:
    """Join every process within ``grace`` s, SIGTERM the rest, SIGKILL them ``term_wait`` s
    later (time for ``with`` blocks to close); how many had to be signalled."""
    procs = [c.process for c in children]
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stopped = [p for p in procs if p.exitcode is None]
    for p in stopped:
        p.terminate()
    deadline = time.monotonic() + term_wait
    for p in stopped:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(5)
    return len(stopped)


def _child_main(conn: Connection, task: str, kwargs: dict[str, Any]) -> None:
    try:
        worker = Worker(task, **kwargs)
    except BaseException as e:  # report why it could not start
        conn.send(("err", _portable(e)))
        return
    conn.send(("ok", (worker.incarnation, worker.address)))
    with worker:
        while True:
            try:
                fn, args = conn.recv()
            except (EOFError, OSError):
                return  # closed by the parent, or the parent is gone: the Worker closes
            try:
                conn.send(("ok", fn(worker, *args)))
            except BaseException as e:
                conn.send(("err", _portable(e)))


def _portable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return ChildError(f"{type(e).__name__}: {e}\n{text}")


def _send(worker: Worker, step: int, key: str, value: Any, is_dead: bool, allocate: bool) -> None:
    rdv = worker.rendezvous(step)
    if allocate:
        buf = rdv.allocate(key, value.shape, value.dtype)
        buf[...] = value
        value = buf
    rdv.send(key, value, is_dead=is_dead)


def _recv(worker: Worker, step: int, key: str, timeout: float | None) -> Received:
    # copy=True: the value is pickled back to the parent, the segment freed at once.
    return worker.rendezvous(step).recv(key, timeout=timeout, copy=True)


class _ChildProducer:
    """The ``Producer`` of a conformance pair, in a child process."""

    def __init__(self, child: ChildWorker, step: int, allocate: bool) -> None:
        self._child, self._step, self._allocate = child, step, allocate

    def send(self, key: str, value: npt.NDArray[Any], *, is_dead: bool = False) -> None:
        # Only plain arrays go through allocate: what send refuses or converts (object
        # dtypes, ndarray subclasses) must meet send itself.
        allocate = self._allocate and type(value) is np.ndarray and not value.dtype.hasobject
        self._child.send(key, value, is_dead=is_dead, step=self._step, allocate=allocate)


class ChildWorker(Closing):
    """A ``shmrdv.Worker`` for ``task`` in a spawned child process.

    Each method blocks until the child answers, at most ``reply_timeout`` s (then
    ``TimeoutError``), and raises the child's exception; a dead child is ``UnavailableError``.
    """

    def __init__(self, task: str, *, reply_timeout: float = 60.0, **worker_kwargs: Any) -> None:
        self.task = task
        self._reply_timeout = reply_timeout
        self._lock = threading.Lock()
        self._closed = False
        self._child = Child(f"shmrdv-child {task}", _child_main, task, worker_kwargs)
        self.pid = self._child.pid
        self.process = self._child.process
        try:
            self.incarnation, self.address = self._reply("start", reply_timeout)
        except BaseException:
            self.kill()
            raise

    def __repr__(self) -> str:
        return f"<ChildWorker {self.task} pid={self.pid} alive={self.process.is_alive()}>"

    def _reply(self, what: str, timeout: float) -> Any:
        try:
            status, payload = self._child.recv(timeout, f"answer to {what!r}")
        except ChildTimeout:
            raise TimeoutError(
                f"child {self.task} (pid {self.pid}) did not answer {what!r} within {timeout:g}s"
            ) from None
        except ChildFailed as e:
            raise UnavailableError(
                f"child {self.task} (pid {self.pid}) died during {what!r} ({e})"
            ) from e
        if status == "err":
            raise payload
        return payload

    def call(self, fn: Callable[..., _T], *args: Any, timeout: float | None = None) -> _T:
        """``fn(worker, *args)`` run in the child (``fn`` importable, its result picklable)."""
        with self._lock:
            if self._closed:
                raise UnavailableError(f"child {self.task} is closed")
            try:
                self._child.send((fn, args))
            except ChildFailed as e:
                raise UnavailableError(f"child {self.task} (pid {self.pid}) is gone") from e
            wait = self._reply_timeout if timeout is None else timeout
            result: _T = self._reply(fn.__name__.lstrip("_"), wait)
            return result

    def send(
        self, key: str, value: Any, *, is_dead: bool = False, step: int = 0, allocate: bool = False
    ) -> None:
        """``worker.rendezvous(step).send(key, value)`` in the child (``allocate``: zero-copy)."""
        self.call(_send, step, key, value, is_dead, allocate)

    def recv(self, key: str, *, timeout: float | None = None, step: int = 0) -> Received:
        """``worker.rendezvous(step).recv(key, timeout=...)`` in the child, sent back by pickle."""
        wait = None if timeout is None else timeout + self._reply_timeout
        return self.call(_recv, step, key, timeout, timeout=wait)

    def cleanup(self, step: int) -> None:
        self.call(Worker.cleanup, step)

    def producer(self, step: int = 0, *, allocate: bool = False) -> _ChildProducer:
        """A conformance-pair ``Producer`` sending from this child."""
        return _ChildProducer(self, step, allocate)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child (only the child we started, by its pid)."""
        self._child.signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.process.join(10)
            self._closed = True
            self._child.close()

    def close(self, timeout: float = 10.0) -> None:
        """Close the pipe (the child closes its Worker and exits), ``Child.stop`` it after
        ``timeout`` s. Idempotent."""
        with self._lock:  # after a command in progress
            self._closed = True
            self._child.stop(timeout)
