"""``shmrdv bench --syscalls``: the system calls a handoff costs, counted by strace.

For each method and size, a child process starts the method's two roles the way a run
does (``pair.run_handoffs``) and makes exactly N handoffs; it runs under
``strace -f -c`` (every process and thread it starts), twice: with N/4 and with N
handoffs. The difference of the two counts, divided by the difference of the handoffs,
is the steady-state cost of one round trip (the array there, the ack back): startup,
imports and shutdown cancel out. Per message is half of that, as
``../shared/tools/hotpath_counts.py`` counts (the array and its ack are two messages).

strace slows every system call by microseconds, so a method that spins before it blocks
may spin less often in vain; the counts are what a handoff asks of the kernel, not a
timing. Where strace is missing the methods are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .common import format_size, parse_sizes, pin_cpus
from .machine import describe_machine

__all__ = [
    "DEFAULT_METHODS",
    "SyscallCount",
    "child_main",
    "count_handoff_syscalls",
    "format_markdown",
    "parse_strace_summary",
    "run_cli",
]

DEFAULT_METHODS = "sem_pingpong,shmrdv_send"
_TOP = 6  # the most frequent system calls shown per method


@dataclass
class SyscallCount:
    """One (method, size): calls per round trip at steady state, or why there are none."""

    method: str
    nbytes: int
    keys: str | None = None  # the key pattern (--keys) of a method that has keys
    status: str = "ok"  # "ok", "skipped" or "failed"
    reason: str | None = None
    handoffs: tuple[int, int] = (0, 0)  # the two runs' handoff counts
    per_round_trip: float = 0.0
    futex_per_round_trip: float = 0.0
    by_name: dict[str, float] = field(default_factory=dict)  # per round trip, most first

    @property
    def row(self) -> str:
        return self.method if self.keys is None else f"{self.method} · {self.keys}"

    @property
    def per_message(self) -> float:
        return self.per_round_trip / 2

    @property
    def futex_per_message(self) -> float:
        return self.futex_per_round_trip / 2


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls per system call name from ``strace -c`` output (its summary table)."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall; "total" has no usecs/call.
        if len(parts) not in (5, 6) or not parts[-1].isidentifier() or parts[-1] == "total":
            continue
        try:
            float(parts[0])
            count = int(parts[3])
        except ValueError:
            continue
        calls[parts[-1]] = calls.get(parts[-1], 0) + count
    return calls


def _strace_run(
    strace: str, method: str, nbytes: int, n: int, args: list[str], timeout: float
) -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="shmrdv_syscalls_") as d:
        out = os.path.join(d, "summary.txt")
        code = "from shmrdv._bench.syscalls import child_main; child_main()"
        cmd = [strace, "-f", "-c", "-o", out, "--", sys.executable, "-c", code]
        proc = subprocess.run(
            [*cmd, method, str(nbytes), str(n), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise RuntimeError(
                f"strace run of {n} handoffs exited {proc.returncode}: "
                + " / ".join(lines[-3:] if lines else ["(no output)"])
            )
        with open(out) as f:
            return parse_strace_summary(f.read())


def count_handoff_syscalls(
    method: str,
    nbytes: int,
    handoffs: int,
    *,
    pin: tuple[int, int] | None,
    gap_us: float = 50.0,
    touch: bool = False,
    keys: str | None = None,
    strace: str | None = None,
) -> SyscallCount:
    """Calls per round trip of ``method`` at ``nbytes`` (under key pattern ``keys``), from two
    strace runs (N/4 and N)."""
    result = SyscallCount(method, nbytes, keys)
    strace = strace or shutil.which("strace")
    if strace is None:
        result.status = "skipped"
        result.reason = "strace not found on PATH (apt-get install strace)"
        return result
    n1, n2 = max(1, handoffs // 4), handoffs
    args = [
        "-" if pin is None else f"{pin[0]},{pin[1]}",
        f"{gap_us:g}",
        "1" if touch else "0",
        keys or "-",
    ]
    timeout = 300 + n2 * (0.02 + nbytes / 1e8)
    try:
        first = _strace_run(strace, method, nbytes, n1, args, timeout)
        second = _strace_run(strace, method, nbytes, n2, args, timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        result.status = "failed"
        result.reason = str(e)
        return result
    diff = {k: (second.get(k, 0) - first.get(k, 0)) / (n2 - n1) for k in second.keys() | first}
    diff = {k: v for k, v in diff.items() if abs(v) >= 0.01}  # startup's jitter, not handoffs
    result.handoffs = (n1, n2)
    result.per_round_trip = sum(diff.values()) + 0.0  # + 0.0: no "-0.0"
    result.futex_per_round_trip = diff.get("futex", 0.0)
    top = sorted(((v, k) for k, v in diff.items() if v >= 0.05), reverse=True)[:_TOP]
    result.by_name = {k: v for v, k in top}
    return result


def child_main(argv: Sequence[str] | None = None) -> None:
    """The process strace watches: ``METHOD NBYTES N PIN GAP_US TOUCH KEYS`` (``PIN`` is
    ``-`` or ``a,b``, ``KEYS`` a key pattern or ``-``); runs ``pair.run_handoffs`` and exits
    0, or raises."""
    from .pair import run_handoffs

    argv = sys.argv[1:] if argv is None else list(argv)
    method, nbytes, n, pin, gap_us, touch, keys = argv[:7]
    cpus = None if pin == "-" else tuple(int(c) for c in pin.split(","))
    run_handoffs(
        method,
        int(nbytes),
        int(n),
        pin=None if cpus is None else (cpus[0], cpus[1]),
        gap_us=float(gap_us),
        touch=touch == "1",
        keys=None if keys == "-" else keys,
    )


def format_markdown(counts: list[SyscallCount], summary: str) -> str:
    """The counts as a markdown table, one row per (method, size)."""
    lines = [
        "# shmrdv bench --syscalls",
        "",
        f"Settings: {summary}",
        "",
        "| method | size | syscalls / round trip | futex / round trip | syscalls / message "
        "| futex / message | most frequent, per round trip |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in counts:
        if c.status != "ok":
            why = (c.reason or "").strip().splitlines()
            lines.append(
                f"| {c.row} | {format_size(c.nbytes)} | {c.status}: {why[0] if why else ''} "
                "| | | | |"
            )
            continue
        top = ", ".join(f"{name} {v:.1f}" for name, v in c.by_name.items())
        lines.append(
            f"| {c.row} | {format_size(c.nbytes)} | {c.per_round_trip:.1f} "
            f"| {c.futex_per_round_trip:.1f} | {c.per_message:.1f} | {c.futex_per_message:.1f} "
            f"| {top} |"
        )
    lines += [
        "",
        "Both processes (and every thread) together, at steady state: `strace -f -c` over "
        "N/4 and N handoffs, the difference divided by the handoffs between. A round trip is "
        "the array there and the ack back; a message is half a round trip.",
        "",
    ]
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --syscalls``: count, print the table, write ``--json``; 1 if a method
    failed, 2 on bad options."""
    from .methods import ALIASES
    from .selection import registered_methods

    methods = registered_methods()
    names = [
        ALIASES.get(n.strip(), n.strip()) for n in (args.methods or DEFAULT_METHODS).split(",")
    ]
    names = [n for n in dict.fromkeys(names) if n]
    unknown = [n for n in names if n not in methods]
    try:
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(methods)}")
        pin = pin_cpus(args.pin)
    except ValueError as e:
        print(f"shmrdv bench --syscalls: {e}", file=sys.stderr)
        return 2
    sizes = args.sizes or parse_sizes("64")
    handoffs: int = args.syscalls
    counts: list[SyscallCount] = []
    done: set[tuple[str, int, str | None]] = set()
    for name in names:
        spec = methods[name]
        patterns = [k for k in args.keys if k in spec.key_patterns] or [None]
        for keys in patterns:
            for nbytes in [spec.fixed_nbytes] if spec.fixed_nbytes else sizes:
                if (name, nbytes, keys) in done:
                    continue
                done.add((name, nbytes, keys))
                row = SyscallCount(name, nbytes, keys).row
                why = spec.available()
                if why is not None:
                    counts.append(SyscallCount(name, nbytes, keys, status="skipped", reason=why))
                else:
                    print(f"{row} · {format_size(nbytes)}: counting under strace", file=sys.stderr)
                    counts.append(
                        count_handoff_syscalls(
                            name,
                            nbytes,
                            handoffs,
                            pin=pin,
                            gap_us=args.gap_us,
                            touch=args.touch,
                            keys=keys,
                        )
                    )
                c = counts[-1]
                if c.status != "ok":
                    print(f"{row} · {format_size(nbytes)}: {c.status}: {c.reason}", file=sys.stderr)
    summary = (
        f"{max(1, handoffs // 4):,} and {handoffs:,} handoffs per method and size; "
        f"{args.gap_us:g} µs gap; "
        + ("not pinned" if pin is None else f"producer on CPU {pin[0]}, consumer on CPU {pin[1]}")
        + ("; the consumer reads every byte (--touch)" if args.touch else "")
        + f"; key pattern(s) {', '.join(args.keys)}"
    )
    sys.stdout.write(format_markdown(counts, summary))
    sys.stdout.flush()
    if args.json:
        data = {
            "syscalls": [
                {
                    **asdict(c),
                    "per_message": c.per_message,
                    "futex_per_message": c.futex_per_message,
                }
                for c in counts
            ],
            "summary": summary,
            "machine": describe_machine(),
        }
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if any(c.status == "failed" for c in counts) else 0
