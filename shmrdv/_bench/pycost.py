"""``shmrdv bench --python-cost``: what one ``send`` and one ``recv`` cost in Python, no wake-up.

Two spawned processes, pinned to two CPUs like every method of the bench: a producer and a
consumer, each a ``shmrdv.Worker`` of one namespace. One round: the producer ``send``s
``count`` 64 B float32 arrays on ``count`` keys of one step while the consumer is not
waiting, and times each ``send``; after a short settle the consumer ``recv``s them all,
already there, and times each ``recv``. No receiver ever blocks, so what is timed is the
Python (and the syscalls) of the two calls, not a wake-up.

The same run measures, in the producer's process, one pickle protocol 5 ``dumps`` +
``loads`` of the same array (the cost any Python handoff pays at least) and, through
the same two processes, ``multiprocessing.Pipe`` with pickle 5 out-of-band buffers
(``mp_methods.pipe_oob_send`` / ``pipe_oob_recv``): the producer writes as many messages as
the pipe holds (its buffer raised to 1 MiB where allowed), then the consumer reads them.
Every figure is reported per operation (the loop's time over ``count``: the mean, with the
median and p99 of the single calls), and against the pickle reference.

Round 0 is an untimed warm-up; the figures are medians over the timed rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import multiprocessing
import os
import pickle
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from .._procs import ChildFailed
from .children import ChildGroup
from .common import format_size, pin_cpus
from .mp_methods import pipe_oob_recv, pipe_oob_send
from .report import TIMES

__all__ = ["PyCostConfig", "PyCostResult", "format_pycost", "run_cli", "run_pycost"]

PRODUCER = "/job:pycost/replica:0/task:0"
CONSUMER = "/job:pycost/replica:0/task:1"
PIPE_BUFFER = 1 << 20  # F_SETPIPE_SZ's default ceiling (/proc/sys/fs/pipe-max-size)
SETTLE_S = 0.2  # after the sends: the consumer's dispatcher has seen every message
OPS = ("shmrdv_send", "shmrdv_recv", "pipe_send", "pipe_recv", "pickle")
LABELS = {
    "shmrdv_send": "shmrdv `send` (nobody waiting)",
    "shmrdv_recv": "shmrdv `recv` (value already there)",
    "pipe_send": "`multiprocessing.Pipe` send, pickle 5 out of band",
    "pipe_recv": "`multiprocessing.Pipe` recv (message already there)",
    "pickle": "pickle 5 `dumps` + `loads` (reference)",
}


@dataclass
class PyCostConfig:
    """What a Python-cost run does. ``pin``: see ``common.pin_cpus``."""

    count: int = 3_000
    nbytes: int = 64
    rounds: int = 3
    pin: bool | None = None
    timeout_s: float = 120.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option that makes no sense."""
        if not 1 <= self.count <= 1_000_000:
            raise ValueError(f"count must be from 1 to 1,000,000, not {self.count}")
        if not 1 <= self.rounds <= 1000:
            raise ValueError(f"rounds must be from 1 to 1000, not {self.rounds}")
        if self.nbytes < 8 or self.nbytes % 4:
            raise ValueError(f"size must be a multiple of 4 bytes, at least 8, not {self.nbytes}")
        pin_cpus(self.pin)  # raises if --pin was asked for on one CPU


@dataclass
class OpFigures:
    """One operation: per-operation times in ns, medians over the timed rounds."""

    mean_ns: float
    median_ns: float
    p99_ns: float
    round_means_ns: list[float]


@dataclass
class PyCostResult:
    config: dict[str, Any]
    cpus: tuple[int, int] | None = None
    pipe_batch: int = 0
    ops: dict[str, OpFigures] = field(default_factory=dict)
    failure: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None and set(self.ops) == set(OPS)

    def ratio(self, op: str, what: str = "mean") -> float | None:
        """``op``'s ``what`` ("mean" or "median") per operation over the pickle reference's.

        The median of the single calls is the steadier figure on a busy machine, where a
        loop's mean also carries every preemption.
        """
        if op not in self.ops or "pickle" not in self.ops:
            return None
        ref = getattr(self.ops["pickle"], f"{what}_ns")
        return float(getattr(self.ops[op], f"{what}_ns") / ref) if ref > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "cpus": list(self.cpus) if self.cpus else None,
            "pipe_batch": self.pipe_batch,
            "ops": {
                k: {
                    **asdict(v),
                    "x_pickle": self.ratio(k),
                    "x_pickle_median": self.ratio(k, "median"),
                    "label": LABELS[k],
                }
                for k, v in self.ops.items()
            },
            "failure": self.failure,
            "elapsed_s": self.elapsed_s,
            "units": {"time": "ns per operation"},
        }


