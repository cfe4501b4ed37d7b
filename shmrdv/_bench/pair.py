"""One method's two role processes, from the runner's side: started, watched, stopped,
and what they left under the run's prefix swept.

Each role talks to the runner over its own control Pipe (``_procs.Child``); the two roles
share a duplex ``link`` Pipe. A role that raises, dies or stays silent too long fails its
method (``ChildFailed``). ``run_handoffs`` drives a pair without measuring anything.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from typing import Any

from .._procs import Child, ChildFailed, ChildTimeout, exit_reason, reap
from . import methods
from .contract import MethodSpec, RoleContext
from .role import role_main
from .selection import load_plugins

__all__ = ["RolePair", "run_handoffs", "stall_timeout", "sweep"]

SHM_DIR = "/dev/shm"


class RolePair:
    """The two processes of one method (``_procs.Child``), watched together.

    The runner talks to the pinger; the ponger only says ``ready`` (with its CPUs) or
    fails, and either role's failure or death fails the method (``ChildFailed``).
    """

    def __init__(
        self,
        spec: MethodSpec,
        mpctx: SpawnContext,
        env: dict[str, Any],
        cpus: Sequence[int | None],
    ) -> None:
        self.spec = spec
        self.env = env
        self.stopping = False
        self.ponger_cpus: list[int] | None = None
        self.shared: dict[str, Any] = spec.make_shared(mpctx) if spec.make_shared else {}
        self.children: list[Child] = []
        self.ponger: Child | None = None
        self._ponger_open = False
        pins = [None if cpu is None else [cpu] for cpu in cpus]
        link_a: Connection | None = None
        link_b: Connection | None = None
        try:
            if spec.ponger is not None:
                link_a, link_b = mpctx.Pipe()
                self.ponger = self._start("ponger", spec.ponger, link_b, pins[1])
                self._ponger_open = True
            self.pinger = self._start("pinger", spec.pinger, link_a, pins[0])
        except BaseException:
            reap(self.children, 0.0)  # the ponger, if the pinger did not start
            raise
        finally:
            for end in (link_a, link_b):  # only the roles keep the link
                if end is not None:
                    end.close()

    def _start(
        self,
        role: str,
        factory: Callable[[RoleContext], Any],
        link: Connection | None,
        cpus: list[int] | None,
    ) -> Child:
        name = f"bench-{self.spec.name}-{role}"
        args = (role, factory, link, self.shared, self.env)
        child = Child(name, role_main, *args, cpus=cpus)
        self.children.append(child)
        return child

    def send(self, msg: tuple[Any, ...]) -> None:
        self.pinger.send(msg)

    def next(self, timeout: float) -> tuple[Any, ...]:
        """The pinger's next message; ``ChildFailed`` on an error, a death or silence."""
        deadline = time.monotonic() + timeout
        while True:
            waitables: list[Any] = [self.pinger.conn, self.pinger.process.sentinel]
            if self.ponger is not None:
                if self._ponger_open:
                    waitables.append(self.ponger.conn)
                if self.ponger.process.exitcode is None:
                    waitables.append(self.ponger.process.sentinel)
            remaining = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(waitables, timeout=max(0.0, remaining))
            if not ready:
                raise ChildTimeout(f"no word from the pinger for {timeout:g} s (hung?)")
            if self.ponger is not None and self.ponger.conn in ready:
                self._from_ponger(self.ponger)
                continue
            if self.pinger.conn in ready or self.pinger.poll():
                try:
                    return self.pinger.recv(0.0)
                except ChildFailed as e:
                    raise ChildFailed(f"{e}{self._ponger_note()}") from None
            if self.pinger.process.sentinel in ready:
                raise ChildFailed(f"{self.pinger.name} died ({exit_reason(self.pinger.process)})")
            if self.ponger is not None and self.ponger.process.sentinel in ready:
                self.ponger.process.join(1)
                if self._ponger_open and self.ponger.poll():
                    continue  # read its last words first
                if not self.stopping or self.ponger.process.exitcode != 0:
                    reason = exit_reason(self.ponger.process)
                    raise ChildFailed(f"{self.ponger.name} died ({reason})")

    def _from_ponger(self, ponger: Child) -> None:
        """Take the ponger's message: ``ready`` (its CPUs), an error (raised) or its EOF."""
        try:
            msg = ponger.conn.recv()
        except EOFError:
            self._ponger_open = False  # its death, if any, shows on its sentinel
            return
        if msg[0] == "error":
            raise ChildFailed(f"{ponger.name} failed:\n{msg[1]}")
        if msg[0] == "ready":
            self.ponger_cpus = msg[2]

    def _ponger_note(self) -> str:
        """Why the pinger's failure may be the ponger's fault."""
        if self.ponger is None:
            return ""
        self.ponger.process.join(0.5)
        if self.ponger.process.exitcode in (None, 0):
            return ""
        return f"\n(the ponger had died first: {exit_reason(self.ponger.process)})"

    def expect(self, kind: str, timeout: float) -> tuple[Any, ...]:
        msg = self.next(timeout)
        if msg[0] != kind:
            raise ChildFailed(f"expected {kind!r} from the pinger, got {msg!r}")
        return msg

    def reap(self, grace: float) -> None:
        """Stop both roles (``_procs.reap``), then close the shared objects and sweep."""
        for child in self.children:
            child.close()
        reap(self.children, grace)
        for obj in self.shared.values():
            if hasattr(obj, "close") and hasattr(obj, "join_thread"):  # a Queue's feeder thread
                obj.close()
                obj.join_thread()
        if self.spec.sweep is not None:
            self.spec.sweep(self.env["prefix"], self.shared)


