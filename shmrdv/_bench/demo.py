"""``shmrdv demo``: a producer, N stages and a sink, frame ``i`` through stage ``i % N``, each hop
a key between two Workers; then the same over ``multiprocessing.Queue``. Each role is a
``_procs.Child`` that waits at the barrier ``go``, and after its work for "close".
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .. import Worker, create_key, new_namespace
from .._procs import ChildFailed, ChildTimeout, reap, wait_for_close
from .._shm.reaper import collect
from .children import ChildGroup

__all__ = ["run"]


@dataclass(frozen=True)
class _Run:
    frames: int
    shape: tuple[int, int]
    stages: int
    ns: str
    hosts: int
    window: int | None  # max_inflight_bytes of every sender

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4


def _dev(task: int) -> str:
    return f"/job:demo/replica:0/task:{task}/device:CPU:0"


def _producer(conn: Connection, run: _Run, go: Any) -> None:
    # --hosts 2: the stages reach the producer only through gRPC, as on another host.
    transports = ("grpc",) if run.hosts == 2 else None
    with Worker(
        _dev(0), namespace=run.ns, transports=transports, max_inflight_bytes=run.window
    ) as w:
        rdv = w.rendezvous(0)
        keys = [create_key(_dev(0), 0, _dev(1 + s), "frame") for s in range(run.stages)]
        go.wait(60)
        for i in range(run.frames):
            buf = rdv.allocate(keys[i % run.stages], run.shape, np.float32)
            buf.fill(float(i % 1000))
            rdv.send(keys[i % run.stages], buf, timeout=60)  # waits while the window is full
            del buf
        wait_for_close(conn)  # the stages may still pull from our server


def _stage(conn: Connection, run: _Run, go: Any, s: int) -> None:
    me = _dev(1 + s)
    with Worker(me, namespace=run.ns, max_inflight_bytes=run.window) as w:
        rdv = w.rendezvous(0)
        src = create_key(_dev(0), 0, me, "frame")
        dst = create_key(me, 0, _dev(1 + run.stages), "out")
        go.wait(60)
        for _ in range(s, run.frames, run.stages):
            frame = rdv.recv(src, timeout=60).value
            out = rdv.allocate(dst, run.shape, np.float32)
            np.multiply(frame, 0.5, out=out)
            out += 1.0
            del frame
            rdv.send(dst, out, timeout=60)
            del out
        wait_for_close(conn)  # the sink may still be taking our last frames


def _sink(conn: Connection, run: _Run, go: Any) -> None:
    me = _dev(1 + run.stages)
    with Worker(me, namespace=run.ns) as w:
        rdv = w.rendezvous(0)
        keys = [create_key(_dev(1 + s), 0, me, "out") for s in range(run.stages)]
        _count(conn, run, go, lambda i: rdv.recv(keys[i % run.stages], timeout=60).value)


def _count(conn: Connection, run: _Run, go: Any, take: Callable[[int], Any]) -> None:
    """A sink's loop: ``take(i)`` receives frame ``i`` (the producer's ``i % 1000`` * 0.5 + 1);
    reports progress, then ``("done", seconds from the first frame to the last, bad)``."""
    go.wait(60)
    bad = 0
    first = last = 0.0
    for i in range(run.frames):
        v, e = take(i), float(i % 1000) * 0.5 + 1.0
        bad += not (v[0, 0] == e and v[-1, -1] == e and v[len(v) // 2].sum() == e * v.shape[1])
        now = time.perf_counter()
        if i == 0:
            first = last = now
        elif now - last > 0.25 or i == run.frames - 1:
            conn.send(("progress", i + 1, now - first))
            last = now
    conn.send(("done", last - first, bad))
    wait_for_close(conn)


def _q_producer(conn: Connection, run: _Run, go: Any, qs: Any) -> None:
    go.wait(60)
    for i in range(run.frames):
        qs[0][i % run.stages].put(np.full(run.shape, float(i % 1000), np.float32))
    wait_for_close(conn)


def _q_stage(conn: Connection, run: _Run, go: Any, qs: Any, s: int) -> None:
    go.wait(60)
    for _ in range(s, run.frames, run.stages):
        out = qs[0][s].get(timeout=60) * 0.5
        out += 1.0
        qs[1][s].put(out)
    wait_for_close(conn)


def _q_sink(conn: Connection, run: _Run, go: Any, qs: Any) -> None:
    _count(conn, run, go, lambda i: qs[1][i % run.stages].get(timeout=60))


def _pipeline(
    run: _Run, label: str, roles: tuple[Callable[..., None], ...], *links: Any
) -> tuple[float, int]:
    """Run the roles, printing the sink's progress, then close the consumers before the
    producer; the sink's seconds and how many frames were wrong."""
    producer, stage, sink = roles
    with ChildGroup() as group:
        go = mp.get_context("spawn").Barrier(run.stages + 2)
        group.start("producer", producer, run, go, *links)
        for s in range(run.stages):
            group.start(f"stage{s}", stage, run, go, *links, s)
        group.start("sink", sink, run, go, *links)
        tty = sys.stderr.isatty()
        try:
            while (msg := _next(group, "sink"))[0] != "done":
                _, n, dt = msg
                rate = _rate(n, dt) or 0.0
                line = f"  {label}: {n}/{run.frames} frames  {rate:7.1f} frames/s  {rate * run.nbytes / 1e9:6.2f} GB/s"
                # A terminal gets one updating line; a log gets a line per report.
                sys.stderr.write(f"\r{line} " if tty else f"{line}\n")
                sys.stderr.flush()
        except ChildFailed as e:
            raise RuntimeError(f"{label}: {e}") from None
        finally:
            if tty:
                print(file=sys.stderr)
        for wave in ([c for c in group if c.name != "producer"], [group["producer"]]):
            for child in wave:
                with contextlib.suppress(ChildFailed):  # already gone: reap reports the rest
                    child.send(("close",))
            reap(wave, 60.0)
    return msg[1], msg[2]