def _array(nbytes: int) -> npt.NDArray[np.float32]:
    a: npt.NDArray[np.float32] = np.arange(nbytes // 4, dtype=np.float32)
    return a


def _keys(count: int) -> list[str]:
    import shmrdv

    src, dst = PRODUCER + "/device:CPU:0", CONSUMER + "/device:CPU:0"
    return [shmrdv.create_key(src, 0, dst, f"pycost_{i}") for i in range(count)]


def _timed(calls: Callable[[int], None], count: int) -> list[int]:
    """Each of ``calls(0) .. calls(count - 1)`` timed alone; the total last."""
    clock = time.perf_counter_ns
    times = [0] * (count + 1)
    t_start = clock()
    for i in range(count):
        t0 = clock()
        calls(i)
        times[i] = clock() - t0
    times[count] = clock() - t_start
    return times


def _pipe_capacity(conn: Connection) -> int:
    fd = conn.fileno()
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BUFFER)
    return int(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))


def _send_all(rdv: Any, keys: list[str], a: npt.NDArray[Any]) -> list[int]:
    return _timed(lambda i: rdv.send(keys[i], a), len(keys))


def _recv_all(rdv: Any, keys: list[str], cfg: PyCostConfig) -> list[int]:
    bad: list[int] = []

    def recv(i: int) -> None:
        got = rdv.recv(keys[i], timeout=cfg.timeout_s).value
        if got.nbytes != cfg.nbytes or got[-1] != cfg.nbytes // 4 - 1:
            bad.append(i)

    times = _timed(recv, len(keys))
    if bad:
        raise ChildFailed(f"wrong array received on {len(bad)} key(s), e.g. {bad[0]}")
    return times


def _pipe_send_all(pipe: Connection, a: npt.NDArray[Any], n: int) -> list[int]:
    return _timed(lambda i: pipe_oob_send(pipe, a), n)


def _pipe_recv_all(pipe: Connection, nbytes: int, n: int) -> list[int]:
    def recv(i: int) -> None:
        got = pipe_oob_recv(pipe)
        if got.nbytes != nbytes:
            raise ChildFailed(f"Pipe: {got.nbytes} bytes arrived, not {nbytes}")

    return _timed(recv, n)


def _pickle_all(a: npt.NDArray[Any], n: int) -> list[int]:
    return _timed(lambda i: pickle.loads(pickle.dumps(a, protocol=5)), n)


