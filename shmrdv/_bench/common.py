"""What every ``shmrdv bench`` mode shares: sizes as text, and a spawned child's start-up.

Standard library only, so that ``options`` (the command line) can use it without pulling in
numpy or any mode's module. ``runner``, ``load``, ``soak`` and the other modes import it;
it imports none of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import Any

__all__ = [
    "die_with_parent",
    "format_size",
    "on_sigterm",
    "pin_cpus",
    "parse_size",
    "parse_sizes",
]

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """``"64"``, ``"1k"``, ``"16m"``, ``"1g"`` (binary units; "kib"/"kb"/"b" also accepted).

    The benchmarks move float32 arrays: a size is a multiple of 4 bytes, at least 8.
    Raises ``ValueError`` with an example otherwise.
    """
    s = text.strip().lower()
    for tail in ("ib", "b"):
        if s.endswith(tail) and len(s) > len(tail):
            s = s[: -len(tail)]
            break
    unit = s[-1:] if s[-1:] in _SUFFIX else ""
    digits = s[: len(s) - len(unit)]
    try:
        value = int(digits) * _SUFFIX[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 64, 1k, 16m, 1g)") from None
    if value < 8 or value % 4:
        raise ValueError(f"size {text!r}: must be a multiple of 4 bytes and at least 8")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, sorted, without repeats."""
    return sorted({parse_size(part) for part in text.split(",") if part.strip()})


def format_size(nbytes: int) -> str:
    """``1024`` -> ``"1 KiB"``; sizes that are no whole unit stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def on_sigterm(signum: int, frame: Any) -> None:
    """A child's SIGTERM handler: exit through ``SystemExit`` so that ``close()`` runs."""
    raise SystemExit(128 + signum)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this process when its parent dies (best effort); exit at once
    if the parent is gone already."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent_pid:
        os._exit(1)


def pin_cpus(pin: bool | None) -> tuple[int, int] | None:
    """The CPUs of the producer and the consumer, or ``None`` for no pinning.

    ``pin`` None (the default): pin where this process may use two CPUs or more
    (``os.sched_getaffinity``), so that every method pays the same cross-CPU wake-up
    (issue 11). True: pin, and raise ``ValueError`` if fewer than two CPUs are usable.
    """
    if pin is False:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        if pin:
            raise ValueError(f"--pin needs two usable CPUs; this process may use {len(cpus)}")
        return None
    return cpus[0], cpus[1]
