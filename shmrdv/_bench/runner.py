"""``shmrdv bench``: spawns each method's two roles, drives the sizes, collects the figures.

Processes: for every method the runner spawns (``multiprocessing`` *spawn* context)
a pinger and, unless the method is single-process, a ponger. Each talks to the
runner over its own control Pipe; the two roles share a duplex ``link`` Pipe. The
pinger runs the measurement loop (``_drive``): per size it warms up, then does
``reps`` repetitions of ``n`` timed handoffs framed by two untimed CRC-checked ones,
and sends its figures back. The runner watches both processes: a role that raises,
dies or stays silent too long fails its method (the others still run), and every
child is terminated, then killed, on the way out, also on Ctrl-C or SIGTERM.
Everything a method creates in ``/dev/shm`` starts with ``shmrdv_bench<runner pid>_``
and that prefix is swept in a ``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from .._procs import Child, ChildFailed, ChildTimeout, exit_reason, reap
from .._sizes import format_size
from . import methods, options
from .common import grpc_quiet_children, parse_sizes, pin_cpus
from .contract import (
    KIND_CHECK,
    KIND_FAULTS,
    KIND_PROBE_END,
    KIND_PROBE_START,
    KIND_STOP,
    KIND_TIMED,
    Ack,
    Handler,
    MethodSpec,
    Pinger,
    RoleContext,
    make_stamp,
)
from .options import DEFAULT_SIZES, QUICK_SIZES
from .report import (
    BenchRun,
    CellResult,
    MethodResult,
    describe_machine,
    format_markdown,
    format_time,
    load_average,
    plot_run,
    write_json,
)
from .textfit import wrap_line

__all__ = ["build_parser", "main", "registered_methods", "run", "run_handoffs"]

BIG = 64 << 20  # from here on: fewer repetitions
SHM_DIR = "/dev/shm"
PLUGIN_MODULES = ("shmrdv._bench.shmrdv_methods", "shmrdv._bench.iceoryx_methods")

F32 = npt.NDArray[np.float32]


class BenchError(Exception):
    """A handoff returned the wrong data, or a role failed."""


# -- the roles (run in the spawned processes) ------------------------------------------------


def _make_src(nbytes: int) -> F32:
    src: F32 = np.random.default_rng(nbytes).random(nbytes // 4, dtype=np.float32)
    return src


def _handoff(
    pinger: Pinger, src: F32, seq: Iterator[int], kind: int, gap_ns: int
) -> tuple[int, int, Ack]:
    """One handoff: (round trip ns, one-way ns, ack); raises BenchError on wrong data."""
    stamp = make_stamp(next(seq), kind)
    src[0] = stamp
    src[-1] = stamp
    crc = zlib.crc32(src.data) if kind == KIND_CHECK else None
    prepare = getattr(pinger, "prepare", None)
    if prepare is not None:
        # Untimed: a producer that writes straight into shared memory (rdv.allocate)
        # makes its data there; what is timed is handing the finished buffer over.
        prepare(src)
    t0 = time.perf_counter_ns()
    ack = pinger.handoff(src)
    t1 = time.perf_counter_ns()
    if ack.head != stamp or ack.tail != stamp:
        raise BenchError(
            f"{format_size(src.nbytes)}: sent stamp {stamp}, the ponger saw "
            f"a[0]={ack.head} a[-1]={ack.tail}"
        )
    if crc is not None and ack.extra != crc:
        raise BenchError(
            f"{format_size(src.nbytes)}: CRC32 mismatch, sent {crc:#010x}, "
            f"the ponger computed {ack.extra:#010x}"
        )
    if gap_ns:
        # Spin, not sleep: the ponger gets time to block in its receive again, so
        # every handoff pays a wake-up (as in research/peer_numbers.md).
        until = t1 + gap_ns
        while time.perf_counter_ns() < until:
            pass
    return t1 - t0, ack.t_recv_ns - t0, ack


def _run_cell(
    pinger: Pinger, plan: dict[str, Any], seq: Iterator[int], ctrl: Connection
) -> dict[str, Any]:
    nbytes: int = plan["nbytes"]
    reps: int = plan["reps"]
    gap: int = plan["gap_ns"]
    budget_ns = plan["budget_s"] * 1e9
    src = _make_src(nbytes)
    started = time.perf_counter()
    warm: list[int] = []
    min_warm = 1 if nbytes >= BIG // 2 else 3
    while True:
        rtt, _, _ = _handoff(pinger, src, seq, KIND_TIMED, gap)
        warm.append(rtt)
        if len(warm) >= 50 or (len(warm) >= min_warm and sum(warm) >= 0.1 * budget_ns):
            break
    per = statistics.median(warm[1:] if len(warm) > 1 else warm) + gap
    n = int(0.9 * budget_ns / reps / max(per, 1.0))
    n = max(plan["min_n"], min(plan["max_n"], n))
    rtts: list[int] = []
    oneways: list[int] = []
    rep_rtt: list[float] = []
    rep_oneway: list[float] = []
    checks = 0
    # The consumer's minor page faults over every handoff from here to the last probe
    # (timed and checks alike), read by two untimed probes (issue 18 §2).
    _, _, faults_before = _handoff(pinger, src, seq, KIND_FAULTS, gap)
    for rep in range(reps):
        _handoff(pinger, src, seq, KIND_CHECK, gap)
        r_rtt: list[int] = []
        r_one: list[int] = []
        for _ in range(n):
            rtt, one, _ = _handoff(pinger, src, seq, KIND_TIMED, gap)
            r_rtt.append(rtt)
            r_one.append(one)
        _handoff(pinger, src, seq, KIND_CHECK, gap)
        checks += 2
        rtts += r_rtt
        oneways += r_one
        rep_rtt.append(float(statistics.median(r_rtt)))
        rep_oneway.append(float(statistics.median(r_one)))
        ctrl.send(("progress", nbytes, rep + 1, reps, rep_rtt[-1]))
    _, _, faults_after = _handoff(pinger, src, seq, KIND_FAULTS, gap)
    faults = (faults_after.extra - faults_before.extra) / (reps * (n + 2) + 1)
    return {
        "nbytes": nbytes,
        "reps": reps,
        "per_rep": n,
        "warmup": len(warm),
        "checks": checks,
        "rtt_median_ns": float(statistics.median(rep_rtt)),
        "rtt_p99_ns": float(np.percentile(rtts, 99)),
        "rtt_min_ns": float(min(rtts)),
        "rtt_rep_medians_ns": rep_rtt,
        "oneway_median_ns": float(statistics.median(rep_oneway)),
        "oneway_p99_ns": float(np.percentile(oneways, 99)),
        "oneway_rep_medians_ns": rep_oneway,
        "elapsed_s": time.perf_counter() - started,
        "consumer_faults_per_msg": faults,
    }


def _drive(pinger: Pinger, ctrl: Connection, started: float) -> None:
    """The pinger's command loop: hello handoffs, then idle probe / cells / stop on request."""
    seq = itertools.count(1)
    small = _make_src(64)
    for _ in range(3):  # the channel works and returns the right bytes before anything is timed
        _handoff(pinger, small, seq, KIND_CHECK, 0)
    ctrl.send(("ready", time.perf_counter() - started, sorted(os.sched_getaffinity(0))))
    while True:
        cmd = ctrl.recv()
        if cmd[0] == "idle":
            _handoff(pinger, small, seq, KIND_PROBE_START, 0)
            time.sleep(cmd[1])
            _, _, ack = _handoff(pinger, small, seq, KIND_PROBE_END, 0)
            ctrl.send(("idle", ack.extra / 10_000))  # parts per million -> percent
        elif cmd[0] == "cell":
            ctrl.send(("cell", _run_cell(pinger, cmd[1], seq, ctrl)))
        elif cmd[0] == "count":  # run_handoffs: exactly n untimed handoffs, nothing measured
            _, nbytes, n, gap_ns = cmd
            src = _make_src(nbytes)
            for _ in range(n):
                _handoff(pinger, src, seq, KIND_TIMED, gap_ns)
            ctrl.send(("count", n))
        elif cmd[0] == "stop":
            _handoff(pinger, small, seq, KIND_STOP, 0)
            return
        else:
            raise BenchError(f"unknown command from the runner: {cmd!r}")