def _producer(conn: Connection, cfg: PyCostConfig, namespace: str, pipe: Connection) -> None:
    import shmrdv

    a = _array(cfg.nbytes)
    keys = _keys(cfg.count)
    # What one message takes in the pipe: send_bytes' 4-byte length before each part.
    probe: list[pickle.PickleBuffer] = []
    head = pickle.dumps(a, protocol=5, buffer_callback=probe.append)
    per_msg = 4 + 4 + len(head) + sum(4 + len(b.raw()) for b in probe)
    batch = max(1, _pipe_capacity(pipe) // per_msg - 1)
    with shmrdv.Worker(PRODUCER, namespace=namespace) as w:
        conn.send(("ready", sorted(os.sched_getaffinity(0)), batch))
        while True:
            cmd = conn.recv()
            if cmd[0] == "send":
                conn.send(("sent", _send_all(w.rendezvous(cmd[1]), keys, a)))
            elif cmd[0] == "pipe":
                conn.send(("piped", _pipe_send_all(pipe, a, cmd[1])))
            elif cmd[0] == "pickle":
                conn.send(("pickled", _pickle_all(a, cfg.count)))
            elif cmd[0] == "cleanup":
                w.cleanup(cmd[1])
                conn.send(("cleaned", cmd[1]))
            elif cmd[0] == "close":
                break
    pipe.close()
    conn.send(("bye",))


def _consumer(conn: Connection, cfg: PyCostConfig, namespace: str, pipe: Connection) -> None:
    import shmrdv

    keys = _keys(cfg.count)
    with shmrdv.Worker(CONSUMER, namespace=namespace) as w:
        conn.send(("ready", sorted(os.sched_getaffinity(0))))
        while True:
            cmd = conn.recv()
            if cmd[0] == "recv":
                conn.send(("received", _recv_all(w.rendezvous(cmd[1]), keys, cfg)))
            elif cmd[0] == "pipe":
                conn.send(("unpiped", _pipe_recv_all(pipe, cfg.nbytes, cmd[1])))
            elif cmd[0] == "cleanup":
                w.cleanup(cmd[1])
                conn.send(("cleaned", cmd[1]))
            elif cmd[0] == "close":
                break
    pipe.close()
    conn.send(("bye",))


def _figures(rounds: list[list[list[int]]]) -> OpFigures:
    """Per round a list of timed calls (each ``_timed`` list: calls, then the total)."""
    means: list[float] = []
    medians: list[float] = []
    p99s: list[float] = []
    for parts in rounds:
        calls = [t for part in parts for t in part[:-1]]
        total = sum(part[-1] for part in parts)
        means.append(total / max(1, len(calls)))
        medians.append(float(statistics.median(calls)))
        p99s.append(float(np.percentile(calls, 99)))
    return OpFigures(
        mean_ns=float(statistics.median(means)),
        median_ns=float(statistics.median(medians)),
        p99_ns=float(statistics.median(p99s)),
        round_means_ns=means,
    )


def run_pycost(cfg: PyCostConfig, say: Callable[[str], None] = lambda _: None) -> PyCostResult:
    """Run the measurement; a failure is in ``result.failure``, never raised."""
    import shmrdv

    from .._shm.reaper import collect

    result = PyCostResult(config=asdict(cfg), cpus=pin_cpus(cfg.pin))
    namespace = shmrdv.new_namespace()
    group = ChildGroup()
    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    started = time.monotonic()
    raw: dict[str, list[list[list[int]]]] = {op: [] for op in OPS}
    ok = False
    try:
        pins = [None, None] if result.cpus is None else [[cpu] for cpu in result.cpus]
        group.start("producer", _producer, cfg, namespace, writer, cpus=pins[0])
        group.start("consumer", _consumer, cfg, namespace, reader, cpus=pins[1])
        writer.close()
        reader.close()
        _, _, batch = group["producer"].expect("ready", 180.0)
        group["consumer"].expect("ready", 180.0)
        result.pipe_batch = batch
        t = cfg.timeout_s
        for r in range(cfg.rounds + 1):  # round 0 warms up
            say(f"python cost: round {r}/{cfg.rounds}")
            group["producer"].send(("send", r))
            sent = group["producer"].expect("sent", t)[1]
            time.sleep(SETTLE_S)
            group["consumer"].send(("recv", r))
            received = group["consumer"].expect("received", t)[1]
            for name in ("producer", "consumer"):
                group[name].send(("cleanup", r))
                group[name].expect("cleaned", t)
            piped: list[list[int]] = []
            unpiped: list[list[int]] = []
            left = cfg.count
            while left > 0:
                n = min(batch, left)
                group["producer"].send(("pipe", n))
                piped.append(group["producer"].expect("piped", t)[1])
                time.sleep(SETTLE_S / 10)
                group["consumer"].send(("pipe", n))
                unpiped.append(group["consumer"].expect("unpiped", t)[1])
                left -= n
            group["producer"].send(("pickle",))
            pickled = group["producer"].expect("pickled", t)[1]
            if r == 0:
                continue
            raw["shmrdv_send"].append([sent])
            raw["shmrdv_recv"].append([received])
            raw["pipe_send"].append(piped)
            raw["pipe_recv"].append(unpiped)
            raw["pickle"].append([pickled])
        for op in OPS:
            result.ops[op] = _figures(raw[op])
        for name in ("producer", "consumer"):
            group[name].send(("close",))
            group[name].expect("bye", 60.0)
        ok = True
    except ChildFailed as e:
        result.failure = str(e)
    finally:
        group.reap(30.0 if ok else 0.0)
        collect(namespace)
        result.elapsed_s = time.monotonic() - started
    return result


def format_pycost(r: PyCostResult) -> str:
    """The run as markdown."""
    cfg = r.config
    pin = f"producer on CPU {r.cpus[0]}, consumer on CPU {r.cpus[1]}" if r.cpus else "not pinned"
    lines = [
        "# shmrdv bench --python-cost",
        "",
        f"{cfg['count']:,} arrays of {format_size(cfg['nbytes'])} (float32) per round, "
        f"{cfg['rounds']} timed round(s) after a warm-up; {pin}; Pipe in batches of "
        f"{r.pipe_batch:,} (what its buffer holds); {r.elapsed_s:.1f} s.",
        "",
        f"## Python cost per operation, no wake-up: mean · median · p99 · {TIMES}pickle",
        "",
        f"| operation | mean | median | p99 | {TIMES}pickle 5 dumps+loads (mean · median) |",
        "|---|---|---|---|---|",
    ]
    for op in OPS:
        f = r.ops.get(op)
        if f is None:
            continue
        ratios = " · ".join(
            "" if x is None else f"{TIMES}{x:.2f}" for x in (r.ratio(op), r.ratio(op, "median"))
        )
        lines.append(
            f"| {LABELS[op]} | {f.mean_ns / 1000:.2f} µs | {f.median_ns / 1000:.2f} µs | "
            f"{f.p99_ns / 1000:.2f} µs | {ratios} |"
        )
    lines += [
        "",
        "Mean = a loop's time over its calls (medians over the rounds); median and p99 of "
        "the single calls. The pickle reference runs in the producer's process.",
        "",
    ]
    if r.failure:
        lines += ["FAILED: " + r.failure, ""]
    return "\n".join(lines) + "\n"


def config_from_args(args: argparse.Namespace) -> PyCostConfig:
    quick = getattr(args, "quick", False)
    count = args.python_cost_count or (1_000 if quick else PyCostConfig.count)
    rounds = args.reps if args.reps is not None else (2 if quick else PyCostConfig.rounds)
    return PyCostConfig(count=count, rounds=rounds, pin=args.pin)


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --python-cost``: 0 when every figure was measured, 1 otherwise."""
    from .report import run_mode

    return run_mode("python-cost", args, config_from_args, run_pycost, format_pycost)
