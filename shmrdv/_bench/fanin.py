"""``shmrdv bench --fan-in N``: aggregate bandwidth of N producer processes into one consumer.

N spawned producer processes (tasks 0..N-1, each a ``shmrdv.Worker`` with its own
incarnation) and one consumer process (task N) share a namespace. In a round every producer
hands over ``count`` float32 arrays of ``nbytes`` (16 MiB by default) on keys of its own,
three ways: with ``send`` (one copy into a pool slot, by shmrdv's copier); with ``allocate``
where the producer writes only the two stamps into the buffer it got before ``send``
publishes it (the handoff alone, no copy); and with ``allocate`` filled by one ``np.copyto``
of the whole array (the producer making its data in place, single-threaded). The consumer
posts a ``recv_future`` for every key of the round up front and takes the values in whatever
order they come, checking each array's stamps and dropping it at once (its pool slot goes
back to its producer).

Flow control: a producer keeps at most ``window`` arrays unconsumed (a semaphore per
producer that the consumer releases), so /dev/shm holds N x window arrays at most and
the figure is a bandwidth, not a queue's fill. Aggregate GB/s = all bytes of the round
over (the consumer's last arrival - the earliest producer's first send), on
CLOCK_MONOTONIC, one clock for every process. One untimed round of each path warms the
pools; the figure is the median over the timed rounds.

The reference: one single-threaded ``np.copyto`` of ``nbytes`` into a warm array, timed in
the consumer's process before and after the rounds (median). The processes are not
pinned: N producers share the CPUs as they would in a pipeline, and a copier may use
every CPU it is allowed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from .._procs import ChildFailed
from . import children
from .children import Teardown
from .common import format_size
from .report import TIMES

__all__ = ["FanInConfig", "FanInResult", "format_fanin", "run_cli", "run_fanin"]

PATHS = ("send", "allocate", "allocate_fill")
LABELS = {
    "send": "`send` (one copy into a pool slot)",
    "allocate": "`allocate`, two stamps written, `send`",
    "allocate_fill": "`allocate`, `np.copyto` of the whole array into it, `send`",
}
MEMCPY_REPS = 15


def _task(i: int) -> str:
    return f"/job:fanin/replica:0/task:{i}"


@dataclass
class FanInConfig:
    """What a fan-in run does."""

    producers: int = 4
    nbytes: int = 16 << 20
    count: int = 40
    window: int = 4
    rounds: int = 3
    timeout_s: float = 300.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option that makes no sense."""
        if not 1 <= self.producers <= 64:
            raise ValueError(f"producers must be from 1 to 64, not {self.producers}")
        if self.nbytes < 8 or self.nbytes % 4:
            raise ValueError(f"size must be a multiple of 4 bytes, at least 8, not {self.nbytes}")
        if not 1 <= self.count <= 100_000:
            raise ValueError(f"count must be from 1 to 100,000, not {self.count}")
        if not 1 <= self.window <= 64:
            raise ValueError(f"window must be from 1 to 64, not {self.window}")
        if not 1 <= self.rounds <= 1000:
            raise ValueError(f"rounds must be from 1 to 1000, not {self.rounds}")


@dataclass
class FanInResult(Teardown):
    config: dict[str, Any]
    gbps: dict[str, float] = field(default_factory=dict)  # path -> median over rounds
    round_gbps: dict[str, list[float]] = field(default_factory=dict)
    memcpy_gbps: float | None = None

    @property
    def ok(self) -> bool:
        return self.clean and set(self.gbps) == set(PATHS)

    def ratio(self, path: str) -> float | None:
        if path not in self.gbps or not self.memcpy_gbps:
            return None
        return self.gbps[path] / self.memcpy_gbps

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "x_memcpy": {p: self.ratio(p) for p in self.gbps},
            "units": {"throughput": "GB/s = 1e9 B/s"},
        }


def _key(p: int, j: int, producers: int) -> str:
    import shmrdv

    src, dst = _task(p) + "/device:CPU:0", _task(producers) + "/device:CPU:0"
    return shmrdv.create_key(src, 0, dst, f"fanin_{j}")


def _stamp(p: int, j: int) -> float:
    return float(p * 1_000_003 + j)  # exact in float32 below 2**24 (p < 16, j < 1e6)