def _role_main(
    ctrl: Connection,
    role: str,
    factory: Callable[[RoleContext], Any],
    link: Connection | None,
    shared: dict[str, Any],
    env: dict[str, Any],
) -> None:
    """A role's process (a ``_procs.Child``): build the method's end, serve or drive it.

    A failure raises out of here, and ``_procs`` sends its traceback to the runner.
    """
    started = time.perf_counter()
    handler = Handler(touch=env.get("touch", False))
    ctx = RoleContext(
        role=role,
        method=env["method"],
        link=link,
        shared=shared,
        prefix=env["prefix"],
        scratch_dir=env["scratch_dir"],
        max_nbytes=env["max_nbytes"],
        handler=handler,
        pending=env["pending"],
    )
    obj = factory(ctx)
    try:
        if role == "ponger":
            ctrl.send(("ready", time.perf_counter() - started, sorted(os.sched_getaffinity(0))))
            obj.serve(handler)
        else:
            _drive(obj, ctrl, started)
    except BaseException:
        with contextlib.suppress(BaseException):  # the first failure is the one to report
            obj.close()
        raise
    try:
        obj.close()
    except Exception as e:
        raise BenchError(f"the {role} failed in close()") from e
    ctrl.send(("bye", handler.handled))


# -- the runner side ---------------------------------------------------------------------------


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


