"""A benchmark run's child processes, in a namespace of their own, torn down whatever happens.

``ChildGroup`` starts named ``_procs.Child`` processes together and reaps them all.

Every multi-process measurement (``--load``, ``--soak``, ``--fan-in``, ...) starts its
children in a fresh namespace, talks to them, and must end with none of them running and
nothing of theirs left in /dev/shm, also when a child fails or the user interrupts. ``run``
does that once for all of them: a child's failure (``ChildFailed``, which includes a
timeout) becomes the result's ``failure`` instead of an exception; on the way out the
children are reaped (with grace only if they said goodbye), what they left is listed and
then collected, and the wall time is taken. The counts go into the result's ``Teardown``
fields.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .._procs import Child, ChildFailed, reap

__all__ = ["ChildGroup", "Children", "Teardown", "run"]

_REAP_GRACE_S = 30.0
_BYE_TIMEOUT_S = 60.0


class ChildGroup:
    """Named children started together; leaving a ``with`` block reaps them all."""

    def __init__(self) -> None:
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
        self, name: str, target: Callable[..., None], *args: Any, cpus: Iterable[int] | None = None
    ) -> Child:
        if name in self.children:
            raise ValueError(f"a child named {name!r} was already started")
        child = self.children[name] = Child(name, target, *args, cpus=cpus)
        return child

    def check_alive(self, names: Iterable[str] | None = None) -> None:
        """``ChildFailed`` if a child (of ``names``) failed, died or sent anything."""
        for child in self if names is None else map(self.__getitem__, names):
            if not child.poll() and child.process.exitcode in (0, None):
                continue
            try:
                msg = child.recv(0.0)
            except ChildFailed:
                if child.process.exitcode != 0:
                    raise
                continue
            raise ChildFailed(f"unexpected message from {child.name}: {msg!r}")

    def alive(self) -> int:
        return sum(1 for c in self if c.process.exitcode is None)

    def reap(self, grace: float) -> int:
        """Close every pipe, then ``reap`` every child; how many had to be signalled."""
        for child in self:
            child.close()
        return reap(self, grace)


@dataclass(kw_only=True)
class Teardown:
    """How a run ended: the failure, if any, and what had to be cleaned up after it."""

    failure: str | None = None
    leftover_objects: list[str] = field(default_factory=list)
    collected: int = 0
    processes_stopped: int = 0
    processes_left: int = 0
    wall_s: float = 0.0

    @property
    def clean(self) -> bool:
        """No failure, nothing left in /dev/shm, no child left or stopped by force."""
        return (
            self.failure is None
            and not self.leftover_objects
            and self.processes_stopped == 0
            and self.processes_left == 0
        )


class Children:
    """The run's namespace and child group; ``close`` says goodbye to the named children."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.group = ChildGroup()
        self.said_bye = False

    def close(self, names: Iterable[str]) -> None:
        """Ask each child to close, in order, then wait for each one's ``bye``."""
        names = list(names)
        for name in names:
            self.group[name].send(("close",))
        for name in names:
            self.group[name].expect("bye", _BYE_TIMEOUT_S)
        self.said_bye = True


@contextlib.contextmanager
def run(outcome: Teardown) -> Iterator[Children]:
    """Children for one run; see the module docstring. ``KeyboardInterrupt`` is recorded
    as the failure and raised on after the teardown."""
    import shmrdv

    from .._shm.reaper import collect, list_objects

    started = time.monotonic()
    children = Children(shmrdv.new_namespace())
    try:
        yield children
    except ChildFailed as e:
        outcome.failure = str(e)
    except KeyboardInterrupt:
        outcome.failure = "interrupted"
        raise
    finally:
        group = children.group
        outcome.processes_stopped = group.reap(_REAP_GRACE_S if children.said_bye else 0.0)
        outcome.processes_left = group.alive()
        outcome.leftover_objects = sorted(o.name for o in list_objects(children.namespace))
        outcome.collected = len(collect(children.namespace))
        outcome.wall_s = time.monotonic() - started
