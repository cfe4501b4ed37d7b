"""The processes of a ``shmrdv bench --load`` run: its producers, and the consumer that checks
every message (``load_plan.py`` says what they send).

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
"""

from __future__ import annotations

import queue
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from .._procs import ChildFailed, wait_for_close
from .load_plan import (
    CONSUMER_TASK,
    HEADER,
    MAGIC,
    PAYLOAD_SLACK,
    PRODUCER_TASK,
    STEP,
    LoadConfig,
    LoadPlan,
    key_name,
    make_plan,
)

__all__ = ["consumer_main", "producer_main"]


def producer_main(
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
        rdv = w.rendezvous(STEP)
        keys = {k: shmrdv.parse_key(key_name(k, p)) for k in plan.keys_of(p)}
        source = np.random.default_rng([cfg.seed, p, 1]).integers(
            0, 256, cfg.max_size + PAYLOAD_SLACK, dtype=np.uint8
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
            off = (k * 7919 + s * 104729) % PAYLOAD_SLACK
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
        w.cleanup(STEP)
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


def consumer_main(
    conn: Connection, cfg: LoadConfig, namespace: str, go: Any, consumed: Any
) -> None:
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
        rdv = w.rendezvous(STEP)
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
        w.cleanup(STEP)
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
