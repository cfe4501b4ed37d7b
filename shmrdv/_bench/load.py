"""``shmrdv bench --load``: many producer processes, one consumer, every message checked.

Shape (issue 6 §3): ``producers`` spawned processes, each a ``shmrdv.Worker`` task, send
``messages`` arrays of mixed sizes over ``keys`` rendezvous keys to one consumer process
(a Worker too). Key ``k`` belongs to producer ``k % producers``; a producer interleaves
its keys in a seeded random order. Every message is a ``uint8`` array that starts with a
32-byte header — magic, producer, key index, sequence number within the key, size, the
producer's ``CLOCK_MONOTONIC`` send time, and the CRC32 of the rest — so the consumer can
check that every message arrived, once, in FIFO order per key, with the right bytes.

Sizes come from a fixed, seeded distribution weighted to small messages (``SIZE_BUCKETS``:
log-uniform within each bucket), so a run is the same every time. About half the messages
are written into ``rdv.allocate`` buffers (zero copy), the others are ``send`` from a
scratch array (one copy into a pool slot), so both producer paths carry load.

The consumer keeps one ``recv_async`` pending per key: the transport serves any number of
pending receives with its one dispatcher thread (DESIGN.md: "callback recv must not cost
one thread per pending key"), where a thread per key would be 1,000 threads, and a few
threads with blocking ``recv`` would serialise the keys behind whichever one is slow. The
callback only stamps the arrival time and queues the value; the main thread checks it,
drops it (so its pool slot goes back to the producer) and re-arms the key.

Flow control: ``send`` never blocks, so an unpaced producer would queue its whole share in
``/dev/shm`` and the latencies would measure that queue. Each producer keeps at most
``window_bytes`` unconsumed; the consumer publishes the bytes it has checked per producer
in a shared array (one writer per word). Latency is the producer's stamp, taken just before
``send``, to the consumer's callback (``time.monotonic_ns``, CLOCK_MONOTONIC, one clock for
every process on Linux).

Afterwards no process of the run may be alive and nothing of its namespace may be left in
``/dev/shm``: the run lists the namespace (``registry.list_objects``), reports what it finds,
and collects it (``registry.collect``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import multiprocessing
import queue
import struct
import time
import zlib
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
    "HEADER",
    "SIZE_BUCKETS",
    "LoadConfig",
    "LoadPlan",
    "LoadResult",
    "format_load",
    "make_plan",
    "run_cli",
    "run_load",
]

#: Message header: magic, producer, key index, seq, size, send time (ns), CRC32 of bytes 32..
HEADER = struct.Struct("<4sIIIIQI")
MAGIC = b"LOAD"
PRODUCER_TASK = "/job:load/replica:0/task:{}"
CONSUMER_TASK = "/job:load_sink/replica:0/task:0"
#: (low, high, weight): log-uniform sizes within each bucket; most messages are small.
SIZE_BUCKETS: tuple[tuple[int, int, float], ...] = (
    (64, 1 << 10, 0.55),
    (1 << 10, 16 << 10, 0.25),
    (16 << 10, 256 << 10, 0.12),
    (256 << 10, 1 << 20, 0.06),
    (1 << 20, 4 << 20, 0.02),
)
_STEP = 0
_PAYLOAD_SLACK = 1 << 16  # the random payload source is this much longer than a message


# -- configuration and plan -------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    """What a load run does. ``window_bytes`` bounds each producer's unconsumed bytes."""

    messages: int = options.LOAD_MESSAGES
    producers: int = options.LOAD_PRODUCERS
    keys: int = options.LOAD_KEYS
    min_size: int = 64
    max_size: int = parse_array_size(options.LOAD_MAX_SIZE)
    seed: int = options.LOAD_SEED
    window_bytes: int = parse_array_size(options.LOAD_WINDOW)
    alloc_fraction: float = 0.5
    timeout_s: float = 900.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option that makes no sense."""
        if self.producers < 1:
            raise ValueError(f"producers must be >= 1, not {self.producers}")
        if self.keys < self.producers:
            raise ValueError(
                f"keys ({self.keys}) must be at least producers ({self.producers}): "
                "each producer owns at least one key"
            )
        if self.messages < 1:
            raise ValueError(f"messages must be >= 1, not {self.messages}")
        if self.min_size < HEADER.size:
            raise ValueError(f"min size must be >= {HEADER.size} bytes (the header)")
        if self.max_size < self.min_size:
            raise ValueError(f"max size {self.max_size} is below min size {self.min_size}")
        if self.window_bytes < self.max_size:
            raise ValueError(f"window {self.window_bytes} must hold a max-size message")
        if not 0.0 <= self.alloc_fraction <= 1.0:
            raise ValueError(f"alloc fraction must be in [0, 1], not {self.alloc_fraction}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0, not {self.timeout_s}")


def draw_sizes(rng: np.random.Generator, n: int, min_size: int, max_size: int) -> npt.NDArray[Any]:
    """``n`` sizes in ``[min_size, max_size]``, multiples of 8 where the range allows.

    Buckets of ``SIZE_BUCKETS`` outside the range are dropped and the rest reweighted.
    """
    buckets = [
        (max(lo, min_size), min(hi, max_size), w)
        for lo, hi, w in SIZE_BUCKETS
        if lo <= max_size and hi >= min_size
    ]
    if not buckets:
        buckets = [(min_size, max_size, 1.0)]
    weights = np.array([w for _, _, w in buckets])
    which = rng.choice(len(buckets), size=n, p=weights / weights.sum())
    lo = np.log(np.array([b[0] for b in buckets], dtype=np.float64))[which]
    hi = np.log(np.array([b[1] for b in buckets], dtype=np.float64))[which]
    sizes = np.exp(lo + rng.random(n) * (hi - lo)).astype(np.int64) // 8 * 8
    out: npt.NDArray[Any] = np.clip(sizes, min_size, max_size)
    return out


@dataclass(frozen=True)
class LoadPlan:
    """Who sends what: per key its sizes and zero-copy flags by sequence number."""

    config: LoadConfig
    sizes: list[npt.NDArray[Any]]
    allocs: list[npt.NDArray[Any]]

    @property
    def counts(self) -> list[int]:
        return [len(s) for s in self.sizes]

    @property
    def total_bytes(self) -> int:
        return int(sum(int(s.sum()) for s in self.sizes))

    def owner(self, k: int) -> int:
        return k % self.config.producers

    def keys_of(self, p: int) -> range:
        return range(p, self.config.keys, self.config.producers)

    def order(self, p: int) -> npt.NDArray[Any]:
        """Producer ``p``'s key indices in sending order: its keys, randomly interleaved."""
        mine = np.array(list(self.keys_of(p)), dtype=np.int64)
        seq = np.repeat(mine, [len(self.sizes[k]) for k in mine])
        np.random.default_rng([self.config.seed, p]).shuffle(seq)
        return seq


