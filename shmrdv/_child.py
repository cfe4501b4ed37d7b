"""A Worker running in a real child process, driven from the parent over a pipe.

For tests of code built on shmrdv (``shmrdv.testing``, the pytest plugin) and for the
project's own multi-process tests: the child creates a real ``Worker`` and carries out
the parent's commands one at a time — send, allocate-and-send, recv, cleanup, or any
importable function ``fn(worker, *args)`` — and answers with the result or the
exception, which is re-raised in the parent.
"""

from __future__ import annotations

import multiprocessing.connection
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ._closing import Closing
from ._errors import UnavailableError
from ._procs import Child, ChildFailed, ChildTimeout
from ._rendezvous import Received

__all__ = ["ChildError", "ChildWorker"]

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
