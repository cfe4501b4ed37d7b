"""The ``shmrdv`` command: ls, gc, namespace, and the tools of ``_bench`` (demo, bench,
serve), loaded on use.

Exit codes: 0 success, 1 the command ran and failed, 2 bad usage, 141 the reader of the
output went away (quietly, as a command killed by SIGPIPE). Errors go to stderr, results
to stdout. Thread model (``docs/threads.md``): the main thread; the demo runs its roles in
child processes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence

from . import __version__, new_namespace
from ._bench.common import format_size, parse_size
from ._errors import RendezvousError
from ._shm.reaper import collect, list_objects

__all__ = ["main"]


def _cmd_namespace(args: argparse.Namespace) -> int:
    print(new_namespace())
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    objs = list_objects(args.namespace)
    if args.json:
        print(json.dumps([o.__dict__ for o in objs], indent=1, default=str))
        return 0
    if not objs:
        print("no shmrdv objects in /dev/shm")
        return 0
    head = ("kind", "namespace id", "step", "size", "pid", "alive", "age")
    print("{:9} {:16} {:>6} {:>10} {:>8} {:5} {:>8}  task/key".format(*head))
    for o in objs:
        alive = "?" if o.alive is None else ("yes" if o.alive else "no")
        step, pid = ("" if v is None else str(v) for v in (o.step_id, o.owner_pid))
        print(
            f"{o.kind:9} {o.namespace:16} {step:>6} {format_size(o.size):>10} {pid:>8} {alive:5} "
            f"{o.age_s:7.1f}s  {o.task or o.key or o.name}"
        )
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    removed = collect(args.namespace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for o in removed:
        print(f"{verb} {o.kind} {o.name} ({format_size(o.size)})")
    total = format_size(sum(o.size for o in removed))
    print(f"{verb} {len(removed)} object(s), {total}; objects of live namespaces untouched")
    return 0


def _tool(module: str) -> Callable[[argparse.Namespace], int]:
    """The command ``_bench.<module>.run``, imported on use: the benchmark tools load late."""

    def run(args: argparse.Namespace) -> int:
        tool = importlib.import_module(f"._bench.{module}", __package__)
        rc: int = tool.run(args)
        return rc

    return run


def _frame_size(text: str) -> int:
    """argparse ``type`` for ``--size``: a usage error with an example when it is not one."""
    try:
        return parse_size(text, minimum=4)  # one float32
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmrdv",
        description="TensorFlow-style rendezvous for numpy arrays: shared memory on one host, gRPC across hosts.",
    )
    parser.add_argument("--version", action="version", version=f"shmrdv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, run: Callable[..., int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.set_defaults(func=run, parser=p)
        return p

    p = command("demo", _tool("demo"), "run a multi-process pipeline over shmrdv and mp.Queue")
    p.add_argument("--frames", type=int, default=400, help="frames to push through")
    p.add_argument("--size", type=_frame_size, default="4m", help="frame size, e.g. 64k, 4m")
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--stages", type=int, default=cores, help="transform processes")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1, help="2: gRPC, as between hosts")
    p.add_argument("--window", type=int, default=4, help="backpressure: frames in flight; 0: none")
    p.add_argument("--no-baseline", action="store_true", help="skip the multiprocessing.Queue run")
    p = command("bench", _tool("runner"), "measure shmrdv against the peers installed here")
    from ._bench.options import build_parser as add_bench_options  # the benchmarks load on use

    add_bench_options(p)
    only = "only this namespace (its token or its id)"
    p = command("ls", _cmd_ls, "list shmrdv objects in /dev/shm")
    p.add_argument("--namespace", help=only)
    p.add_argument("--json", action="store_true", help="print JSON")
    p = command("gc", _cmd_gc, "remove the objects of namespaces in which no worker is alive")
    p.add_argument("--namespace", help=only)
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p = command("serve", _tool("serve"), "an echo peer for `bench --peer`, alone or as a task")
    p.add_argument("--listen", metavar="HOST:PORT", help="alone, here; token: $SHMRDV_TOKEN")
    p.add_argument("--task", help="task name, e.g. /job:worker/task:0 (default: TF_CONFIG's)")
    p.add_argument("--cluster", help="cluster spec as JSON (default: TF_CONFIG's)")
    p.add_argument("--namespace", help="namespace token (default: $SHMRDV_NAMESPACE)")
    command("namespace", _cmd_namespace, "print a fresh namespace token")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            args, extra = build_parser().parse_known_args(argv)
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
        finally:
            sys.stdout.flush()  # here, not at exit: a closed pipe shows up in the try
    except BrokenPipeError:
        # Send what is left to /dev/null, or the interpreter's last flush prints "Exception
        # ignored ... BrokenPipeError".
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # as a shell reports a command killed by SIGPIPE (128 + 13)
