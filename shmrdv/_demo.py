"""``shmrdv demo``: a real multi-process pipeline, and the same pipeline over ``multiprocessing.Queue``.

A producer process makes frames (default 4 MiB float32 images), N stage processes
transform them, a sink checks and counts them. Every hop is a rendezvous key between two
Workers: frame ``i`` goes producer -> stage ``i % N`` -> sink. With ``--hosts 2`` the
producer is a group of its own that the others may reach only through gRPC (loopback),
as if it ran on another host.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

import numpy as np

__all__ = ["build_parser", "run"]

_JOB = "demo"


def _dev(task: int) -> str:
    return f"/job:{_JOB}/replica:0/task:{task}/device:CPU:0"


def _parse_size(text: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "kmg" else t) * mult)


def _shape_for(size: int) -> tuple[int, int]:
    elems = max(size // 4, 1)
    side = max(int(elems**0.5), 1)
    return (side, max(elems // side, 1))


def _expected(i: int) -> float:
    return float(i % 1000) * 0.5 + 1.0


# -- shmrdv roles (top-level functions: spawn pickles them by name) ------------------------


def _transports(role_group: str, hosts: int) -> tuple[str, ...] | None:
    if hosts == 2 and role_group == "A":
        return ("grpc",)
    return None


def _producer(
    ns: str, frames: int, shape: tuple[int, int], stages: int, hosts: int, barrier: Any
) -> None:
    import shmrdv

    with shmrdv.Worker(_dev(0), namespace=ns, transports=_transports("A", hosts)) as w:
        rdv = w.rendezvous(0)
        keys = [shmrdv.create_key(_dev(0), 0, _dev(1 + s), "frame") for s in range(stages)]
        barrier.wait(60)
        for i in range(frames):
            key = keys[i % stages]
            buf = rdv.allocate(key, shape, np.float32)
            buf.fill(float(i % 1000))
            rdv.send(key, buf)
            del buf
        barrier.wait(600)  # stay up until every frame has been taken (gRPC pulls from us)


def _stage(
    ns: str, frames: int, shape: tuple[int, int], stages: int, hosts: int, s: int, barrier: Any
) -> None:
    import shmrdv

    me, sink = 1 + s, 1 + stages
    with shmrdv.Worker(_dev(me), namespace=ns) as w:
        rdv = w.rendezvous(0)
        src = shmrdv.create_key(_dev(0), 0, _dev(me), "frame")
        dst = shmrdv.create_key(_dev(me), 0, _dev(sink), "out")
        barrier.wait(60)
        for _ in range(s, frames, stages):
            frame = rdv.recv(src, timeout=60).value
            out = rdv.allocate(dst, shape, np.float32)
            np.multiply(frame, 0.5, out=out)
            out += 1.0
            del frame
            rdv.send(dst, out)
            del out
        barrier.wait(600)


def _sink(ns: str, frames: int, stages: int, progress: Any, barrier: Any) -> None:
    import shmrdv

    me = 1 + stages
    with shmrdv.Worker(_dev(me), namespace=ns) as w:
        rdv = w.rendezvous(0)
        keys = [shmrdv.create_key(_dev(1 + s), 0, _dev(me), "out") for s in range(stages)]
        barrier.wait(60)
        t0 = time.perf_counter()
        last = t0
        bad = 0
        for i in range(frames):
            v = rdv.recv(keys[i % stages], timeout=60).value
            e = _expected(i)
            if not (v[0, 0] == e and v[-1, -1] == e and v[v.shape[0] // 2].sum() == e * v.shape[1]):
                bad += 1
            del v
            now = time.perf_counter()
            if now - last > 0.25 or i == frames - 1:
                progress.put(("progress", i + 1, now - t0))
                last = now
        progress.put(("done", frames, time.perf_counter() - t0, bad))
        barrier.wait(600)


# -- the same pipeline over multiprocessing.Queue ---------------------------------------


def _q_producer(frames: int, shape: tuple[int, int], qs: list[Any], barrier: Any) -> None:
    barrier.wait(60)
    for i in range(frames):
        buf = np.empty(shape, np.float32)
        buf.fill(float(i % 1000))
        qs[i % len(qs)].put(buf)


def _q_stage(frames: int, s: int, stages: int, qin: Any, qout: Any, barrier: Any) -> None:
    barrier.wait(60)
    for _ in range(s, frames, stages):
        frame = qin.get(timeout=60)
        out = frame * 0.5
        out += 1.0
        qout.put(out)


def _q_sink(frames: int, stages: int, qs: list[Any], progress: Any, barrier: Any) -> None:
    barrier.wait(60)
    t0 = time.perf_counter()
    bad = 0
    for i in range(frames):
        v = qs[i % stages].get(timeout=60)
        e = _expected(i)
        if not (v[0, 0] == e and v[-1, -1] == e):
            bad += 1
    progress.put(("done", frames, time.perf_counter() - t0, bad))


# -- the driver ----------------------------------------------------------------------------


def _run_procs(
    procs: list[Any], progress: Any, frames: int, nbytes: int, label: str, live: bool
) -> tuple[float, int]:
    for p in procs:
        p.start()
    result: tuple[float, int] | None = None
    tty = sys.stderr.isatty()
    deadline = time.monotonic() + 300
    try:
        while result is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: no result within 300 s")
            try:
                msg = progress.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"{label}: process {dead[0].name} failed (exit code {dead[0].exitcode})"
                    ) from None
                continue
            if msg[0] == "progress" and live:
                _, n, dt = msg
                rate = n / dt if dt > 0 else 0.0
                line = f"  {label}: {n}/{frames} frames  {rate:7.1f} frames/s  {rate * nbytes / 1e9:6.2f} GB/s"
                # A terminal gets one updating line; a log gets a line per report.
                sys.stderr.write(f"\r{line} " if tty else f"{line}\n")
                sys.stderr.flush()
            elif msg[0] == "done":
                _, n, dt, bad = msg
                result = (dt, bad)
        for p in procs:
            p.join(60)
    finally:
        if live and tty:
            sys.stderr.write("\n")
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():  # pragma: no cover
                p.kill()
                p.join(5)
    return result


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", type=int, default=400, help="frames to push through (default 400)")
    p.add_argument(
        "--size", default="4m", help="frame size, e.g. 64k, 4m (default 4m float32 images)"
    )
    p.add_argument(
        "--stages",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="transform processes (default: cores available)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: producer reachable only through gRPC (loopback)",
    )
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the multiprocessing.Queue comparison"
    )


def run(args: argparse.Namespace) -> int:
    import shmrdv

    from ._shm.registry import collect

    if args.frames < 1 or args.stages < 1:
        print("shmrdv demo: --frames and --stages must be >= 1", file=sys.stderr)
        return 2
    try:
        size = _parse_size(args.size)
    except ValueError:
        print(f"shmrdv demo: bad --size {args.size!r}", file=sys.stderr)
        return 2
    shape = _shape_for(size)
    nbytes = shape[0] * shape[1] * 4
    frames, stages = args.frames, args.stages
    ctx = mp.get_context("spawn")
    ns = shmrdv.new_namespace()
    where = "2 worker groups joined by gRPC on loopback" if args.hosts == 2 else "shared memory"
    print(
        f"shmrdv demo: {frames} frames of {shape[0]}x{shape[1]} float32 ({nbytes / 2**20:.1f} MiB), "
        f"producer -> {stages} stage(s) -> sink, over {where}",
        flush=True,
    )
    status = 0
    try:
        progress = ctx.Queue()
        barrier = ctx.Barrier(stages + 2)
        procs = [
            ctx.Process(
                target=_producer,
                args=(ns, frames, shape, stages, args.hosts, barrier),
                name="producer",
            )
        ]
        procs += [
            ctx.Process(
                target=_stage,
                args=(ns, frames, shape, stages, args.hosts, s, barrier),
                name=f"stage{s}",
            )
            for s in range(stages)
        ]
        procs.append(
            ctx.Process(target=_sink, args=(ns, frames, stages, progress, barrier), name="sink")
        )
        dt, bad = _run_procs(procs, progress, frames, nbytes, "shmrdv", True)
        rate = frames / dt
        print(
            f"shmrdv:                 {frames} frames in {dt:6.2f} s = {rate:8.1f} frames/s, {rate * nbytes / 1e9:6.2f} GB/s, {bad} bad"
        )
        if bad:
            status = 1
        if not args.no_baseline:
            qs_in = [ctx.Queue(maxsize=4) for _ in range(stages)]
            qs_out = [ctx.Queue(maxsize=4) for _ in range(stages)]
            qbarrier = ctx.Barrier(stages + 2)
            qprog = ctx.Queue()
            qprocs = [
                ctx.Process(
                    target=_q_producer, args=(frames, shape, qs_in, qbarrier), name="q-producer"
                )
            ]
            qprocs += [
                ctx.Process(
                    target=_q_stage,
                    args=(frames, s, stages, qs_in[s], qs_out[s], qbarrier),
                    name=f"q-stage{s}",
                )
                for s in range(stages)
            ]
            qprocs.append(
                ctx.Process(
                    target=_q_sink, args=(frames, stages, qs_out, qprog, qbarrier), name="q-sink"
                )
            )
            qdt, qbad = _run_procs(qprocs, qprog, frames, nbytes, "multiprocessing.Queue", False)
            qrate = frames / qdt
            print(
                f"multiprocessing.Queue:  {frames} frames in {qdt:6.2f} s = {qrate:8.1f} frames/s, {qrate * nbytes / 1e9:6.2f} GB/s, {qbad} bad"
            )
            print(
                f"shmrdv is {qdt / dt:.1f}x the throughput of multiprocessing.Queue on this pipeline"
            )
            if qbad:
                status = 1
    finally:
        left = collect(ns)
        if left:
            print(
                f"shmrdv demo: collected {len(left)} leftover object(s) of the demo's namespace",
                file=sys.stderr,
            )
    return status