def stall_timeout(nbytes: int) -> float:
    """How long a pair at ``nbytes`` may stay silent before it counts as hung."""
    # Generous: the slowest peers move ~0.3 GB/s, and a repetition has at least 5 handoffs.
    return 60.0 + nbytes / 10e6


def sweep(prefix: str) -> list[str]:
    """Unlink every /dev/shm entry (segments and ``sem.`` semaphores) under ``prefix``."""
    swept: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return swept
    for name in names:
        if name.startswith(prefix) or name.startswith("sem." + prefix):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
                swept.append(name)
    return swept


def run_handoffs(
    name: str,
    nbytes: int,
    count: int,
    *,
    pin: tuple[int, int] | None,
    gap_us: float = 50.0,
    touch: bool = False,
    keys: str | None = None,
) -> None:
    """Start method ``name``'s roles as a run does, make exactly ``count`` handoffs of
    ``nbytes`` (at the method's fixed size if it has one; ``keys``: its key pattern, for a
    method that has keys), stop the roles, sweep.

    Nothing is timed: ``syscalls.py`` runs this under strace to count what a handoff costs.
    Raises ``KeyError`` for an unknown method and ``ChildFailed`` when a role fails.
    """
    load_plugins()
    spec = methods.METHODS[methods.ALIASES.get(name, name)]
    nbytes = spec.fixed_nbytes or nbytes
    prefix = f"shmrdv_bench{os.getpid()}_"
    scratch = tempfile.mkdtemp(prefix=prefix)
    env = {
        "prefix": prefix,
        "scratch_dir": scratch,
        "max_nbytes": nbytes,
        "pending": 0,
        "touch": touch,
        "method": spec.name,
        "keys": keys if spec.key_patterns else None,
    }
    try:
        cpus: list[int | None] = [None, None] if pin is None else list(pin)
        roles = RolePair(spec, multiprocessing.get_context("spawn"), env, cpus)
        ok = False
        try:
            roles.expect("ready", 180.0)
            roles.send(("count", nbytes, count, int(gap_us * 1000)))
            roles.expect("count", stall_timeout(nbytes) + count * (0.01 + nbytes / 1e8))
            roles.stopping = True
            roles.send(("stop",))
            roles.expect("bye", 60.0)
            ok = True
        finally:
            roles.reap(30.0 if ok else 0.0)
    finally:
        sweep(prefix)
        shutil.rmtree(scratch, ignore_errors=True)