def _producer(conn: Connection, p: int, cfg: FanInConfig, namespace: str, window: Any) -> None:
    import shmrdv

    src: npt.NDArray[np.float32] = np.ones(cfg.nbytes // 4, dtype=np.float32)
    keys = [_key(p, j, cfg.producers) for j in range(cfg.count)]
    with shmrdv.Worker(
        _task(p), namespace=namespace, shm_pool_bytes=max(256 << 20, 2 * cfg.window * cfg.nbytes)
    ) as w:
        conn.send(("ready",))
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            _, step, path = cmd
            rdv = w.rendezvous(step)
            t_first = 0
            for j, key in enumerate(keys):
                if not window.acquire(timeout=cfg.timeout_s):
                    raise ChildFailed(f"producer {p}: the consumer took nothing for a while")
                if j == 0:
                    t_first = time.perf_counter_ns()
                stamp = _stamp(p % 16, j)
                if path == "send":
                    src[0] = src[-1] = stamp
                    rdv.send(key, src)
                else:
                    buf = rdv.allocate(key, src.shape, src.dtype)
                    if path == "allocate_fill":  # the producer makes its data in place
                        np.copyto(buf, src)
                    buf[0] = buf[-1] = stamp
                    rdv.send(key, buf)
                    del buf
            conn.send(("sent", t_first))
            if conn.recv()[0] != "cleanup":
                raise ChildFailed(f"producer {p}: expected cleanup")
            w.cleanup(step)
            conn.send(("cleaned",))
    conn.send(("bye",))


def _memcpy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.zeros_like(src)  # written once: the pages are there
    times = []
    for _ in range(MEMCPY_REPS):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        times.append(time.perf_counter_ns() - t0)
    return nbytes / float(statistics.median(times))


def _on_arrival(arrived: queue.Queue[tuple[int, int, Any, Any]], p: int, j: int) -> Any:
    """The ``recv_async`` callback of producer ``p``'s array ``j``: queue it as it is."""

    def done(err: Any, got: Any) -> None:
        arrived.put((p, j, err, got))

    return done


def _consumer(conn: Connection, cfg: FanInConfig, namespace: str, windows: list[Any]) -> None:
    import shmrdv

    n = cfg.producers
    keys = {(p, j): _key(p, j, n) for p in range(n) for j in range(cfg.count)}
    with shmrdv.Worker(_task(n), namespace=namespace) as w:
        conn.send(("ready",))
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            if cmd[0] == "memcpy":
                conn.send(("memcpy", _memcpy_gbps(cfg.nbytes)))
                continue
            step = cmd[1]
            rdv = w.rendezvous(step)
            # Callbacks, not futures: a Future would keep its value (and its pool slot).
            arrived: queue.Queue[tuple[int, int, Any, Any]] = queue.Queue()
            for (p, j), k in keys.items():
                rdv.recv_async(k, _on_arrival(arrived, p, j))
            conn.send(("armed",))
            t_last = 0
            bad = []
            for _ in range(len(keys)):
                try:
                    p, j, err, got = arrived.get(timeout=cfg.timeout_s)
                except queue.Empty:
                    raise ChildFailed(
                        f"consumer: nothing arrived for {cfg.timeout_s:g} s"
                    ) from None
                if err is not None:
                    raise ChildFailed(f"consumer: receive ({p}, {j}) failed: {err!r}")
                a = got.value
                t_last = time.perf_counter_ns()
                stamp = _stamp(p % 16, j)
                if a.nbytes != cfg.nbytes or a[0] != stamp or a[-1] != stamp:
                    bad.append((p, j))
                del a, got
                windows[p].release()
            if bad:
                raise ChildFailed(f"wrong arrays from (producer, index) {bad[:3]}")
            conn.send(("received", t_last))
            if conn.recv()[0] != "cleanup":
                raise ChildFailed("consumer: expected cleanup")
            w.cleanup(step)
            conn.send(("cleaned",))
    conn.send(("bye",))


def run_fanin(cfg: FanInConfig, say: Callable[[str], None] = lambda _: None) -> FanInResult:
    """Run the measurement; a failure is in ``result.failure``, never raised."""
    result = FanInResult(config=asdict(cfg))
    mpctx = multiprocessing.get_context("spawn")
    windows = [mpctx.Semaphore(cfg.window) for _ in range(cfg.producers)]
    producers = [f"producer{p}" for p in range(cfg.producers)]
    t = cfg.timeout_s
    with children.run(result) as run:
        group, namespace = run.group, run.namespace
        group.start("consumer", _consumer, cfg, namespace, windows)
        for p, name in enumerate(producers):
            group.start(name, _producer, p, cfg, namespace, windows[p])
        for name in ("consumer", *producers):
            group[name].expect("ready", 180.0)
        group["consumer"].send(("memcpy",))
        memcpy = [group["consumer"].expect("memcpy", t)[1]]
        step = 0
        for path in PATHS:
            result.round_gbps[path] = []
            for r in range(cfg.rounds + 1):  # round 0 warms the pools up
                say(f"fan-in: {path}, round {r}/{cfg.rounds}")
                step += 1
                group["consumer"].send(("run", step))
                group["consumer"].expect("armed", t)
                for name in producers:
                    group[name].send(("run", step, path))
                firsts = [group[name].expect("sent", t)[1] for name in producers]
                t_last = group["consumer"].expect("received", t)[1]
                for name in ("consumer", *producers):
                    group[name].send(("cleanup",))
                    group[name].expect("cleaned", t)
                if r > 0:
                    total = cfg.producers * cfg.count * cfg.nbytes
                    result.round_gbps[path].append(total / max(1, t_last - min(firsts)))
            result.gbps[path] = float(statistics.median(result.round_gbps[path]))
        group["consumer"].send(("memcpy",))
        memcpy.append(group["consumer"].expect("memcpy", t)[1])
        result.memcpy_gbps = float(statistics.median(memcpy))
        run.close(("consumer", *producers))
    return result


def format_fanin(r: FanInResult) -> str:
    """The run as markdown."""
    cfg = r.config
    lines = [
        f"# shmrdv bench --fan-in {cfg['producers']}",
        "",
        f"{cfg['producers']} producer processes -> 1 consumer, {format_size(cfg['nbytes'])} "
        f"float32 arrays, {cfg['count']:,} per producer per round, at most {cfg['window']} "
        f"unconsumed per producer, {cfg['rounds']} timed round(s) per path after a warm-up; "
        f"processes not pinned; {r.wall_s:.1f} s.",
        "",
        f"## Aggregate bandwidth into one consumer: GB/s (median of rounds) · {TIMES}memcpy",
        "",
        "| path | GB/s | rounds | " + f"{TIMES}memcpy |",
        "|---|---|---|---|",
    ]
    for path in PATHS:
        if path not in r.gbps:
            continue
        ratio = r.ratio(path)
        rounds = ", ".join(f"{g:.2f}" for g in r.round_gbps[path])
        lines.append(
            f"| {LABELS[path]} | {r.gbps[path]:.2f} | {rounds} | "
            f"{'' if ratio is None else f'{TIMES}{ratio:.2f}'} |"
        )
    if r.memcpy_gbps:
        lines.append(
            f"| one memcpy (1 thread, the consumer's process) | {r.memcpy_gbps:.2f} | | "
            f"{TIMES}1.00 |"
        )
    lines += [
        "",
        "GB/s = all bytes of a round / (last arrival at the consumer - first send of any "
        "producer).",
        "",
    ]
    if r.failure:
        lines += ["FAILED: " + r.failure, ""]
    return "\n".join(lines) + "\n"


def config_from_args(args: argparse.Namespace) -> FanInConfig:
    quick = getattr(args, "quick", False)
    sizes = args.sizes or [FanInConfig.nbytes]
    if len(sizes) != 1:
        raise ValueError(f"--fan-in takes one size, not {len(sizes)}")
    return FanInConfig(
        producers=args.fan_in,
        nbytes=sizes[0],
        count=args.fan_in_count or (10 if quick else FanInConfig.count),
        rounds=args.reps if args.reps is not None else (1 if quick else FanInConfig.rounds),
    )


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --fan-in N``: 0 when every path was measured, 1 otherwise."""
    from .report import run_mode

    return run_mode("fan-in", args, config_from_args, run_fanin, format_fanin)
