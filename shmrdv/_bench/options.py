"""The command line of ``shmrdv bench``: every option of every mode, defined once.

Standard library only: ``shmrdv``'s CLI builds its ``bench`` subcommand from here without
importing the benchmark code (numpy, the peers, the modes), which loads only when a
benchmark runs. ``runner.run`` dispatches the parsed options to the mode they ask for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .common import KEY_PATTERNS, format_size, parse_array_size, parse_key_patterns, parse_sizes

__all__ = [
    "DEFAULT_SIZES",
    "LOAD_KEYS",
    "LOAD_MAX_SIZE",
    "LOAD_MESSAGES",
    "LOAD_PRODUCERS",
    "LOAD_SEED",
    "LOAD_WINDOW",
    "PIPELINE_CASES",
    "QUICK_METHODS",
    "QUICK_SIZES",
    "SOAK_HANDOFFS",
    "SOAK_MAX_SIZE",
    "SYSCALL_HANDOFFS",
    "add_fan_in_arguments",
    "add_load_arguments",
    "add_peer_arguments",
    "add_pipeline_arguments",
    "add_pingpong_arguments",
    "add_python_cost_arguments",
    "add_soak_arguments",
    "add_syscall_arguments",
    "build_parser",
]

DEFAULT_SIZES = "64,1k,64k,1m,16m,64m,256m"
# --quick: shmrdv's paths and the peers of the summary, at the sizes users quote.
QUICK_SIZES = "64,64k,1m,16m"
QUICK_METHODS = "shmrdv_send,shmrdv_allocate,shmrdv_grpc,mp_pipe_oob,mp_queue,grpc_pull"

MAX_SIZE = 16 << 30  # a size above this is a typo, not a benchmark on a 24 GiB machine

# --load (load.py's LoadConfig takes its defaults from here)
LOAD_MESSAGES = 50_000
LOAD_PRODUCERS = 8
LOAD_KEYS = 1_000
LOAD_MAX_SIZE = "4m"
LOAD_WINDOW = "64m"
LOAD_SEED = 6
# --soak (soak.py's SoakConfig likewise)
SOAK_HANDOFFS = 200_000
SOAK_MAX_SIZE = "256k"
# --syscalls (syscalls.py): handoffs of the longer of its two strace runs
SYSCALL_HANDOFFS = 2_000
# --pipeline (pipeline.py takes its default cases from here)
PIPELINE_CASES = "64k:1000,16m:100"


# -- option types: a value out of range is a usage error (exit 2) that gives the range ------


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer (give one from {lo:,} to {hi:,})"
            ) from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"{value:,} is out of range (give an integer from {lo:,} to {hi:,})"
            )
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def float_range(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    text_range = f"above {lo:g} and up to {hi:g}" if lo_open else f"from {lo:g} to {hi:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number (give one {text_range})"
            ) from None
        if not (lo < value if lo_open else lo <= value) or not value <= hi:
            raise argparse.ArgumentTypeError(
                f"{value:g} is out of range (give a number {text_range})"
            )
        return value

    parse.__name__ = "number"
    return parse


def _checked_size(text: str) -> int:
    value = parse_array_size(text)
    if value > MAX_SIZE:
        raise ValueError(f"size {text!r} is above the largest, {format_size(MAX_SIZE)}")
    return value


def size_option(text: str) -> int:
    """An argparse ``type``: one size (8 B to 16 GiB, a multiple of 4, e.g. 64, 1k, 16m)."""
    try:
        return _checked_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def sizes_option(text: str) -> list[int]:
    """An argparse ``type``: comma-separated sizes, sorted, without repeats; at least one."""
    try:
        sizes = parse_sizes(text)
        for part in text.split(","):
            if part.strip():
                _checked_size(part)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes (give e.g. 64,1k,16m)")
    return sizes


def keys_option(text: str) -> list[str]:
    """An argparse ``type``: comma-separated key patterns (``common.KEY_PATTERNS``)."""
    try:
        return parse_key_patterns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_pingpong_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the default run: methods, sizes, repetitions, pinning, output."""
    parser.add_argument(
        "--methods", help="comma-separated methods (default: all available; see --list)"
    )
    parser.add_argument(
        "--no-baselines",
        action="store_true",
        help="with --methods: do not add the ratios' baselines (memcpy, mp_pipe_oob, and "
        "grpc_pull and grpc_pull_piggyback for the gRPC methods)",
    )
    parser.add_argument(
        "--sizes",
        type=sizes_option,
        help=f"comma-separated sizes with k/m/g suffixes, 8 B to 16 GiB (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--keys",
        type=keys_option,
        default=["same"],
        metavar="PATTERN[,...]",
        help="the key patterns of shmrdv's methods, each measured on its own (default same): "
        + "; ".join(f"{name}: {text}" for name, text in KEY_PATTERNS.items()),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="under a minute (35-50 s measured on a busy 2-CPU machine, about 70 s with "
        "--oversubscribe 2): the summary of shmrdv against a "
        f"Pipe, a Queue and raw gRPC; methods {QUICK_METHODS} (unless --methods), sizes "
        f"{QUICK_SIZES}, 3 repetitions, short budgets, no idle probe",
    )
    parser.add_argument(
        "--details",
        action="store_true",
        help="after the summary, every table per size (one-way, p99, throughput, fixed cost, "
        "page faults, spread, every ratio) and the floors; --json has every figure either way",
    )
    parser.add_argument(
        "--reps",
        type=int_range(1, 1000),
        help="repetitions per size, 1 to 1000 (default 5, 3 at >= 64 MiB or with --quick)",
    )
    parser.add_argument(
        "--budget",
        type=float_range(0, 3600, lo_open=True),
        help="seconds of timed handoffs per (method, size), above 0 to 3600 "
        "(default 2, --quick 0.5)",
    )
    parser.add_argument(
        "--gap-us",
        type=float_range(0, 1e6),
        default=50.0,
        help="µs to spin between handoffs so the receiver blocks again, 0 to 1e6 (default 50)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float_range(0, 600),
        help="idle-CPU probe of a blocked receiver, 0 (skip) to 600 (default 2, --quick 0)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin the producer and the consumer of every method to two different CPUs "
        "(default: on where two CPUs or more are usable; --no-pin: let the kernel place them)",
    )
    parser.add_argument(
        "--oversubscribe",
        type=int_range(0, 256),
        default=0,
        metavar="N",
        help="run N CPU-bound busy processes (pure Python loops) beside the measured pair for "
        "the whole run, pinned across the pair's CPUs where it is pinned, stopped after; the "
        "report says quiet (0, the default) or oversubscribed",
    )
    parser.add_argument(
        "--touch",
        action="store_true",
        help="the consumer reads every byte of every array it receives (timed, in the round "
        "trip); its minor page faults per message are reported either way",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="write every figure and the machine description as JSON"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw median round trip vs size, log-log (needs matplotlib)",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the methods and whether they can run, then exit"
    )
    parser.add_argument(
        "--pending",
        type=int_range(1, 1_000_000),
        metavar="N",
        help="instead: the round trip with N other receives pending on unsent keys in the "
        "consumer (shmrdv_send_pending; shmrdv_grpc_pending with --methods), against none, "
        "in the same run; default size 64 B",
    )


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--load`` options (load.py)."""
    parser.add_argument(
        "--load",
        action="store_true",
        help="instead: the load run (producer processes -> one consumer, every message checked)",
    )
    parser.add_argument(
        "--load-messages",
        type=int_range(1, 100_000_000),
        default=LOAD_MESSAGES,
        metavar="N",
        help=f"(default {LOAD_MESSAGES:,})",
    )
    parser.add_argument(
        "--load-producers",
        type=int_range(1, 256),
        default=LOAD_PRODUCERS,
        metavar="N",
        help=f"producer processes (default {LOAD_PRODUCERS})",
    )
    parser.add_argument(
        "--load-keys",
        type=int_range(1, 10_000_000),
        default=LOAD_KEYS,
        metavar="N",
        help=f"(default {LOAD_KEYS:,})",
    )
    parser.add_argument(
        "--load-max-size",
        type=size_option,
        default=LOAD_MAX_SIZE,
        metavar="SIZE",
        help=f"largest message (default {LOAD_MAX_SIZE})",
    )
    parser.add_argument(
        "--load-window",
        type=size_option,
        default=LOAD_WINDOW,
        metavar="SIZE",
        help=f"unconsumed bytes a producer may have out (default {LOAD_WINDOW}; "
        "latency grows with it)",
    )
    parser.add_argument(
        "--load-seed",
        type=int_range(0, 2**32 - 1),
        default=LOAD_SEED,
        metavar="N",
        help=argparse.SUPPRESS,
    )


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--soak`` options (soak.py)."""
    parser.add_argument(
        "--soak",
        type=int_range(1, 1_000_000_000),
        nargs="?",
        const=SOAK_HANDOFFS,
        metavar="N",
        help=f"instead: the soak run, N handoffs (default {SOAK_HANDOFFS:,}); RSS, descriptors, "
        "threads and /dev/shm sampled, slopes reported",
    )
    parser.add_argument(
        "--soak-max-size",
        type=size_option,
        default=SOAK_MAX_SIZE,
        metavar="SIZE",
        help=f"largest soak message (default {SOAK_MAX_SIZE})",
    )


