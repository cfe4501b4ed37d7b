"""``shmrdv bench --soak N``: one producer, one consumer, N handoffs; does anything grow?

Issue 6 §3: RSS, open file descriptors, threads and ``/dev/shm`` usage must stay flat over
a long run. One producer process and one consumer process (each a ``shmrdv.Worker``) hand
over ``handoffs`` arrays of mixed small and medium sizes (``SOAK_SIZES``, seeded) on a few
keys, alternating ``send`` and ``allocate`` + ``send``; every array carries its handoff
number at both ends, which the consumer checks.

Pacing: the consumer sends a credit (a 1-element array, back through shmrdv) after every
``batch`` handoffs; the producer runs at most ``lag`` batches ahead. At each sample point
(every ~N/``samples`` handoffs, a multiple of ``batch``) both sides are quiet: the producer
takes every earlier credit and then sends a sync message; the consumer, having received
the batch and the sync, samples and only then sends the batch's credit; the producer
samples once it has that credit. So neither samples with a message in flight, and the
``/dev/shm`` counts are comparable from sample to sample.

Each process samples: RSS (``/proc/self/statm``), open descriptors (``/proc/self/fd``),
threads (``threading.active_count`` and ``Threads:`` of ``/proc/self/status``), and the
namespace's objects in ``/dev/shm`` (``registry.list_objects``: how many, bytes held). The
runner fits a least-squares line to each series over the samples after warm-up (the first
``warmup_fraction`` of the handoffs) and reports its slope per 10,000 handoffs. A series is
flagged as growing when, after warm-up, a count (descriptors, threads, objects) rises above
its value at the end of warm-up at all, or a size (RSS, /dev/shm bytes) has a slope that
would add more than ``growth_fraction`` of its post-warm-up value (at least 1 MiB) over the
whole run.

Pool slots are judged apart. A producer's pool keeps, per size class, as many slots as were
ever out at once (each with a mapping, hence a descriptor, and a file in /dev/shm), up to
its cap (``pool.DEFAULT_MAX_SLOTS`` slots, ``shm_pool_bytes``); with random sizes that
high-water mark keeps creeping up long after warm-up, by design. So descriptors and
/dev/shm objects and bytes are judged *beside the pool* (``fds_beside_pool``, ...), and the
pool's own series (``pool_slots``, ``shm_pool_objects``, ``shm_pool_bytes``) and the raw
totals are reported with their slopes but not flagged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from .._procs import ChildFailed, ChildTimeout, wait_for_close
from .._sizes import format_size
from . import children, options
from .children import Teardown
from .common import parse_array_size

__all__ = [
    "COUNT_SERIES",
    "INFO_SERIES",
    "SIZE_SERIES",
    "SOAK_SIZES",
    "SeriesReport",
    "SoakConfig",
    "SoakResult",
    "analyse",
    "format_soak",
    "process_sample",
    "run_cli",
    "run_soak",
]

PRODUCER_TASK = "/job:soak/replica:0/task:0"
CONSUMER_TASK = "/job:soak/replica:0/task:1"
#: (size, weight): mostly small, some medium.
SOAK_SIZES: tuple[tuple[int, float], ...] = (
    (64, 0.30),
    (256, 0.20),
    (1 << 10, 0.15),
    (4 << 10, 0.12),
    (16 << 10, 0.10),
    (64 << 10, 0.08),
    (256 << 10, 0.05),
)
#: Series that must not rise at all after warm-up, series judged by their slope, and
#: series only reported (a producer's pool grows by design, up to its cap).
COUNT_SERIES = ("fds_beside_pool", "threads_py", "threads_os", "shm_objects_beside_pool")
SIZE_SERIES = ("rss_bytes", "shm_bytes_beside_pool")
INFO_SERIES = (
    "fds",
    "shm_objects",
    "shm_bytes",
    "pool_slots",
    "shm_pool_objects",
    "shm_pool_bytes",
)
# Per-peer small-message rings are bounded like the pool (one per producer/consumer pair).
_POOL_KINDS = frozenset({"pool", "held", "returned", "ring"})
_STEP = 0
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MIN_SIZE_SLACK = 1 << 20  # a size series may always wander this much
_MIN_RATE = 100.0  # handoffs per second below which a run counts as wedged


@dataclass(frozen=True)
class SoakConfig:
    """What a soak run does (see the module docstring for ``batch`` and ``lag``)."""

    handoffs: int = options.SOAK_HANDOFFS
    keys: int = 4
    max_size: int = parse_array_size(options.SOAK_MAX_SIZE)
    samples: int = 20
    warmup_fraction: float = 0.1
    growth_fraction: float = 0.05
    batch: int = 16
    lag: int = 4
    seed: int = 6
    recv_timeout_s: float = 60.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option that makes no sense."""
        if self.handoffs < 1:
            raise ValueError(f"handoffs must be >= 1, not {self.handoffs}")
        if self.keys < 1:
            raise ValueError(f"keys must be >= 1, not {self.keys}")
        if self.max_size < SOAK_SIZES[0][0]:
            raise ValueError(f"max size must be >= {SOAK_SIZES[0][0]} bytes")
        if self.samples < 3:
            raise ValueError(f"samples must be >= 3, not {self.samples}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warm-up fraction must be in [0, 1), not {self.warmup_fraction}")
        if self.batch < 1 or self.lag < 1:
            raise ValueError("batch and lag must be >= 1")

    @property
    def interval(self) -> int:
        """Handoffs between samples: about ``handoffs / samples``, a multiple of ``batch``."""
        return max(self.batch, self.handoffs // self.samples // self.batch * self.batch)


def soak_sizes(cfg: SoakConfig) -> npt.NDArray[Any]:
    """The size of every handoff; the same ``cfg`` gives the same sizes in every process."""
    choices = [(s, w) for s, w in SOAK_SIZES if s <= cfg.max_size]
    sizes = np.array([s for s, _ in choices], dtype=np.int64)
    weights = np.array([w for _, w in choices])
    rng = np.random.default_rng(cfg.seed)
    out: npt.NDArray[Any] = rng.choice(sizes, size=cfg.handoffs, p=weights / weights.sum())
    return out


def _keys() -> tuple[list[Any], Any, Any]:
    import shmrdv

    src, dst = PRODUCER_TASK + "/device:CPU:0", CONSUMER_TASK + "/device:CPU:0"
    data = [shmrdv.parse_key(shmrdv.create_key(src, 0, dst, f"soak_{k}")) for k in range(16)]
    credit = shmrdv.parse_key(shmrdv.create_key(dst, 0, src, "soak_credit"))
    sync = shmrdv.parse_key(shmrdv.create_key(src, 0, dst, "soak_sync"))
    return data, credit, sync


# -- sampling --------------------------------------------------------------------------------


def _os_threads() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1  # pragma: no cover - every Linux has the field


def process_sample(namespace: str, handoffs: int, worker: Any = None) -> dict[str, int]:
    """This process's resource figures now, and the namespace's objects in /dev/shm.

    Pool slots are counted apart (``pool_slots``: the worker's own, each one holding a
    mapping and so a descriptor; ``shm_pool_objects`` / ``shm_pool_bytes``: every
    producer's slot files), since a pool grows by design up to its cap
    (``pool.DEFAULT_MAX_SLOTS`` slots, ``shm_pool_bytes`` of the Worker) while it learns how
    many slots of each size class are out at once.
    """
    from .._shm.registry import list_objects

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * _PAGE
    objs = list_objects(namespace)
    pool_objs = sum(1 for o in objs if o.kind in _POOL_KINDS)
    pool_bytes = sum(o.size for o in objs if o.kind in _POOL_KINDS)
    shm_bytes = sum(o.size for o in objs)
    pool_slots = 0
    if worker is not None:
        shm = worker.stats().get("shm", {})
        # Each pool slot and each mapped ring holds a mapping, and so a descriptor; so
        # does each producer's presence record whose lock tells its liveness, and each
        # producer's slot a consumer keeps mapped (``slots_mapped``, bounded like a pool).
        pool_slots = sum(
            int(shm.get(k, 0)) for k in ("pool_slots", "rings", "liveness_fds", "slots_mapped")
        )
    fds = len(os.listdir("/proc/self/fd"))
    return {
        "handoffs": handoffs,
        "t_ns": time.monotonic_ns(),
        "rss_bytes": rss,
        "fds": fds,
        "fds_beside_pool": fds - pool_slots,
        "threads_py": threading.active_count(),
        "threads_os": _os_threads(),
        "shm_objects": len(objs),
        "shm_objects_beside_pool": len(objs) - pool_objs,
        "shm_bytes": shm_bytes,
        "shm_bytes_beside_pool": shm_bytes - pool_bytes,
        "pool_slots": pool_slots,
        "shm_pool_objects": pool_objs,
        "shm_pool_bytes": pool_bytes,
    }


# -- the two processes ------------------------------------------------------------------------


def _stamp(buf: npt.NDArray[Any], i: int) -> None:
    buf[:8].view(np.int64)[0] = i
    buf[-8:].view(np.int64)[0] = i


def _producer(conn: Connection, cfg: SoakConfig, namespace: str, go: Any) -> None:
    import shmrdv

    sizes = soak_sizes(cfg)
    keys, credit, sync = _keys()
    n_total, interval = cfg.handoffs, cfg.interval
    with shmrdv.Worker(PRODUCER_TASK, namespace=namespace) as w:
        rdv = w.rendezvous(_STEP)
        scratch = np.zeros(cfg.max_size, dtype=np.uint8)
        samples = [process_sample(namespace, 0, w)]
        conn.send(("ready",))
        if not go.wait(120.0):
            raise ChildFailed("soak producer: no start signal within 120 s")
        batches = credits = 0

        def take_credit() -> None:
            nonlocal credits
            got = rdv.recv(credit, timeout=cfg.recv_timeout_s).value
            if int(got[0]) != credits:
                raise ChildFailed(f"credit {int(got[0])} arrived, expected {credits}")
            credits += 1

        t0 = time.monotonic_ns()
        for i in range(n_total):
            size = int(sizes[i])
            key = keys[i % cfg.keys]
            buf = rdv.allocate(key, (size,), np.uint8) if i % 2 else scratch[:size]
            _stamp(buf, i)
            rdv.send(key, buf)
            del buf
            n = i + 1
            if n % cfg.batch == 0 or n == n_total:
                batches += 1
                while batches - credits > cfg.lag:
                    take_credit()
            if n % interval == 0 or n == n_total:
                while credits < batches - 1:
                    take_credit()
                rdv.send(sync, np.array([n], dtype=np.int64))
                take_credit()
                samples.append(process_sample(namespace, n, w))
                conn.send(("progress", n))
        elapsed = (time.monotonic_ns() - t0) / 1e9
        conn.send(("done", {"samples": samples, "elapsed_s": elapsed, "stats": w.stats()}))
        wait_for_close(conn)
        w.cleanup(_STEP)
    conn.send(("bye",))


def _consumer(conn: Connection, cfg: SoakConfig, namespace: str, go: Any) -> None:
    import shmrdv

    sizes = soak_sizes(cfg)
    keys, credit, sync = _keys()
    n_total, interval = cfg.handoffs, cfg.interval
    bad: list[str] = []
    with shmrdv.Worker(CONSUMER_TASK, namespace=namespace) as w:
        rdv = w.rendezvous(_STEP)
        samples = [process_sample(namespace, 0, w)]
        conn.send(("ready",))
        if not go.wait(120.0):
            raise ChildFailed("soak consumer: no start signal within 120 s")
        batch = 0
        nbytes = 0
        t0 = time.monotonic_ns()
        for i in range(n_total):
            a = rdv.recv(keys[i % cfg.keys], timeout=cfg.recv_timeout_s).value
            if (
                a.size != sizes[i] or a[:8].view(np.int64)[0] != i or a[-8:].view(np.int64)[0] != i
            ) and len(bad) < 20:
                bad.append(
                    f"handoff {i}: size {a.size} (expected {int(sizes[i])}), stamps "
                    f"{int(a[:8].view(np.int64)[0])}/{int(a[-8:].view(np.int64)[0])}"
                )
            nbytes += int(a.size)
            del a  # its pool slot goes back to the producer now
            n = i + 1
            if n % interval == 0 or n == n_total:
                got = rdv.recv(sync, timeout=cfg.recv_timeout_s).value
                if int(got[0]) != n:
                    raise ChildFailed(f"sync {int(got[0])} arrived at handoff {n}")
                del got
                samples.append(process_sample(namespace, n, w))
            if n % cfg.batch == 0 or n == n_total:
                rdv.send(credit, np.array([batch], dtype=np.int64))
                batch += 1
        elapsed = (time.monotonic_ns() - t0) / 1e9
        conn.send(
            (
                "done",
                {
                    "samples": samples,
                    "elapsed_s": elapsed,
                    "bytes": nbytes,
                    "bad": bad,
                    "stats": w.stats(),
                },
            )
        )
        wait_for_close(conn)
        w.cleanup(_STEP)
    conn.send(("bye",))


# -- analysis ---------------------------------------------------------------------------------


@dataclass
class SeriesReport:
    """One sampled quantity of one process: its values and whether it grows."""

    name: str
    handoffs: list[int]
    values: list[int]
    first_steady: int
    last: int
    max_steady: int
    slope_per_10k: float
    growth_over_run: float
    flagged: bool
    why: str = ""


def _slope(xs: Sequence[int], ys: Sequence[int]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 when there is nothing to fit)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return 0.0
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def analyse(
    samples: Sequence[dict[str, int]],
    total: int,
    warmup_fraction: float,
    growth_fraction: float,
) -> dict[str, SeriesReport]:
    """Each series of ``samples``: its slope after warm-up and whether it grows (see module doc)."""
    warm = total * warmup_fraction
    steady = [s for s in samples if s["handoffs"] >= warm] or list(samples[-1:])
    out: dict[str, SeriesReport] = {}
    for name in (*SIZE_SERIES, *COUNT_SERIES, *INFO_SERIES):
        xs = [s["handoffs"] for s in steady]
        ys = [s[name] for s in steady]
        slope = _slope(xs, ys)
        growth = slope * total
        first, last, top = ys[0], ys[-1], max(ys)
        why = ""
        if name in INFO_SERIES:
            pass
        elif name in COUNT_SERIES:
            if top > first:
                why = f"rose from {first} to {top} after warm-up"
        else:
            limit = max(growth_fraction * first, _MIN_SIZE_SLACK)
            if growth > limit:
                why = (
                    f"slope {slope * 10_000:,.0f} B per 10k handoffs would add "
                    f"{growth / 2**20:.1f} MiB over the run (limit {limit / 2**20:.1f} MiB)"
                )
        out[name] = SeriesReport(
            name=name,
            handoffs=[s["handoffs"] for s in samples],
            values=[s[name] for s in samples],
            first_steady=first,
            last=last,
            max_steady=top,
            slope_per_10k=slope * 10_000,
            growth_over_run=growth,
            flagged=bool(why),
            why=why,
        )
    return out


# -- the run ----------------------------------------------------------------------------------


@dataclass
class SoakResult(Teardown):
    """A soak run: per process its series, plus the checks of the handoffs themselves."""

    config: dict[str, Any]
    handoffs: int = 0
    elapsed_s: float = 0.0
    handoffs_per_s: float = 0.0
    bytes: int = 0
    bad: list[str] = field(default_factory=list)
    series: dict[str, dict[str, SeriesReport]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged(self) -> list[str]:
        return [
            f"{proc}.{name}: {r.why}"
            for proc, series in self.series.items()
            for name, r in series.items()
            if r.flagged
        ]

    @property
    def ok(self) -> bool:
        return (
            self.clean
            and self.handoffs == self.config["handoffs"]
            and not self.bad
            and not self.flagged
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        out["flagged"] = self.flagged
        return out


def run_soak(cfg: SoakConfig, progress: Callable[[str], None] | None = None) -> SoakResult:
    """Run one soak with a real producer and consumer process; return what it measured.

    Blocks until the run ends (each receive is bounded by ``cfg.recv_timeout_s``) and both
    children are gone. A child that fails, dies or hangs is reported in ``failure``, never
    raised; ``ValueError`` for a bad ``cfg``.
    """
    cfg.check()
    say = progress or (lambda text: None)
    result = SoakResult(config=dataclasses.asdict(cfg))
    go = multiprocessing.get_context("spawn").Event()

    finished: dict[str, dict[str, Any]] = {}

    def on_progress(msg: tuple[Any, ...]) -> bool:
        if msg[0] == "progress":
            say(f"soak: {msg[1]:,}/{cfg.handoffs:,} handoffs")
            return True
        return False

    t_wall = time.monotonic()
    with children.run(result) as run:
        group, namespace = run.group, run.namespace
        say(f"soak: {cfg.handoffs:,} handoffs, sizes up to {format_size(cfg.max_size)}")
        group.start("consumer", _consumer, cfg, namespace, go)
        group.start("producer", _producer, cfg, namespace, go)
        group["consumer"].expect("ready", 180.0)
        group["producer"].expect("ready", 180.0)
        go.set()
        # Every receive in the children is bounded; this only catches a wedged child.
        deadline = time.monotonic() + 120.0 + cfg.handoffs / _MIN_RATE
        while len(finished) < 2:
            for name in ("producer", "consumer"):
                if name not in finished:
                    with contextlib.suppress(ChildTimeout):
                        finished[name] = group[name].expect("done", 0.5, on_progress)[1]
            if len(finished) < 2 and time.monotonic() > deadline:
                raise ChildTimeout(f"the soak did not finish within {deadline - t_wall:.0f} s")
        prod, cons = finished["producer"], finished["consumer"]
        run.close(("producer", "consumer"))
        result.handoffs = cons["samples"][-1]["handoffs"]
        result.elapsed_s = cons["elapsed_s"]
        result.handoffs_per_s = result.handoffs / result.elapsed_s if result.elapsed_s else 0.0
        result.bytes = cons["bytes"]
        result.bad = cons["bad"]
        for proc, got in (("producer", prod), ("consumer", cons)):
            result.series[proc] = analyse(
                got["samples"], cfg.handoffs, cfg.warmup_fraction, cfg.growth_fraction
            )
            result.stats[proc] = got["stats"]
    return result


# -- report and command line ------------------------------------------------------------------


def _value(name: str, v: float) -> str:
    if name.endswith("_bytes"):
        return f"{v / 2**20:,.2f} MiB"
    return f"{v:,.0f}"


def _slope_text(name: str, v: float) -> str:
    if name.endswith("_bytes"):
        return f"{v / 1024:+,.1f} KiB"
    return f"{v:+.3f}"


def _verdict(name: str, flagged: bool) -> str:
    if name in INFO_SERIES:
        return "(bounded pool)"
    return "**yes**" if flagged else "no"


def format_soak(r: SoakResult) -> str:
    """The run as a short Markdown report."""
    cfg = r.config
    lines = [
        "## shmrdv soak",
        "",
        f"1 producer -> 1 consumer process, {cfg['handoffs']:,} handoffs over {cfg['keys']} "
        f"keys, sizes 64 B - {format_size(cfg['max_size'])} (seed {cfg['seed']}), sampled "
        f"every {SoakConfig(**cfg).interval:,} handoffs; warm-up "
        f"{cfg['warmup_fraction']:.0%} of the run.",
        "",
        f"Handoffs checked: {r.handoffs:,} in {r.elapsed_s:.1f} s "
        f"({r.handoffs_per_s:,.0f}/s, {r.bytes / 1e9:.2f} GB); bad: {len(r.bad)}.",
        "",
    ]
    if r.series:
        lines += [
            "| process | series | after warm-up | max | end | slope / 10k handoffs | grows? |",
            "|---|---|---|---|---|---|---|",
        ]
        for proc, series in r.series.items():
            for name, s in series.items():
                lines.append(
                    f"| {proc} | {name} | {_value(name, s.first_steady)} | "
                    f"{_value(name, s.max_steady)} | {_value(name, s.last)} | "
                    f"{_slope_text(name, s.slope_per_10k)} | {_verdict(name, s.flagged)} |"
                )
        lines.append("")
    for f in r.flagged:
        lines.append(f"growing: {f}")
    for b in r.bad[:5]:
        lines.append(f"bad: {b}")
    lines += [
        f"Left in /dev/shm after close: {len(r.leftover_objects)}; processes left / stopped: "
        f"{r.processes_left} / {r.processes_stopped}; wall {r.wall_s:.1f} s.",
        "",
    ]
    if r.failure:
        lines += ["FAILED: " + r.failure, ""]
    lines += [f"**{'OK' if r.ok else 'FAILED'}**", ""]
    return "\n".join(lines)


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(handoffs=args.soak, max_size=args.soak_max_size)


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --soak N``: 0 when flat and correct, 1 otherwise, 2 on bad options."""
    from .report import run_mode

    return run_mode("soak", args, config_from_args, run_soak, format_soak)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shmrdv._bench.soak``: the soak alone (same options as ``--soak``)."""
    parser = argparse.ArgumentParser(prog="shmrdv bench --soak")
    options.add_soak_arguments(parser)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.soak is None:
        args.soak = SoakConfig.handoffs
    return run_cli(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
