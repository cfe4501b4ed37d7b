"""The ``shmrdv`` command: demo, bench, ls, gc, serve, namespace.

Exit codes: 0 success, 1 the command ran and failed (a check failed, leftovers found),
2 bad usage (argparse's own code), 141 the reader of the output went away (as a command
killed by SIGPIPE, silently). Errors go to stderr; results to stdout.

``shmrdv demo`` is a real multi-process pipeline beside the same pipeline over
``multiprocessing.Queue``: a producer process makes frames, N stage processes transform
them, a sink checks and counts them; frame ``i`` goes producer -> stage ``i % N`` -> sink,
each hop a rendezvous key between two Workers. With ``--hosts 2`` the producer is reached
only through gRPC (loopback), as if on another host. Every Worker that sends has a window
(``max_inflight_bytes``) of ``--window`` frames per consumer, like the baseline's
``Queue(maxsize=4)``. Every process is a ``_procs.Child``; the consumers close before the
producers they pull from, so no gRPC channel sees its server go away mid-call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from . import __version__
from ._procs import ChildFailed, ChildGroup, ChildTimeout, reap, wait_for_close
from ._values import EXAMPLE, format_size, parse_size

__all__ = ["main"]


def _cmd_namespace(args: argparse.Namespace) -> int:
    from ._cluster import new_namespace

    print(new_namespace())
    return 0


# What a shell reports for a command killed by SIGPIPE (128 + 13).
_EXIT_PIPE_CLOSED = 141


def _cmd_ls(args: argparse.Namespace) -> int:
    from ._shm.registry import list_objects

    objs = list_objects(args.namespace)
    if args.json:
        print(json.dumps([o.__dict__ for o in objs], indent=1, default=str))
        return 0
    if not objs:
        print("no shmrdv objects in /dev/shm")
        return 0
    print(
        f"{'kind':9} {'namespace id':16} {'step':>6} {'size':>10} {'pid':>8} {'alive':5} "
        f"{'age':>8}  task/key"
    )
    for o in objs:
        step = "" if o.step_id is None else str(o.step_id)
        pid = "" if o.owner_pid is None else str(o.owner_pid)
        alive = "?" if o.alive is None else ("yes" if o.alive else "no")
        what = o.task or o.key or o.name
        print(
            f"{o.kind:9} {o.namespace:16} {step:>6} {format_size(o.size):>10} {pid:>8} {alive:5} "
            f"{o.age_s:7.1f}s  {what}"
        )
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from ._shm.registry import collect

    removed = collect(args.namespace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for o in removed:
        print(f"{verb} {o.kind} {o.name} ({format_size(o.size)})")
    total = sum(o.size for o in removed)
    print(
        f"{verb} {len(removed)} object(s), {format_size(total)}; objects of live namespaces untouched"
    )
    return 0


_SERVE_NEEDS = (
    "give --listen HOST:PORT for the echo peer of `shmrdv bench --peer`; or, for a task "
    "of a cluster, --task and --cluster JSON, or a TF_CONFIG holding both; and --namespace "
    "or $SHMRDV_NAMESPACE (python3 -m shmrdv namespace makes one)"
)


def _serve_until_stopped(tick: Callable[[], object] = lambda: None) -> None:
    """Block until SIGTERM or Ctrl-C, calling ``tick`` every second."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            tick()
    except KeyboardInterrupt:
        pass