def add_python_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--python-cost`` options (pycost.py); ``--reps`` gives its rounds."""
    parser.add_argument(
        "--python-cost",
        action="store_true",
        help="instead: Python cost of one send and one already-there recv of 64 B, no "
        "wake-up, against pickle 5 dumps+loads and Pipe (rounds: --reps, default 3)",
    )
    parser.add_argument(
        "--python-cost-count",
        type=int_range(1, 1_000_000),
        metavar="N",
        help="arrays per round, 1 to 1,000,000 (default 3,000; --quick 1,000)",
    )


def add_fan_in_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--fan-in`` options (fanin.py); ``--sizes`` (one) and ``--reps`` apply."""
    parser.add_argument(
        "--fan-in",
        type=int_range(1, 64),
        metavar="N",
        help="instead: aggregate GB/s of N producer processes into one consumer, for send, "
        "allocate, and allocate filled by the producer, against one memcpy (size: --sizes, "
        "default 16m; rounds: --reps, default 3)",
    )
    parser.add_argument(
        "--fan-in-count",
        type=int_range(1, 100_000),
        metavar="N",
        help="arrays per producer per round, 1 to 100,000 (default 40; --quick 10)",
    )


def add_syscall_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--syscalls`` option (syscalls.py); ``--methods``, ``--keys``, ``--sizes``,
    ``--pin``, ``--gap-us``, ``--touch`` and ``--json`` apply."""
    parser.add_argument(
        "--syscalls",
        type=int_range(8, 10_000_000),
        nargs="?",
        const=SYSCALL_HANDOFFS,
        metavar="N",
        help="instead: system calls and futex calls per handoff of each method (default "
        "sem_pingpong,shmrdv_send; size default 64 B), counted by `strace -f -c` over N and "
        f"N/4 handoffs (default N {SYSCALL_HANDOFFS:,}), the difference divided; needs strace",
    )


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--pipeline`` options (pipeline.py); ``--reps``, ``--methods`` and ``--pin`` apply."""
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="instead: throughput of a stream of tensors from one producer to one consumer "
        "that receives them in order, shmrdv over gRPC and shared memory against a raw grpcio "
        "server-streaming call (cases: --pipeline-cases; rounds: --reps, default 3)",
    )
    parser.add_argument(
        "--pipeline-cases",
        metavar="SIZE:COUNT,...",
        help=f"tensor size and count of each case (default {PIPELINE_CASES})",
    )


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--peer`` option (remote.py); ``--sizes``, ``--reps``, ``--budget`` apply."""
    parser.add_argument(
        "--peer",
        metavar="HOST:PORT",
        help="instead: the round trip to `shmrdv serve --listen HOST:PORT` on another host "
        "(an echo peer, as iperf's server), shmrdv over gRPC against a raw grpcio call, "
        "per size (default sizes 64,64k,1m,16m); the token, if any, from $SHMRDV_TOKEN",
    )


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench options to ``parser`` (a fresh parser or a subcommand's) and return it."""
    parser.description = (
        "Measure handing numpy arrays between two processes: shmrdv and its peers, "
        "round trip and one-way, per size. A summary (and with --details every table) goes "
        "to stdout, progress to stderr."
    )
    add_pingpong_arguments(parser)
    add_load_arguments(parser)
    add_soak_arguments(parser)
    add_python_cost_arguments(parser)
    add_fan_in_arguments(parser)
    add_syscall_arguments(parser)
    add_pipeline_arguments(parser)
    add_peer_arguments(parser)
    return parser
