"""The benchmark modes' child processes: spawned, watched over a control pipe, always reaped.

``ChildGroup.start(name, target, *args)`` spawns ``target(conn, *args)`` (*spawn* context)
in a child that ignores SIGINT (the parent stops it), exits through ``SystemExit`` on
SIGTERM (so ``close()`` runs), dies with its parent, and sends a failure's traceback
as an ``("error", text)`` message. Every wait on a child is bounded.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

from .common import die_with_parent, on_sigterm

__all__ = ["ChildFailed", "ChildGroup", "ChildTimeout", "wait_for_close"]


class ChildFailed(Exception):
    """A child of the run raised, died or stayed silent too long."""


class ChildTimeout(ChildFailed):
    """A child stayed silent longer than the wait allowed (it may still be working)."""


def _child_main(
    target: Callable[..., None], conn: Connection, parent_pid: int, cpu: int | None, *args: Any
) -> None:
    """Entry point of every spawned child: run ``target(conn, *args)``, report a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    signal.signal(signal.SIGTERM, on_sigterm)  # so that Worker.close() runs on terminate()
    die_with_parent(parent_pid)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # before any thread starts: they inherit it
    try:
        target(conn, *args)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


class ChildGroup:
    """Spawned children, each with a control pipe; every message waited for is bounded.

    ``start`` spawns one; ``expect(name, kind, timeout)`` returns that child's next message
    of ``kind`` (raising ``ChildFailed`` on an ``error`` message, a death or silence);
    ``reap`` joins, then terminates, then kills whatever is left and says how many it had
    to stop.
    """

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, SpawnProcess] = {}
        self.conns: dict[str, Connection] = {}
        self.on_message: Callable[[str, tuple[Any, ...]], bool] | None = None

    def start(
        self, name: str, target: Callable[..., None], *args: Any, cpu: int | None = None
    ) -> None:
        """Spawn ``target(conn, *args)`` as child ``name``, pinned to ``cpu`` if given."""
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_child_main,
            args=(target, child, os.getpid(), cpu, *args),
            name=f"shmrdv-bench-{name}",
            daemon=True,
        )
        proc.start()
        child.close()  # only the child keeps it: its death shows up as EOF
        self.procs[name] = proc
        self.conns[name] = parent

    def send(self, name: str, msg: tuple[Any, ...]) -> None:
        try:
            self.conns[name].send(msg)
        except OSError as e:
            raise ChildFailed(f"{name} is gone ({self._exit(name)})") from e

    def _exit(self, name: str) -> str:
        code = self.procs[name].exitcode
        if code is None:
            return "still running"
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    def expect(self, name: str, kind: str, timeout: float) -> tuple[Any, ...]:
        """``name``'s next message of ``kind``; other kinds go to ``on_message`` (or fail)."""
        deadline = time.monotonic() + timeout
        conn = self.conns[name]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not conn.poll(min(remaining, 1.0)):
                if time.monotonic() >= deadline:
                    raise ChildTimeout(f"no {kind!r} from {name} within {timeout:g} s (hung?)")
                if self.procs[name].exitcode is not None and not conn.poll():
                    raise ChildFailed(f"{name} died ({self._exit(name)})")
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.procs[name].join(5)
                raise ChildFailed(f"{name} died ({self._exit(name)})") from None
            if msg[0] == "error":
                raise ChildFailed(f"{name} failed:\n{msg[1]}")
            if msg[0] == kind:
                return tuple(msg)
            if self.on_message is None or not self.on_message(name, tuple(msg)):
                raise ChildFailed(f"expected {kind!r} from {name}, got {msg!r}")

    def check_alive(self, names: Sequence[str]) -> None:
        """Raise ``ChildFailed`` if one of ``names`` died or reported an error meanwhile."""
        for name in names:
            conn = self.conns[name]
            if conn.poll():
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise ChildFailed(f"{name} died ({self._exit(name)})") from None
                if msg[0] == "error":
                    raise ChildFailed(f"{name} failed:\n{msg[1]}")
                if self.on_message is None or not self.on_message(name, tuple(msg)):
                    raise ChildFailed(f"unexpected message from {name}: {msg!r}")
            elif self.procs[name].exitcode is not None:
                raise ChildFailed(f"{name} died ({self._exit(name)})")

    def reap(self, grace: float) -> int:
        """Stop every child (join within ``grace``, then SIGTERM, then SIGKILL); how many were stopped."""
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        stopped = 0
        for p in self.procs.values():
            if p.exitcode is None:
                stopped += 1
                p.terminate()
        for p in self.procs.values():
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join(5)
        for c in self.conns.values():
            c.close()
        return stopped

    def alive(self) -> int:
        return sum(1 for p in self.procs.values() if p.exitcode is None)


def wait_for_close(conn: Connection) -> None:
    """Block until the parent says ``close`` (or is gone)."""
    with contextlib.suppress(EOFError, OSError):
        while conn.recv()[0] != "close":
            pass
