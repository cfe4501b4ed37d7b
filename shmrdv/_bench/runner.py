"""``shmrdv bench``: the command's entry; the default run drives each method over the sizes
and collects the figures.

For every method the runner starts a pair of role processes (``pair.py``; what runs in
them: ``role.py``), sends it one cell per size and reads the figures back; a method that
fails is reported and the others still run. Every child is terminated, then killed, on
the way out, also on Ctrl-C or SIGTERM. Everything a method creates in ``/dev/shm``
starts with ``shmrdv_bench<runner pid>_`` and that prefix is swept in a ``finally``.
The other modes (``--load``, ``--soak``, ...) are dispatched to their modules.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from multiprocessing.context import SpawnContext
from typing import Any, TextIO

from .._procs import ChildFailed
from . import methods, options
from .busy import busy_processes
from .common import format_size, grpc_quiet_children, parse_sizes, pin_cpus
from .contract import MethodSpec
from .machine import describe_machine, load_average
from .options import DEFAULT_SIZES, QUICK_METHODS, QUICK_SIZES
from .pair import RolePair, stall_timeout, sweep
from .report import format_markdown, format_time, plot_run, write_json
from .results import BenchRun, CellResult, MethodResult
from .role import BIG
from .selection import load_plugins, select
from .textfit import wrap_line

__all__ = ["build_parser", "main", "run"]


class _Progress:
    """One updating line on a terminal; otherwise one line per finished cell."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()

    def update(self, text: str) -> None:
        if self._tty:
            self._stream.write("\r\x1b[K" + text)
            self._stream.flush()

    def line(self, text: str) -> None:
        self._stream.write(("\r\x1b[K" if self._tty else "") + text + "\n")
        self._stream.flush()

    def lines(self, text: str) -> None:
        """``text`` wrapped to ``textfit.WIDTH`` columns (an error, a list of names)."""
        self.line("\n".join(wrap_line(text)))


@dataclass
class _Options:
    sizes: list[int]
    reps: int | None
    budget_s: float
    gap_ns: int
    idle_s: float
    pin: tuple[int, int] | None  # (pinger CPU, ponger CPU)
    quick: bool


def _plan(nbytes: int, opts: _Options) -> dict[str, Any]:
    reps = opts.reps if opts.reps is not None else (3 if opts.quick or nbytes >= BIG else 5)
    return {
        "nbytes": nbytes,
        "reps": reps,
        "budget_s": opts.budget_s,
        "gap_ns": opts.gap_ns,
        "min_n": 3,
        "max_n": 2000,
    }


def _run_method(
    spec: MethodSpec,
    opts: _Options,
    mpctx: SpawnContext,
    env: dict[str, Any],
    progress: _Progress,
    result: MethodResult,
) -> None:
    sizes = [spec.fixed_nbytes] if spec.fixed_nbytes is not None else opts.sizes
    row = result.row
    progress.update(f"{row}: starting")
    roles = RolePair(
        spec,
        mpctx,
        {**env, "method": spec.name, "keys": result.keys},
        [None, None] if opts.pin is None else list(opts.pin),
    )
    ok = False
    try:
        _, result.startup_s, pinger_cpus = roles.expect("ready", 180.0)
        result.cpus = {"pinger": pinger_cpus, "ponger": roles.ponger_cpus}
        if opts.idle_s > 0 and spec.idle_cpu and spec.ponger is not None:
            progress.update(f"{row}: idle CPU of a blocked receiver ({opts.idle_s:g} s)")
            roles.send(("idle", opts.idle_s))
            result.idle_cpu_percent = roles.expect("idle", opts.idle_s + 60)[1]
        for nbytes in sizes:
            progress.update(f"{row} · {format_size(nbytes)}: warming up")
            roles.send(("cell", _plan(nbytes, opts)))
            while True:
                msg = roles.next(stall_timeout(nbytes))
                if msg[0] == "progress":
                    _, _, rep, reps, med = msg
                    progress.update(
                        f"{row} · {format_size(nbytes)}: repetition {rep}/{reps}, "
                        f"median round trip {med / 1000:,.1f} µs"
                    )
                    continue
                if msg[0] != "cell":
                    raise ChildFailed(f"expected a cell result, got {msg!r}")
                cell = CellResult(**msg[1])
                result.cells[nbytes] = cell
                progress.line(
                    f"{row:>19} {format_size(nbytes):>8}: round trip "
                    f"{format_time(cell.rtt_median_ns)} (p99 {format_time(cell.rtt_p99_ns)}), "
                    f"one-way {format_time(cell.oneway_median_ns)} "
                    f"[{cell.reps} x {cell.per_rep}, {cell.elapsed_s:.1f} s]"
                )
                break
        roles.stopping = True
        roles.send(("stop",))
        roles.expect("bye", 60.0)
        ok = True
        result.status = "ok"
    except KeyboardInterrupt:
        result.status = "interrupted"
        raise
    except ChildFailed as e:
        result.status = "failed"
        result.reason = str(e)
        lines = str(e).strip().splitlines()
        progress.lines(f"{row}: FAILED: {lines[0]} {lines[-1] if len(lines) > 1 else ''}")
    finally:
        roles.reap(30.0 if ok else 0.0)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench options to ``parser`` and return it (see ``options.build_parser``)."""
    return options.build_parser(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; the exit status (130 when interrupted)."""
    with grpc_quiet_children():
        return _run_mode(args)