def make_plan(cfg: LoadConfig) -> LoadPlan:
    """The run's plan; the same ``cfg`` gives the same plan in every process."""
    cfg.check()
    rng = np.random.default_rng(cfg.seed)
    sizes = draw_sizes(rng, cfg.messages, cfg.min_size, cfg.max_size)
    allocs = rng.random(cfg.messages) < cfg.alloc_fraction
    counts = np.full(cfg.keys, cfg.messages // cfg.keys)
    counts[: cfg.messages % cfg.keys] += 1
    cuts = np.cumsum(counts)[:-1]
    return LoadPlan(cfg, list(np.split(sizes, cuts)), list(np.split(allocs, cuts)))


def key_name(k: int, owner: int) -> str:
    import shmrdv

    return shmrdv.create_key(
        PRODUCER_TASK.format(owner) + "/device:CPU:0",
        0,
        CONSUMER_TASK + "/device:CPU:0",
        f"load_{k}",
    )


def _producer(
    conn: Connection,
    p: int,
    cfg: LoadConfig,
    namespace: str,
    go: Any,
    consumed: Any,
) -> None:
    import shmrdv

    plan = make_plan(cfg)
    order = plan.order(p)
    with shmrdv.Worker(PRODUCER_TASK.format(p), namespace=namespace) as w:
        rdv = w.rendezvous(_STEP)
        keys = {k: shmrdv.parse_key(key_name(k, p)) for k in plan.keys_of(p)}
        source = np.random.default_rng([cfg.seed, p, 1]).integers(
            0, 256, cfg.max_size + _PAYLOAD_SLACK, dtype=np.uint8
        )
        scratch = np.empty(cfg.max_size, dtype=np.uint8)
        seqs = dict.fromkeys(keys, 0)
        sent = sent_bytes = zero_copy = waits = 0
        wait_s = 0.0
        conn.send(("ready",))
        if not go.wait(120.0):
            raise ChildFailed(f"producer {p}: no start signal within 120 s")
        t_first = time.monotonic_ns()
        for k in order.tolist():
            s = seqs[k]
            seqs[k] = s + 1
            size = int(plan.sizes[k][s])
            if sent_bytes - consumed[p] + size > cfg.window_bytes:
                waits += 1
                t_w = time.perf_counter()
                while sent_bytes - consumed[p] + size > cfg.window_bytes:
                    time.sleep(0.0005)
                wait_s += time.perf_counter() - t_w
            alloc = bool(plan.allocs[k][s])
            buf = rdv.allocate(keys[k], (size,), np.uint8) if alloc else scratch[:size]
            off = (k * 7919 + s * 104729) % _PAYLOAD_SLACK
            buf[HEADER.size :] = source[off : off + size - HEADER.size]
            crc = zlib.crc32(buf[HEADER.size :].data)
            HEADER.pack_into(buf.data, 0, MAGIC, p, k, s, size, time.monotonic_ns(), crc)
            rdv.send(keys[k], buf)
            del buf
            sent += 1
            sent_bytes += size
            zero_copy += alloc
        t_last = time.monotonic_ns()
        conn.send(
            (
                "sent",
                {
                    "producer": p,
                    "messages": sent,
                    "bytes": sent_bytes,
                    "zero_copy": zero_copy,
                    "window_waits": waits,
                    "window_wait_s": wait_s,
                    "send_s": (t_last - t_first) / 1e9,
                    "stats": w.stats().get("shm", {}),
                },
            )
        )
        wait_for_close(conn)
        w.cleanup(_STEP)
    conn.send(("bye",))


@dataclass
class _Check:
    """The consumer's tally."""

    counts: list[int]
    received: list[int]
    seen: list[bytearray]
    delivered: int = 0
    nbytes: int = 0
    duplicates: int = 0
    fifo_violations: int = 0
    bad_checksum: int = 0
    bad_header: int = 0
    size_mismatch: int = 0
    errors: list[str] = field(default_factory=list)
    first_send_ns: int = 0
    last_recv_ns: int = 0


def _consumer(conn: Connection, cfg: LoadConfig, namespace: str, go: Any, consumed: Any) -> None:
    import shmrdv

    plan = make_plan(cfg)
    counts = plan.counts
    tally = _Check(counts, [0] * cfg.keys, [bytearray(c) for c in counts])
    latencies = np.zeros(cfg.messages, dtype=np.int64)
    arrivals: queue.SimpleQueue[tuple[int, int, BaseException | None, Any]] = queue.SimpleQueue()

    def callback(k: int) -> Callable[[BaseException | None, Any], None]:
        def done(err: BaseException | None, rec: Any) -> None:
            arrivals.put((k, time.monotonic_ns(), err, rec))

        return done

    with shmrdv.Worker(CONSUMER_TASK, namespace=namespace) as w:
        rdv = w.rendezvous(_STEP)
        keys = [shmrdv.parse_key(key_name(k, plan.owner(k))) for k in range(cfg.keys)]
        callbacks = [callback(k) for k in range(cfg.keys)]
        for k in range(cfg.keys):
            if counts[k]:
                rdv.recv_async(keys[k], callbacks[k])
        conn.send(("ready",))
        if not go.wait(120.0):
            raise ChildFailed("consumer: no start signal within 120 s")
        deadline = time.monotonic() + cfg.timeout_s
        remaining = cfg.messages
        next_progress = time.monotonic() + 1.0
        first_send = 2**63
        while remaining > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                tally.errors.append(f"timed out after {cfg.timeout_s:g} s, {remaining} missing")
                break
            try:
                k, t_recv, err, rec = arrivals.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            finally:
                if time.monotonic() >= next_progress:
                    conn.send(("progress", tally.delivered))
                    next_progress = time.monotonic() + 1.0
            if err is not None:
                # The key's stream is broken: count what it still owed as missing.
                tally.errors.append(f"key {k}: {type(err).__name__}: {err}")
                remaining -= counts[k] - tally.received[k]
                tally.received[k] = counts[k]
                continue
            a = rec.value
            del rec
            s = _check_message(a, k, plan, tally, consumed)
            if s is not None:
                latencies[tally.delivered] = t_recv - s
                first_send = min(first_send, s)
            tally.delivered += 1
            tally.last_recv_ns = max(tally.last_recv_ns, t_recv)
            del a  # its pool slot goes back to the producer now
            tally.received[k] += 1
            remaining -= 1
            if tally.received[k] < counts[k]:
                rdv.recv_async(keys[k], callbacks[k])
        tally.first_send_ns = first_send if first_send < 2**63 else 0
        lat = latencies[: tally.delivered]
        missing = sum(c - bytes(s).count(1) for c, s in zip(counts, tally.seen))
        conn.send(
            (
                "done",
                {
                    "delivered": tally.delivered,
                    "unique": sum(bytes(s).count(1) for s in tally.seen),
                    "missing": missing,
                    "bytes": tally.nbytes,
                    "duplicates": tally.duplicates,
                    "fifo_violations": tally.fifo_violations,
                    "bad_checksum": tally.bad_checksum,
                    "bad_header": tally.bad_header,
                    "size_mismatch": tally.size_mismatch,
                    "errors": tally.errors[:20],
                    "first_send_ns": tally.first_send_ns,
                    "last_recv_ns": tally.last_recv_ns,
                    "latency_ns": _percentiles(lat),
                    "stats": w.stats().get("shm", {}),
                },
            )
        )
        wait_for_close(conn)
        w.cleanup(_STEP)
    conn.send(("bye",))


def _check_message(a: Any, k: int, plan: LoadPlan, tally: _Check, consumed: Any) -> int | None:
    """Check one arrival on key ``k``; its send time, or None if the header is unusable."""
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1 or a.size < HEADER.size:
        tally.bad_header += 1
        return None
    magic, p, kk, s, size, send_ns, crc = HEADER.unpack_from(a.data, 0)
    if magic != MAGIC or kk != k or p != plan.owner(k) or s >= tally.counts[k]:
        tally.bad_header += 1
        return None
    if tally.seen[k][s]:
        tally.duplicates += 1
    elif s != tally.received[k]:
        tally.fifo_violations += 1  # FIFO: the n-th arrival on a key must be its n-th send
    tally.seen[k][s] = 1
    if size != a.size or size != int(plan.sizes[k][s]):
        tally.size_mismatch += 1
    if zlib.crc32(a[HEADER.size :].data) != crc:
        tally.bad_checksum += 1
    tally.nbytes += int(a.size)
    consumed[p] += int(a.size)
    return int(send_ns)


def _percentiles(ns: npt.NDArray[Any]) -> dict[str, float]:
    if ns.size == 0:
        return {}
    q = np.percentile(ns, [50, 90, 99, 99.9])
    return {
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "p999": float(q[3]),
        "max": float(ns.max()),
        "mean": float(ns.mean()),
    }


# -- the run -------------------------------------------------------------------------------------


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
        group.start("consumer", _consumer, cfg, namespace, go, consumed)
        for p, name in enumerate(producers):
            group.start(name, _producer, p, cfg, namespace, go, consumed)
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
