"""``shmrdv bench --load``: many producer processes, one consumer, every message checked.

Shape: ``producers`` spawned processes, each a ``shmrdv.Worker`` task, send
``messages`` arrays of mixed sizes over ``keys`` rendezvous keys to one consumer process
(a Worker too). Key ``k`` belongs to producer ``k % producers``; a producer interleaves
its keys in a seeded random order. Every message is a ``uint8`` array that starts with a
32-byte header — magic, producer, key index, sequence number within the key, size, the
producer's ``CLOCK_MONOTONIC`` send time, and the CRC32 of the rest — so the consumer can
check that every message arrived, once, in FIFO order per key, with the right bytes.

``load_plan.py`` holds the configuration and the plan, ``load_roles.py`` the processes;
this module runs them and reports.

Afterwards no process of the run may be alive and nothing of its namespace may be left in
``/dev/shm``: the run lists the namespace (``reaper.list_objects``), reports what it finds,
and collects it (``reaper.collect``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._procs import ChildTimeout
from . import children, options
from .children import Teardown
from .common import format_size
from .load_plan import LoadConfig, make_plan
from .load_roles import consumer_main, producer_main

__all__ = ["LoadResult", "format_load", "run_cli", "run_load"]


@dataclass
class LoadResult(Teardown):
    """Everything a load run measured and checked; ``ok`` says whether it all held."""

    config: dict[str, Any]
    planned_messages: int
    planned_bytes: int
    delivered: int = 0
    unique: int = 0
    missing: int = 0
    duplicates: int = 0
    fifo_violations: int = 0
    bad_checksum: int = 0
    bad_header: int = 0
    size_mismatch: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    latency_ns: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    messages_per_s: float = 0.0
    gb_per_s: float = 0.0
    producers: list[dict[str, Any]] = field(default_factory=list)
    consumer_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            self.clean
            and self.delivered == self.planned_messages
            and self.unique == self.planned_messages
            and self.missing == 0
            and self.duplicates == 0
            and self.fifo_violations == 0
            and self.bad_checksum == 0
            and self.bad_header == 0
            and self.size_mismatch == 0
            and not self.errors
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out


def run_load(cfg: LoadConfig, progress: Callable[[str], None] | None = None) -> LoadResult:
    """Run one load test with real processes and return what it measured.

    Blocks until every message is in (at most ``cfg.timeout_s``) and every child is gone.
    A child that fails, dies or hangs is reported in ``failure``, never raised; ``ValueError``
    for a bad ``cfg``.
    """
    say = progress or (lambda text: None)
    plan = make_plan(cfg)
    result = LoadResult(
        config=dataclasses.asdict(cfg),
        planned_messages=cfg.messages,
        planned_bytes=plan.total_bytes,
    )
    mpctx = multiprocessing.get_context("spawn")
    go = mpctx.Event()
    consumed = mpctx.RawArray(ctypes.c_int64, cfg.producers)

    sent: dict[str, dict[str, Any]] = {}

    def on_progress(msg: tuple[Any, ...]) -> bool:
        if msg[0] == "progress":
            say(f"load: {msg[1]:,}/{cfg.messages:,} messages checked")
            return True
        return False

    producers = [f"producer{p}" for p in range(cfg.producers)]
    with children.run(result) as run:
        group, namespace = run.group, run.namespace
        say(
            f"load: {cfg.messages:,} messages ({format_size(plan.total_bytes)}) from "
            f"{cfg.producers} producers over {cfg.keys:,} keys"
        )
        group.start("consumer", consumer_main, cfg, namespace, go, consumed)
        for p, name in enumerate(producers):
            group.start(name, producer_main, p, cfg, namespace, go, consumed)
        group["consumer"].expect("ready", 180.0)
        for name in producers:
            group[name].expect("ready", 180.0)
        t0 = time.monotonic()
        go.set()
        deadline = t0 + cfg.timeout_s + 60.0
        while True:
            try:
                done = group["consumer"].expect("done", 1.0, on_progress)[1]
                break
            except ChildTimeout:
                if time.monotonic() > deadline:
                    raise
                for name in producers:  # a failed producer fails the run now, not at timeout
                    if name not in sent and group[name].poll():
                        sent[name] = group[name].expect("sent", 0.0)[1]
        for name in producers:
            if name not in sent:
                sent[name] = group[name].expect("sent", 60.0)[1]
        result.elapsed_s = time.monotonic() - t0
        run.close((*producers, "consumer"))
        result.producers = [sent[name] for name in producers]
        for f in (
            "delivered",
            "unique",
            "missing",
            "duplicates",
            "fifo_violations",
            "bad_checksum",
            "bad_header",
            "size_mismatch",
            "bytes",
            "errors",
            "latency_ns",
        ):
            setattr(result, f, done[f])
        result.consumer_stats = done["stats"]
        span_ns = done["last_recv_ns"] - done["first_send_ns"]
        if span_ns > 0:
            result.elapsed_s = span_ns / 1e9
            result.messages_per_s = result.delivered / result.elapsed_s
            result.gb_per_s = result.bytes / span_ns
    return result


# -- report and command line ---------------------------------------------------------------------


def format_load(r: LoadResult) -> str:
    """The run as a short Markdown report."""
    cfg = r.config
    lat = r.latency_ns
    lines = [
        "## shmrdv load",
        "",
        f"{cfg['producers']} producer processes -> 1 consumer process, {cfg['messages']:,} "
        f"messages over {cfg['keys']:,} keys, sizes {format_size(cfg['min_size'])} - "
        f"{format_size(cfg['max_size'])} (seed {cfg['seed']}), window "
        f"{format_size(cfg['window_bytes'])} per producer",
        "",
        "| check | result |",
        "|---|---|",
        f"| delivered | {r.delivered:,} / {r.planned_messages:,} (unique {r.unique:,}, "
        f"missing {r.missing:,}) |",
        f"| duplicates | {r.duplicates} |",
        f"| FIFO violations (per key) | {r.fifo_violations} |",
        f"| bad checksum / header / size | {r.bad_checksum} / {r.bad_header} / {r.size_mismatch} |",
        f"| receive errors | {len(r.errors)} |",
        f"| left in /dev/shm after close | {len(r.leftover_objects)} |",
        f"| processes left / had to be stopped | {r.processes_left} / {r.processes_stopped} |",
        "",
    ]
    if lat:
        lines += [
            "| latency (send stamp -> consumer callback) | µs |",
            "|---|---|",
            *(f"| {q} | {lat[q] / 1000:,.1f} |" for q in ("p50", "p90", "p99", "p999", "max")),
            "",
        ]
    lines += [
        f"Throughput: {r.messages_per_s:,.0f} messages/s, {r.gb_per_s:.2f} GB/s "
        f"({r.bytes / 1e9:.2f} GB in {r.elapsed_s:.2f} s, first send to last receive); "
        f"wall {r.wall_s:.1f} s with start-up.",
        "",
    ]
    if r.producers:
        waits = sum(p["window_waits"] for p in r.producers)
        zc = sum(p["zero_copy"] for p in r.producers)
        lines += [f"Zero-copy sends: {zc:,}; window waits: {waits:,}.", ""]
    if r.failure:
        lines += ["FAILED: " + r.failure, ""]
    for e in r.errors[:5]:
        lines += [f"error: {e}"]
    if r.leftover_objects:
        lines += ["left behind: " + ", ".join(r.leftover_objects[:10]), ""]
    lines += [f"**{'OK' if r.ok else 'FAILED'}**", ""]
    return "\n".join(lines)


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        messages=args.load_messages,
        producers=args.load_producers,
        keys=args.load_keys,
        max_size=args.load_max_size,
        seed=args.load_seed,
        window_bytes=args.load_window,
    )


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --load``: 0 when every check held, 1 otherwise, 2 on bad options."""
    from .report import run_mode

    return run_mode("load", args, config_from_args, run_load, format_load)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shmrdv._bench.load``: the load test alone (same options as ``--load``)."""
    parser = argparse.ArgumentParser(prog="shmrdv bench --load")
    options.add_load_arguments(parser)
    parser.add_argument("--json", metavar="FILE")
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