def _run_mode(args: argparse.Namespace) -> int:
    modes = [
        flag
        for flag, wanted in (
            ("--load", args.load),
            ("--soak", args.soak is not None),
            ("--python-cost", args.python_cost),
            ("--pending", args.pending is not None),
            ("--fan-in", args.fan_in is not None),
            ("--syscalls", args.syscalls is not None),
            ("--pipeline", args.pipeline),
            ("--peer", args.peer is not None),
        )
        if wanted
    ]
    if len(modes) > 1:
        print(f"shmrdv bench: {' and '.join(modes)} are separate runs; give one", file=sys.stderr)
        return 2
    if args.oversubscribe and modes not in ([], ["--pending"]):
        print(
            f"shmrdv bench: --oversubscribe applies to the round-trip run, not to {modes[0]}",
            file=sys.stderr,
        )
        return 2
    if modes == ["--load"]:
        from .load import run_cli as run_load

        return run_load(args)
    if modes == ["--soak"]:
        from .soak import run_cli as run_soak

        return run_soak(args)
    if modes == ["--fan-in"]:
        from .fanin import run_cli as run_fanin

        return run_fanin(args)
    if modes == ["--syscalls"]:
        from .syscalls import run_cli as run_syscalls

        return run_syscalls(args)
    if modes == ["--pipeline"]:
        from .pipeline import run_cli as run_pipeline

        return run_pipeline(args)
    if modes == ["--peer"]:
        from .remote import run_cli as run_remote

        return run_remote(args)
    if modes == ["--python-cost"]:
        from .pycost import run_cli as run_pycost

        return run_pycost(args)
    load_plugins()
    if args.list:
        for spec in methods.METHODS.values():
            why = spec.available()
            print(f"{spec.name}: {'ok' if why is None else 'skipped: ' + why}")
            print("\n".join(wrap_line("    " + spec.label)))
        return 0
    try:
        default_sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
        sizes = args.sizes or parse_sizes("64" if args.pending else default_sizes)
        if args.methods is None and args.quick and not args.pending:
            specs = select(QUICK_METHODS, False)
        else:
            specs = select(args.methods, not args.no_baselines, "pending" if args.pending else None)
        pin = pin_cpus(args.pin)
    except ValueError as e:
        print(f"shmrdv bench: {e}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            print("shmrdv bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    opts = _Options(
        sizes=sizes,
        reps=args.reps,
        budget_s=args.budget if args.budget is not None else (0.5 if args.quick else 2.0),
        gap_ns=int(args.gap_us * 1000),
        idle_s=args.idle_seconds if args.idle_seconds is not None else (0.0 if args.quick else 2.0),
        pin=pin,
        quick=args.quick,
    )
    prefix = f"shmrdv_bench{os.getpid()}_"
    reps_text = (
        str(opts.reps) if opts.reps is not None else ("3" if opts.quick else "5 (3 from 64 MiB)")
    )
    config = {
        "sizes": sizes,
        "methods": [s.name for s in specs],
        "reps": opts.reps,
        "budget_s": opts.budget_s,
        "gap_us": opts.gap_ns / 1000,
        "idle_s": opts.idle_s,
        "pin_cpus": list(opts.pin) if opts.pin else None,
        "quick": opts.quick,
        "pending": args.pending or 0,
        "touch": args.touch,
        "keys": args.keys,
        "prefix": prefix,
        "summary": (
            f"sizes {', '.join(format_size(n) for n in sizes)}; repetitions {reps_text}; "
            f"{opts.budget_s:g} s of timed handoffs per cell; {opts.gap_ns / 1000:g} µs gap; "
            f"{_pin_text(opts.pin)}; idle probe {opts.idle_s:g} s"
            + (f"; {args.pending:,} receives pending in *_pending" if args.pending else "")
            + ("; the consumer reads every byte (--touch)" if args.touch else "")
            + f"; key pattern{'s' if len(args.keys) > 1 else ''} {', '.join(args.keys)}"
        ),
    }
    bench = BenchRun(
        machine=describe_machine(),
        config=config,
        started=datetime.now(timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
    )
    progress = _Progress(sys.stderr)
    t_start = time.monotonic()
    mpctx = multiprocessing.get_context("spawn")
    scratch = tempfile.mkdtemp(prefix=prefix)
    env = {
        "prefix": prefix,
        "scratch_dir": scratch,
        "max_nbytes": max(sizes),
        "pending": args.pending or 0,
        "touch": args.touch,
    }
    status = 0
    previous = signal.getsignal(signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    busy = contextlib.ExitStack()
    try:
        if args.oversubscribe:
            progress.update(f"starting {args.oversubscribe} busy process(es)")
        config["host"] = busy.enter_context(busy_processes(args.oversubscribe, opts.pin))
        for spec, keys in _runs(specs, args.keys):
            result = MethodResult(
                name=spec.name,
                label=spec.label,
                group=spec.group,
                status="skipped",
                receiver_array=spec.receiver_array,
                fixed_nbytes=spec.fixed_nbytes,
                baseline=spec.baseline,
                keys=keys,
            )
            bench.methods.append(result)
            why = spec.available()
            if why is not None:
                result.reason = why
                progress.lines(f"{result.row}: skipped ({why})")
                continue
            _run_method(spec, opts, mpctx, env, progress, result)
            if result.status == "failed":
                status = 1
    except KeyboardInterrupt:
        bench.interrupted = True
        status = 130
        progress.line("interrupted: stopping the children")
    finally:
        busy.close()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        swept = sweep(prefix)
        if swept:
            progress.lines(
                f"swept {len(swept)} leftover /dev/shm object(s): {', '.join(sorted(swept))}"
            )
        shutil.rmtree(scratch, ignore_errors=True)
    bench.elapsed_s = time.monotonic() - t_start
    bench.machine["load_average_end"] = load_average()
    sys.stdout.write(format_markdown(bench, details=args.details))
    sys.stdout.flush()
    if args.json:
        write_json(bench, args.json)
        progress.line(f"wrote {args.json}")
    if args.plot:
        plot_run(bench, args.plot)
        progress.line(f"wrote {args.plot}")
    return status


def _runs(specs: list[MethodSpec], keys: list[str]) -> list[tuple[MethodSpec, str | None]]:
    """Each method once per key pattern asked for that it can run (``MethodSpec.key_patterns``),
    or once without keys if it names nothing by key."""
    runs: list[tuple[MethodSpec, str | None]] = []
    for spec in specs:
        if not spec.key_patterns:
            runs.append((spec, None))
        runs += [(spec, k) for k in keys if k in spec.key_patterns]
    return runs


def _pin_text(pin: tuple[int, int] | None) -> str:
    if pin is None:
        return "not pinned"
    return (
        f"pinger (producer) on CPU {pin[0]}, ponger (consumer) on CPU {pin[1]}; "
        f"one-process methods on CPU {pin[0]}"
    )


def _sigterm_to_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """``shmrdv bench`` as a program: parse ``argv`` (default: the command line), run it.

    Returns the exit status: 0, 1 when a method failed, 2 on bad arguments, 130 when
    interrupted.
    """
    parser = build_parser(argparse.ArgumentParser(prog="shmrdv bench"))
    args = parser.parse_args(argv)
    return run(args)