def _next(group: ChildGroup, name: str) -> tuple[Any, ...]:
    """The next message of child ``name``, while watching the others for failures."""
    while True:
        try:
            return group[name].recv(0.5, "progress")
        except ChildTimeout:
            group.check_alive(c.name for c in group if c.name != name)


def _rate(frames: int, seconds: float) -> float | None:
    return (frames - 1) / seconds if frames > 1 and seconds > 0 else None


def _result_line(label: str, frames: int, seconds: float, bad: int, nbytes: int) -> str:
    if (rate := _rate(frames, seconds)) is None:
        return f"{label + ':':23} {frames} frame(s), {bad} bad (a rate takes two frames)"
    return (
        f"{label + ':':23} {frames} frames, the last {frames - 1} in {seconds:6.2f} s = "
        f"{rate:8.1f} frames/s, {rate * nbytes / 1e9:6.2f} GB/s, {bad} bad"
    )


def run(args: argparse.Namespace) -> int:
    """``shmrdv demo``: its exit code (1 if a frame arrived wrong)."""
    if args.frames < 1 or args.stages < 1 or args.window < 0:
        args.parser.error("--frames and --stages must be >= 1, --window >= 0 (0: no window)")
    elems = args.size // 4
    shape = (int(elems**0.5), elems // int(elems**0.5))
    window = args.window * shape[0] * shape[1] * 4 or None
    run = _Run(args.frames, shape, args.stages, new_namespace(), args.hosts, window)
    where = "gRPC on loopback (as between hosts)" if args.hosts == 2 else "shared memory"
    print(
        f"shmrdv demo: {run.frames} frames of {shape[0]}x{shape[1]} float32 "
        f"({run.nbytes / 2**20:.1f} MiB), producer -> {run.stages} stage(s) -> sink, over {where}",
        f"backpressure: at most {args.window} frames ({window / 2**20:.1f} MiB) in flight from "
        "each sender to each consumer (Worker(max_inflight_bytes=...))"
        if window
        else "backpressure: none (--window 0): a sender never waits for its consumers",
        "frames/s: from the first frame the sink receives to the last, so start-up "
        "(processes, imports, the first frame through the pipeline) is not counted",
        sep="\n",
        flush=True,
    )
    try:
        dt, bad = _pipeline(run, "shmrdv", (_producer, _stage, _sink))
        print(_result_line("shmrdv", run.frames, dt, bad, run.nbytes), flush=True)
        if args.no_baseline:
            return int(bad > 0)
        # The baseline's bound, as the window's: a queue of 4 frames between each two stages.
        ctx = mp.get_context("spawn")
        qs = [[ctx.Queue(maxsize=4) for _ in range(run.stages)] for _ in "io"]
        qdt, qbad = _pipeline(run, "multiprocessing.Queue", (_q_producer, _q_stage, _q_sink), qs)
        for q in qs[0] + qs[1]:
            q.close()
            q.join_thread()
        print(_result_line("multiprocessing.Queue", run.frames, qdt, qbad, run.nbytes))
        rate, qrate = _rate(run.frames, dt), _rate(run.frames, qdt)
        if rate is not None and qrate is not None:
            ratio = f"{rate / qrate:.1f}x the throughput of multiprocessing.Queue"
            print(
                f"shmrdv over gRPC is {ratio}: this compares the network path (here on "
                "loopback) with a queue that works only within one host; without --hosts 2 "
                "the same pipeline runs over shared memory"
                if args.hosts == 2
                else f"shmrdv is {ratio} on this pipeline"
            )
        return int(bad > 0 or qbad > 0)
    finally:
        if left := collect(run.ns):
            print(
                f"shmrdv demo: collected {len(left)} leftover object(s) of its namespace",
                file=sys.stderr,
            )
