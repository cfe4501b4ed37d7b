"""``shmrdv demo``: a real multi-process pipeline, and the same pipeline over ``multiprocessing.Queue``.

A producer process makes frames (default 4 MiB float32 images), N stage processes
transform them, a sink checks and counts them. Every hop is a rendezvous key between two
Workers: frame ``i`` goes producer -> stage ``i % N`` -> sink. With ``--hosts 2`` the
producer is a group of its own that the others may reach only through gRPC (loopback),
as if it ran on another host.

Backpressure: every Worker that sends (the producer and the stages) has a window
(``Worker(max_inflight_bytes=...)``) of ``--window`` frames per consumer (default 4, like
the baseline's ``multiprocessing.Queue(maxsize=4)``): a producer that runs ahead of a slow
stage waits for it instead of filling /dev/shm. ``--window 0`` turns it off.

Every process is a ``shmrdv._procs.Child``: it dies with the demo, and the demo closes
them in order: the consumers first, then the producer they pull from, so that no gRPC
channel sees its server go away (no "GOAWAY ... Cancelling all calls" log line).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ._procs import ChildFailed, ChildGroup, ChildTimeout, reap, wait_for_close
from ._values import EXAMPLE, parse_size

__all__ = ["build_parser", "run"]

_JOB = "demo"


def _dev(task: int) -> str:
    return f"/job:{_JOB}/replica:0/task:{task}/device:CPU:0"


def _frame_size(text: str) -> int:
    """argparse ``type`` for ``--size``: a usage error with an example when it is not one."""
    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 4:
        raise argparse.ArgumentTypeError(
            f"frame size {text!r} is less than one float32 (4 bytes); give {EXAMPLE}"
        )
    return size


def _shape_for(size: int) -> tuple[int, int]:
    elems = max(size // 4, 1)
    side = max(int(elems**0.5), 1)
    return (side, max(elems // side, 1))


def _expected(i: int) -> float:
    return float(i % 1000) * 0.5 + 1.0


# -- shmrdv roles (top-level functions: spawn pickles them by name) ------------------------
# Each runs in a Child: ``conn`` is its control pipe; after its work it waits for "close".


def _transports(role_group: str, hosts: int) -> tuple[str, ...] | None:
    if hosts == 2 and role_group == "A":
        return ("grpc",)
    return None


def _producer(
    conn: Connection,
    ns: str,
    frames: int,
    shape: tuple[int, int],
    stages: int,
    hosts: int,
    window: int | None,
    go: Any,
) -> None:
    import shmrdv

    with shmrdv.Worker(
        _dev(0), namespace=ns, transports=_transports("A", hosts), max_inflight_bytes=window
    ) as w:
        rdv = w.rendezvous(0)
        keys = [shmrdv.create_key(_dev(0), 0, _dev(1 + s), "frame") for s in range(stages)]
        go.wait(60)
        for i in range(frames):
            key = keys[i % stages]
            buf = rdv.allocate(key, shape, np.float32)
            buf.fill(float(i % 1000))
            rdv.send(key, buf, timeout=60)  # waits while the window to that stage is full
            del buf
        # Stay up until the demo says so: with --hosts 2 the stages pull from us over gRPC,
        # and they close their channels before we stop our server.
        wait_for_close(conn)


def _stage(
    conn: Connection,
    ns: str,
    frames: int,
    shape: tuple[int, int],
    stages: int,
    s: int,
    window: int | None,
    go: Any,
) -> None:
    import shmrdv

    me, sink = 1 + s, 1 + stages
    with shmrdv.Worker(_dev(me), namespace=ns, max_inflight_bytes=window) as w:
        rdv = w.rendezvous(0)
        src = shmrdv.create_key(_dev(0), 0, _dev(me), "frame")
        dst = shmrdv.create_key(_dev(me), 0, _dev(sink), "out")
        go.wait(60)
        for _ in range(s, frames, stages):
            frame = rdv.recv(src, timeout=60).value
            out = rdv.allocate(dst, shape, np.float32)
            np.multiply(frame, 0.5, out=out)
            out += 1.0
            del frame
            rdv.send(dst, out, timeout=60)
            del out
        wait_for_close(conn)  # the sink may still be taking our last frames


def _count(conn: Connection, frames: int, take: Callable[[int], bool]) -> None:
    """A sink's loop: ``take(i)`` receives frame ``i`` and says whether it is right. Reports
    progress, then ``("done", frames, seconds, bad)``, timed from the first frame received
    to the last: start-up (spawn, imports, the first frame through the pipeline) excluded."""
    bad = 0
    first = last = 0.0
    for i in range(frames):
        if not take(i):
            bad += 1
        now = time.perf_counter()
        if i == 0:
            first = last = now
        elif now - last > 0.25 or i == frames - 1:
            conn.send(("progress", i + 1, now - first))
            last = now
    conn.send(("done", frames, last - first, bad))
    wait_for_close(conn)


def _sink(conn: Connection, ns: str, frames: int, stages: int, go: Any) -> None:
    import shmrdv

    me = 1 + stages
    with shmrdv.Worker(_dev(me), namespace=ns) as w:
        rdv = w.rendezvous(0)
        keys = [shmrdv.create_key(_dev(1 + s), 0, _dev(me), "out") for s in range(stages)]

        def take(i: int) -> bool:
            v = rdv.recv(keys[i % stages], timeout=60).value
            e = _expected(i)
            return bool(
                v[0, 0] == e and v[-1, -1] == e and v[v.shape[0] // 2].sum() == e * v.shape[1]
            )

        go.wait(60)
        _count(conn, frames, take)


# -- the same pipeline over multiprocessing.Queue ---------------------------------------


def _q_producer(
    conn: Connection, frames: int, shape: tuple[int, int], qs: list[Any], go: Any
) -> None:
    go.wait(60)
    for i in range(frames):
        buf = np.empty(shape, np.float32)
        buf.fill(float(i % 1000))
        qs[i % len(qs)].put(buf)
    wait_for_close(conn)


def _q_stage(
    conn: Connection, frames: int, s: int, stages: int, qin: Any, qout: Any, go: Any
) -> None:
    go.wait(60)
    for _ in range(s, frames, stages):
        frame = qin.get(timeout=60)
        out = frame * 0.5
        out += 1.0
        qout.put(out)
    wait_for_close(conn)


def _q_sink(conn: Connection, frames: int, stages: int, qs: list[Any], go: Any) -> None:
    def take(i: int) -> bool:
        v = qs[i % stages].get(timeout=60)
        e = _expected(i)
        return bool(v[0, 0] == e and v[-1, -1] == e and v[v.shape[0] // 2].sum() == e * v.shape[1])

    go.wait(60)
    _count(conn, frames, take)


# -- the driver ----------------------------------------------------------------------------

# Seconds a run may take, and the grace a closing process gets before it is stopped.
_RUN_S = 300.0
_CLOSE_S = 60.0


def _run_group(group: ChildGroup, frames: int, nbytes: int, label: str) -> tuple[float, int]:
    """Follow the sink's reports until its "done" (seconds from its first frame to its last,
    bad frames); then close consumers before producers."""
    sink = group["sink"]
    others = [c.name for c in group if c is not sink]
    tty = sys.stderr.isatty()
    deadline = time.monotonic() + _RUN_S
    result: tuple[float, int] | None = None
    try:
        while result is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: no result within {_RUN_S:g} s")
            try:
                msg = sink.recv(0.5, "progress")
            except ChildTimeout:
                group.check_alive(others)
                continue
            if msg[0] == "progress":
                _, n, dt = msg
                rate = (n - 1) / dt if dt > 0 else 0.0
                line = f"  {label}: {n}/{frames} frames  {rate:7.1f} frames/s  {rate * nbytes / 1e9:6.2f} GB/s"
                # A terminal gets one updating line; a log gets a line per report.
                sys.stderr.write(f"\r{line} " if tty else f"{line}\n")
                sys.stderr.flush()
            elif msg[0] == "done":
                _, n, dt, bad = msg
                result = (dt, bad)
    except ChildFailed as e:
        raise RuntimeError(f"{label}: {e}") from None
    finally:
        if tty:
            sys.stderr.write("\n")
    # Consumers close first (their gRPC channels, their Workers), then the producer.
    for wave in ([c for c in group if c.name != "producer"], [group["producer"]]):
        for child in wave:
            try:
                child.send(("close",))
            except ChildFailed:
                pass  # already gone: reap reports nothing more
        reap(wave, _CLOSE_S)
    return result


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", type=int, default=400, help="frames to push through (default 400)")
    p.add_argument(
        "--size",
        type=_frame_size,
        default="4m",
        help="frame size, e.g. 64k, 4m, 1g (default 4m float32 images)",
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
        help="2: producer reachable only through gRPC (loopback), as from another host",
    )
    p.add_argument(
        "--window",
        type=int,
        default=4,
        help="backpressure: at most this many frames in flight from a sender to each of its "
        "consumers (Worker(max_inflight_bytes=...)); 0: no window (default 4)",
    )
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the multiprocessing.Queue comparison"
    )


def _rate(frames: int, seconds: float) -> float | None:
    """Frames per second from the first frame received to the last (None: fewer than two)."""
    return (frames - 1) / seconds if frames > 1 and seconds > 0 else None


def _result_line(label: str, frames: int, seconds: float, bad: int, nbytes: int) -> str:
    rate = _rate(frames, seconds)
    if rate is None:
        return f"{label + ':':23} {frames} frame(s), {bad} bad (a rate takes two frames)"
    return (
        f"{label + ':':23} {frames} frames, the last {frames - 1} in {seconds:6.2f} s = "
        f"{rate:8.1f} frames/s, {rate * nbytes / 1e9:6.2f} GB/s, {bad} bad"
    )


def _comparison(ratio: float, hosts: int) -> str:
    if hosts == 2:
        return (
            f"shmrdv over gRPC is {ratio:.1f}x the throughput of multiprocessing.Queue: this "
            "compares the network path (here on loopback) with a queue that works only "
            "within one host; without --hosts 2 the same pipeline runs over shared memory"
        )
    return f"shmrdv is {ratio:.1f}x the throughput of multiprocessing.Queue on this pipeline"


def run(args: argparse.Namespace) -> int:
    import shmrdv

    from ._shm.registry import collect

    if args.frames < 1 or args.stages < 1:
        print("shmrdv demo: --frames and --stages must be >= 1", file=sys.stderr)
        return 2
    if args.window < 0:
        print("shmrdv demo: --window must be >= 0 (0: no window)", file=sys.stderr)
        return 2
    shape = _shape_for(args.size)
    nbytes = shape[0] * shape[1] * 4
    frames, stages = args.frames, args.stages
    ctx = mp.get_context("spawn")
    ns = shmrdv.new_namespace()
    where = (
        "2 worker groups joined by gRPC on loopback (as between hosts)"
        if args.hosts == 2
        else "shared memory"
    )
    print(
        f"shmrdv demo: {frames} frames of {shape[0]}x{shape[1]} float32 ({nbytes / 2**20:.1f} MiB), "
        f"producer -> {stages} stage(s) -> sink, over {where}",
        flush=True,
    )
    window = args.window * nbytes if args.window else None
    print(
        f"backpressure: at most {args.window} frames ({window / 2**20:.1f} MiB) in flight from "
        "each sender to each consumer (Worker(max_inflight_bytes=...); --window 0: none)"
        if window
        else "backpressure: none (--window 0): a sender never waits for its consumers",
        flush=True,
    )
    print(
        "frames/s: from the first frame the sink receives to the last, so start-up (processes, "
        "imports, the first frame through the pipeline) is not counted",
        flush=True,
    )
    status = 0
    try:
        with ChildGroup() as group:
            go = ctx.Barrier(stages + 2)
            group.start("producer", _producer, ns, frames, shape, stages, args.hosts, window, go)
            for s in range(stages):
                group.start(f"stage{s}", _stage, ns, frames, shape, stages, s, window, go)
            group.start("sink", _sink, ns, frames, stages, go)
            dt, bad = _run_group(group, frames, nbytes, "shmrdv")
        print(_result_line("shmrdv", frames, dt, bad, nbytes), flush=True)
        if bad:
            status = 1
        if not args.no_baseline:
            qs_in = [ctx.Queue(maxsize=4) for _ in range(stages)]
            qs_out = [ctx.Queue(maxsize=4) for _ in range(stages)]
            with ChildGroup() as group:
                go = ctx.Barrier(stages + 2)
                group.start("producer", _q_producer, frames, shape, qs_in, go)
                for s in range(stages):
                    group.start(f"stage{s}", _q_stage, frames, s, stages, qs_in[s], qs_out[s], go)
                group.start("sink", _q_sink, frames, stages, qs_out, go)
                qdt, qbad = _run_group(group, frames, nbytes, "multiprocessing.Queue")
            for q in qs_in + qs_out:
                q.close()
                q.join_thread()
            print(_result_line("multiprocessing.Queue", frames, qdt, qbad, nbytes))
            rate, qrate = _rate(frames, dt), _rate(frames, qdt)
            if rate is not None and qrate is not None:
                print(_comparison(rate / qrate, args.hosts))
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