def _cmd_serve_echo(args: argparse.Namespace) -> int:
    from ._bench.echo import EchoService
    from ._errors import InvalidArgumentError

    usage: argparse.ArgumentParser = args.parser
    if args.task or args.cluster or args.namespace:
        usage.error(
            "--listen runs the echo peer on its own: give it without --task, --cluster, --namespace"
        )
    try:
        service = EchoService(args.listen, token=os.environ.get("SHMRDV_TOKEN") or None)
    except InvalidArgumentError as e:
        usage.error(f"--listen: {e}")
    with service:
        port = service.address.rpartition(":")[2]
        print(
            f"echo peer listening on {service.address}; on another host run: "
            f"shmrdv bench --peer <this host>:{port}; Ctrl-C stops",
            flush=True,
        )
        _serve_until_stopped(service.expire_idle)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from . import DeviceName, Worker
    from ._bench.echo import EchoLoop
    from ._cluster import ENV_VAR, ClusterSpec

    if args.listen:
        return _cmd_serve_echo(args)
    usage: argparse.ArgumentParser = args.parser
    missing = []
    if not args.cluster and not os.environ.get("TF_CONFIG"):
        missing.append("no --cluster and TF_CONFIG is not set")
    if not args.namespace and not os.environ.get(ENV_VAR):
        missing.append(f"no --namespace and ${ENV_VAR} is not set")
    if missing:
        usage.error(f"{'; '.join(missing)}: {_SERVE_NEEDS}")
    if args.cluster:
        try:
            spec = json.loads(args.cluster)
        except ValueError as e:
            usage.error(f'--cluster is not JSON ({e}); e.g. \'{{"worker": ["hostA:2222"]}}\'')
        cluster = ClusterSpec(spec)
        task = args.task
    else:
        cluster = ClusterSpec.from_tf_config()
        task = args.task or ClusterSpec.tf_config_task()
    if not task:
        usage.error(f"no task: {_SERVE_NEEDS}")
    token = os.environ.get("SHMRDV_TOKEN") or None
    with Worker(
        task, cluster=cluster, namespace=args.namespace, transports=("grpc", "shm"), token=token
    ) as w:
        me = DeviceName.parse(w.task)
        others = [t for t in cluster.tasks() if DeviceName.parse(t) != me]
        echo = EchoLoop(w, others)
        try:
            print(
                f"serving {w.task} on {w.address} (incarnation {w.incarnation:016x}), echoing "
                f"what {len(others)} other task(s) send it; Ctrl-C stops",
                flush=True,
            )
            _serve_until_stopped()
        finally:
            echo.close()
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="measure shmrdv against the peers installed here")
    from ._bench.options import build_parser  # the options only: the benchmarks load on use

    build_parser(p)
    p.set_defaults(func=_run_bench, parser=p)


def _run_bench(args: argparse.Namespace) -> int:
    from ._bench.runner import run

    return run(args)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="run a multi-process pipeline over shmrdv and compare with mp.Queue"
    )
    _demo_options(p)
    p.set_defaults(func=_run_demo, parser=p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmrdv",
        description="TensorFlow-style rendezvous for numpy arrays: shared memory on one host, gRPC across hosts.",
    )
    parser.add_argument("--version", action="version", version=f"shmrdv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_demo(sub)
    _add_bench(sub)

    p = sub.add_parser(
        "ls",
        help="list shmrdv objects in /dev/shm (kind, namespace, step, size, owner, alive, age)",
    )
    p.add_argument("--namespace", help="only this namespace (its token or its id)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_ls, parser=p)

    p = sub.add_parser("gc", help="remove the objects of namespaces in which no worker is alive")
    p.add_argument("--namespace", help="only this namespace (its token or its id)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.set_defaults(func=_cmd_gc, parser=p)

    p = sub.add_parser(
        "serve",
        help="an echo peer: every array another host sends it comes back (shmrdv bench --peer "
        "measures against it), on its own (--listen) or as a task of a cluster",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="the echo peer of `shmrdv bench --peer HOST:PORT`, listening here "
        "(0.0.0.0:PORT: every interface); one bench at a time; token from $SHMRDV_TOKEN",
    )
    p.add_argument(
        "--task", help="task name, e.g. /job:worker/replica:0/task:0 (default: TF_CONFIG's)"
    )
    p.add_argument(
        "--cluster",
        help='cluster spec as JSON, e.g. \'{"worker": ["hostA:2222", "hostB:2222"]}\' (default: TF_CONFIG)',
    )
    p.add_argument(
        "--namespace",
        help="namespace token shared by the job's workers (default: $SHMRDV_NAMESPACE)",
    )
    p.set_defaults(func=_cmd_serve, parser=p)

    p = sub.add_parser(
        "namespace", help="print a fresh namespace token (export SHMRDV_NAMESPACE=...)"
    )
    p.set_defaults(func=_cmd_namespace, parser=p)
    return parser


def _quiet_stdout() -> None:
    """After the reader of stdout went away: send what is left to /dev/null, so that the
    interpreter's final flush does not print "Exception ignored ... BrokenPipeError"."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit: a closed pipe shows up in the try
    except BrokenPipeError:
        _quiet_stdout()
        return _EXIT_PIPE_CLOSED


def _main(argv: Sequence[str] | None) -> int:
    from ._errors import RendezvousError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse would blame the top-level parser; the flag belongs to the subcommand.
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        rc: int = args.func(args)
    except RendezvousError as e:
        print(f"shmrdv {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shmrdv {args.command}: interrupted", file=sys.stderr)
        return 130
    return rc


# -- shmrdv demo ---------------------------------------------------------------------

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


def _demo_options(p: argparse.ArgumentParser) -> None:
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


def _run_demo(args: argparse.Namespace) -> int:
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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
