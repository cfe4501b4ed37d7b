"""The ``shmrdv`` command: demo, bench, ls, gc, serve, namespace.

Exit codes: 0 success, 1 the command ran and failed (a check failed, leftovers found),
2 bad usage (argparse's own code). Errors go to stderr; results to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence

from ._version import __version__

__all__ = ["main"]


def _cmd_namespace(args: argparse.Namespace) -> int:
    from ._namespace import new_namespace

    print(new_namespace())
    return 0


def _fmt_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


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
            f"{o.kind:9} {o.namespace:16} {step:>6} {_fmt_size(o.size):>10} {pid:>8} {alive:5} "
            f"{o.age_s:7.1f}s  {what}"
        )
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from ._shm.registry import collect

    removed = collect(args.namespace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for o in removed:
        print(f"{verb} {o.kind} {o.name} ({_fmt_size(o.size)})")
    total = sum(o.size for o in removed)
    print(
        f"{verb} {len(removed)} object(s), {_fmt_size(total)}; objects of live namespaces untouched"
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from ._cluster import ClusterSpec
    from ._worker import Worker

    if args.cluster:
        try:
            spec = json.loads(args.cluster)
        except ValueError as e:
            print(f"shmrdv serve: --cluster is not JSON: {e}", file=sys.stderr)
            return 2
        cluster = ClusterSpec(spec)
        task = args.task
    else:
        cluster = ClusterSpec.from_tf_config()
        task = args.task or ClusterSpec.tf_config_task()
    if not task:
        print("shmrdv serve: give --task (or a TF_CONFIG with a task)", file=sys.stderr)
        return 2
    token = os.environ.get("SHMRDV_TOKEN") or None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Worker(
        task, cluster=cluster, namespace=args.namespace, transports=("grpc", "shm"), token=token
    ) as w:
        print(
            f"serving {w.task} on {w.address} (incarnation {w.incarnation:016x}); Ctrl-C stops",
            flush=True,
        )
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="measure shmrdv against the peers installed here")
    try:
        from ._bench.runner import build_parser
    except ImportError:  # pragma: no cover - the bench package is part of shmrdv
        return
    build_parser(p)
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from ._bench.runner import run

    return run(args)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ._demo import build_parser

    p = sub.add_parser(
        "demo", help="run a multi-process pipeline over shmrdv and compare with mp.Queue"
    )
    build_parser(p)
    p.set_defaults(func=_run_demo)


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
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("gc", help="remove the objects of namespaces in which no worker is alive")
    p.add_argument("--namespace", help="only this namespace (its token or its id)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser(
        "serve", help="run a Worker for one task of a cluster (manual cross-host use)"
    )
    p.add_argument(
        "--task", help="task name, e.g. /job:worker/replica:0/task:0 (default: TF_CONFIG's)"
    )
    p.add_argument(
        "--cluster",
        help='cluster spec as JSON, e.g. \'{"worker": ["hostA:2222", "hostB:2222"]}\' (default: TF_CONFIG)',
    )
    p.add_argument("--namespace", help="namespace token (default: $SHMRDV_NAMESPACE)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "namespace", help="print a fresh namespace token (export SHMRDV_NAMESPACE=...)"
    )
    p.set_defaults(func=_cmd_namespace)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ._errors import RendezvousError

    parser = build_parser()
    args = parser.parse_args(argv)
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
