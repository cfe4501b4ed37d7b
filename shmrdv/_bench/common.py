"""What every ``shmrdv bench`` mode shares: sizes of float32 arrays as text, the key patterns,
CPU pinning, and the environment its child processes start with.

Sizes are ``shmrdv._values`` sizes (one parser and one printer for the whole project),
narrowed to what a float32 array can be. ``runner``, ``load``, ``soak`` and the other modes
import it; it imports none of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .._values import parse_size

__all__ = [
    "GRPC_OPTIONS",
    "GRPC_VERBOSITY",
    "KEY_PATTERNS",
    "grpc_quiet_children",
    "parse_key_patterns",
    "parse_array_size",
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
    """A size (``_sizes.parse_size``: ``64``, ``1k``, ``16m``, ``1g``) that float32 arrays fill:
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
