"""The host a ``shmrdv bench`` run measures on: quiet, or oversubscribed by CPU-bound processes.

``--oversubscribe N`` runs N busy processes beside the measured pair for the whole run, as a
pipeline with a stage per core keeps every CPU busy: each spins a pure Python loop until the
run ends. Where the pair is pinned, they are pinned across the same CPUs, one by one (so
each of the pair's CPUs has its share); otherwise the kernel places them. They are
``shmrdv._procs`` children: stopped by pid when the run ends, also on an error or Ctrl-C,
and they die with the run. ``host_text`` is how every report names the state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from .children import ChildGroup

__all__ = ["busy_processes", "host_text"]

# Loop iterations between two looks at the control pipe: a few milliseconds of Python.
_SPIN_CHUNK = 100_000
_START_S = 60.0


def _spin(conn: Connection) -> None:
    """A busy process: say it runs, then burn CPU until the runner closes the pipe."""
    conn.send(("ready",))
    while not conn.poll():
        for _ in range(_SPIN_CHUNK):
            pass


@contextlib.contextmanager
def busy_processes(count: int, cpus: Sequence[int] | None) -> Iterator[dict[str, Any]]:
    """While open, ``count`` busy processes run (pinned round-robin to ``cpus`` if given).

    Yields the host's state as the JSON records it: ``state`` ("quiet" or
    "oversubscribed"), ``busy_processes`` and each one's ``busy_cpus`` (None: unpinned).
    """
    pins = [None if not cpus else [cpus[i % len(cpus)]] for i in range(count)]
    host: dict[str, Any] = {
        "state": "oversubscribed" if count else "quiet",
        "busy_processes": count,
        "busy_cpus": pins if cpus else None,
    }
    with ChildGroup() as group:
        for i, pin in enumerate(pins):
            group.start(f"bench-busy{i}", _spin, cpus=pin)
        for child in group:
            child.expect("ready", _START_S)
        yield host


def host_text(host: dict[str, Any] | None) -> str:
    """ "quiet" or "oversubscribed (N busy processes[ on CPUs ...])"."""
    if not host or not host.get("busy_processes"):
        return "quiet"
    n = host["busy_processes"]
    where = ""
    if host.get("busy_cpus"):
        where = " pinned to CPUs " + ", ".join(str(c[0]) for c in host["busy_cpus"])
    return f"oversubscribed ({n} busy process{'es' if n != 1 else ''}{where})"