class _Roles:
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
        child = Child(name, _role_main, *args, cpus=cpus)
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


def _stall_timeout(nbytes: int) -> float:
    # Generous: the slowest peers move ~0.3 GB/s, and a repetition has at least 5 handoffs.
    return 60.0 + nbytes / 10e6


def _run_method(
    spec: MethodSpec,
    opts: _Options,
    mpctx: SpawnContext,
    env: dict[str, Any],
    progress: _Progress,
    result: MethodResult,
) -> None:
    sizes = [spec.fixed_nbytes] if spec.fixed_nbytes is not None else opts.sizes
    progress.update(f"{spec.name}: starting")
    roles = _Roles(
        spec,
        mpctx,
        {**env, "method": spec.name},
        [None, None] if opts.pin is None else list(opts.pin),
    )
    ok = False
    try:
        _, result.startup_s, pinger_cpus = roles.expect("ready", 180.0)
        result.cpus = {"pinger": pinger_cpus, "ponger": roles.ponger_cpus}
        if opts.idle_s > 0 and spec.idle_cpu and spec.ponger is not None:
            progress.update(f"{spec.name}: idle CPU of a blocked receiver ({opts.idle_s:g} s)")
            roles.send(("idle", opts.idle_s))
            result.idle_cpu_percent = roles.expect("idle", opts.idle_s + 60)[1]
        for nbytes in sizes:
            progress.update(f"{spec.name} · {format_size(nbytes)}: warming up")
            roles.send(("cell", _plan(nbytes, opts)))
            while True:
                msg = roles.next(_stall_timeout(nbytes))
                if msg[0] == "progress":
                    _, _, rep, reps, med = msg
                    progress.update(
                        f"{spec.name} · {format_size(nbytes)}: repetition {rep}/{reps}, "
                        f"median round trip {med / 1000:,.1f} µs"
                    )
                    continue
                if msg[0] != "cell":
                    raise ChildFailed(f"expected a cell result, got {msg!r}")
                cell = CellResult(**msg[1])
                result.cells[nbytes] = cell
                progress.line(
                    f"{spec.name:>19} {format_size(nbytes):>8}: round trip "
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
        progress.lines(f"{spec.name}: FAILED: {lines[0]} {lines[-1] if len(lines) > 1 else ''}")
    finally:
        roles.reap(30.0 if ok else 0.0)


def _sweep(prefix: str) -> list[str]:
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


def _load_plugins() -> None:
    # shmrdv's own methods (shmrdv_send, shmrdv_allocate, shmrdv_grpc) register
    # themselves from this module when it exists; see contract.py.
    for module in PLUGIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def registered_methods() -> dict[str, MethodSpec]:
    """Every method by name, shmrdv's and the plugins' included (``methods.METHODS``)."""
    _load_plugins()
    return methods.METHODS


PENDING_METHODS = ("shmrdv_send", "shmrdv_send_pending")


def _select(names: str | None, with_baselines: bool, mode: str | None = None) -> list[MethodSpec]:
    """The methods to run: ``names`` (comma-separated, aliases allowed) with their
    baselines, or every method of ``mode`` (None: the default run)."""
    if not names:
        if mode == "pending":
            names = ",".join(PENDING_METHODS)
        else:
            return [m for m in methods.METHODS.values() if m.mode == mode]
    wanted = [methods.ALIASES.get(n.strip(), n.strip()) for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in methods.METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(unknown)}; known: {', '.join(methods.METHODS)}"
        )
    wrong_mode = [n for n in wanted if methods.METHODS[n].mode not in (None, mode)]
    if wrong_mode:
        raise ValueError(
            f"method(s) {', '.join(wrong_mode)} need --{methods.METHODS[wrong_mode[0]].mode}"
        )
    if with_baselines:
        extra = [methods.METHODS[n].baseline for n in wanted]
        for base in ("mp_pipe_oob", "memcpy", *(b for b in extra if b is not None)):
            if base not in wanted:
                wanted.insert(0, base)
    return [methods.METHODS[n] for n in dict.fromkeys(wanted)]


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
    _load_plugins()
    if args.list:
        for spec in methods.METHODS.values():
            why = spec.available()
            print(f"{spec.name}: {'ok' if why is None else 'skipped: ' + why}")
            print("\n".join(wrap_line("    " + spec.label)))
        return 0
    try:
        default_sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
        sizes = args.sizes or parse_sizes("64" if args.pending else default_sizes)
        specs = _select(args.methods, not args.no_baselines, "pending" if args.pending else None)
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
        budget_s=args.budget if args.budget is not None else (0.25 if args.quick else 2.0),
        gap_ns=int(args.gap_us * 1000),
        idle_s=args.idle_seconds if args.idle_seconds is not None else (1.0 if args.quick else 2.0),
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
        "prefix": prefix,
        "summary": (
            f"sizes {', '.join(format_size(n) for n in sizes)}; repetitions {reps_text}; "
            f"{opts.budget_s:g} s of timed handoffs per cell; {opts.gap_ns / 1000:g} µs gap; "
            f"{_pin_text(opts.pin)}; idle probe {opts.idle_s:g} s"
            + (f"; {args.pending:,} receives pending in *_pending" if args.pending else "")
            + ("; the consumer reads every byte (--touch)" if args.touch else "")
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
    try:
        for spec in specs:
            result = MethodResult(
                name=spec.name,
                label=spec.label,
                group=spec.group,
                status="skipped",
                receiver_array=spec.receiver_array,
                fixed_nbytes=spec.fixed_nbytes,
                baseline=spec.baseline,
            )
            bench.methods.append(result)
            why = spec.available()
            if why is not None:
                result.reason = why
                progress.lines(f"{spec.name}: skipped ({why})")
                continue
            _run_method(spec, opts, mpctx, env, progress, result)
            if result.status == "failed":
                status = 1
    except KeyboardInterrupt:
        bench.interrupted = True
        status = 130
        progress.line("interrupted: stopping the children")
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        swept = _sweep(prefix)
        if swept:
            progress.lines(
                f"swept {len(swept)} leftover /dev/shm object(s): {', '.join(sorted(swept))}"
            )
        shutil.rmtree(scratch, ignore_errors=True)
    bench.elapsed_s = time.monotonic() - t_start
    bench.machine["load_average_end"] = load_average()
    sys.stdout.write(format_markdown(bench))
    sys.stdout.flush()
    if args.json:
        write_json(bench, args.json)
        progress.line(f"wrote {args.json}")
    if args.plot:
        plot_run(bench, args.plot)
        progress.line(f"wrote {args.plot}")
    return status


def run_handoffs(
    name: str,
    nbytes: int,
    count: int,
    *,
    pin: tuple[int, int] | None,
    gap_us: float = 50.0,
    touch: bool = False,
) -> None:
    """Start method ``name``'s roles as a run does, make exactly ``count`` handoffs of
    ``nbytes`` (at the method's fixed size if it has one), stop the roles, sweep.

    Nothing is timed: ``syscalls.py`` runs this under strace to count what a handoff costs.
    Raises ``KeyError`` for an unknown method and ``ChildFailed`` when a role fails.
    """
    _load_plugins()
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
    }
    try:
        cpus: list[int | None] = [None, None] if pin is None else list(pin)
        roles = _Roles(spec, multiprocessing.get_context("spawn"), env, cpus)
        ok = False
        try:
            roles.expect("ready", 180.0)
            roles.send(("count", nbytes, count, int(gap_us * 1000)))
            roles.expect("count", _stall_timeout(nbytes) + count * (0.01 + nbytes / 1e8))
            roles.stopping = True
            roles.send(("stop",))
            roles.expect("bye", 60.0)
            ok = True
        finally:
            roles.reap(30.0 if ok else 0.0)
    finally:
        _sweep(prefix)
        shutil.rmtree(scratch, ignore_errors=True)


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
