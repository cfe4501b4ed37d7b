"""One role of a ``shmrdv bench`` method, in its own process: the method's end built from
its factory, then the ponger's ``serve`` or the pinger's measurement loop.

The pinger runs the measurement loop (``_drive``): per size it warms up, then does
``reps`` repetitions of ``n`` timed handoffs framed by two untimed CRC-checked ones,
and sends its figures back to the runner over its control Pipe. ``pair.py`` starts and
watches the two processes from the runner's side.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time
import zlib
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .common import format_size
from .contract import (
    F32,
    KIND_CHECK,
    KIND_FAULTS,
    KIND_PROBE_END,
    KIND_PROBE_START,
    KIND_STOP,
    KIND_TIMED,
    Ack,
    Handler,
    Pinger,
    Preparer,
    RoleContext,
    make_stamp,
)

__all__ = ["BIG", "BenchError", "role_main"]

BIG = 64 << 20  # from here on: fewer repetitions


class BenchError(Exception):
    """A handoff returned the wrong data, or a role failed."""


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
    if isinstance(pinger, Preparer):
        # Untimed: a producer that writes straight into shared memory (rdv.allocate)
        # makes its data there; what is timed is handing the finished buffer over.
        pinger.prepare(src)
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
    # (timed and checks alike), read by two untimed probes.
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


def role_main(
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
        keys=env.get("keys"),
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
