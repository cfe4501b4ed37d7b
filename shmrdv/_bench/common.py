"""What every ``shmrdv bench`` mode shares: sizes of float32 arrays as text, the key patterns,
CPU pinning, and the environment its child processes start with.

Sizes as text have one parser and one printer for the whole project (``shmrdv ls`` and
``gc`` print with it too), narrowed here to what a float32 array can be. ``runner``, ``load``,
``soak`` and the other modes import it; it imports none of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = [
    "GRPC_OPTIONS",
    "GRPC_VERBOSITY",
    "KEY_PATTERNS",
    "format_size",
    "grpc_quiet_children",
    "parse_key_patterns",
    "parse_array_size",
    "parse_size",
    "parse_sizes",
    "pin_cpus",
]

# gRPC core logs at INFO when a channel's server goes away with calls open ("chttp2_transport.cc
# ... Got goaway [2] ... Cancelling all calls"): a bench role's Worker stops its server while
# the other role's stream to it is still parked. That is no error of the run, so the bench's
# children log gRPC errors only; a GRPC_VERBOSITY the user set is kept.
GRPC_VERBOSITY = "ERROR"

# The channel and server options of every raw grpcio peer: no message size limit (the
# default receive limit is 4 MiB, pitfalls.md §6) and no proxy for loopback.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_http_proxy", 0),
]


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
EXAMPLE = "e.g. 4096, 64k, 4m or 1g (binary units; 4mib and 4mb mean 4m too)"


def parse_size(text: str, minimum: int = 1) -> int:
    """``"64"``, ``"1k"``, ``"4m"``, ``"1.5g"`` in bytes, at least ``minimum``; else ``ValueError``."""
    s = text.strip().lower()
    for tail in ("ib", "b"):
        if s.endswith(tail) and len(s) > len(tail):
            s = s[: -len(tail)]
            break
    unit = s[-1] if s and s[-1] in "kmg" else ""
    number = s[: len(s) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r}; give {EXAMPLE}") from None
    if not minimum <= value < float("inf"):  # also refuses nan
        least = "1 byte" if minimum == 1 else f"{minimum} bytes"
        raise ValueError(f"size {text!r} must be at least {least}; give {EXAMPLE}")
    return int(value)


def format_size(n: int) -> str:
    """``512 B``, ``4 KiB``, ``1.5 KiB``, ``16 MiB``, ``2.3 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.1f} {unit}"


# The key patterns users write (DESIGN.md, "Names and keys"), each a first-class path that the
# bench measures (``--keys``): what a method does per message under each.
KEY_PATTERNS = {
    "same": "one key reused (a channel)",
    "fresh": "a new edge name per message in one step (a scatter/gather's per-item keys; "
    "create_key per message, timed)",
    "step": "the same edge names in a new step per message (TensorFlow's loop; "
    "rendezvous(step) and cleanup of the last step, timed, on both sides)",
}


def parse_key_patterns(text: str) -> list[str]:
    """A comma-separated list of ``KEY_PATTERNS`` names, in their order, without repeats;
    ``ValueError`` naming an unknown one or an empty list."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in KEY_PATTERNS]
    if unknown:
        raise ValueError(
            f"unknown key pattern(s) {', '.join(unknown)}; give {'|'.join(KEY_PATTERNS)}"
        )
    if not names:
        raise ValueError(f"no key pattern (give {'|'.join(KEY_PATTERNS)})")
    return [n for n in KEY_PATTERNS if n in names]


def parse_array_size(text: str) -> int:
    """A size (``parse_size``: ``64``, ``1k``, ``16m``, ``1g``) that float32 arrays fill:
    a multiple of 4 bytes, at least 8. ``ValueError`` naming what is wrong otherwise."""
    value = parse_size(text, minimum=8)
    if value % 4:
        raise ValueError(f"size {text!r}: must be a multiple of 4 bytes")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of array sizes, sorted, without repeats."""
    return sorted({parse_array_size(part) for part in text.split(",") if part.strip()})


def pin_cpus(pin: bool | None) -> tuple[int, int] | None:
    """The CPUs of the producer and the consumer, or ``None`` for no pinning.

    ``pin`` None (the default): pin where this process may use two CPUs or more
    (``os.sched_getaffinity``), so that every method pays the same cross-CPU wake-up
    True: pin, and raise ``ValueError`` if fewer than two CPUs are usable.
    """
    if pin is False:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        if pin:
            raise ValueError(f"--pin needs two usable CPUs; this process may use {len(cpus)}")
        return None
    return cpus[0], cpus[1]


@contextlib.contextmanager
def grpc_quiet_children() -> Iterator[None]:
    """While open, processes started from here get ``GRPC_VERBOSITY=ERROR`` (gRPC reads it
    when it loads), unless the variable is set; this process's own setting is restored after."""
    if "GRPC_VERBOSITY" in os.environ:
        yield
        return
    os.environ["GRPC_VERBOSITY"] = GRPC_VERBOSITY
    try:
        yield
    finally:
        os.environ.pop("GRPC_VERBOSITY", None)
