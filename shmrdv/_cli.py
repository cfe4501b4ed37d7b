"""The ``shmrdv`` command: demo, bench, ls, gc, serve, namespace.

Exit codes: 0 success, 1 the command ran and failed (a check failed, leftovers found),
2 bad usage (argparse's own code), 141 the reader of the output went away (as a command
killed by SIGPIPE, silently). Errors go to stderr; results to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from ._values import format_size
from ._version import __version__

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
    from ._demo import build_parser

    p = sub.add_parser(
        "demo", help="run a multi-process pipeline over shmrdv and compare with mp.Queue"
    )
    build_parser(p)
    p.set_defaults(func=_run_demo, parser=p)


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo import run

    return run(args)


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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
