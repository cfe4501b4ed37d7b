"""The two processes of a ``shmrdv bench --soak`` run: the producer and the consumer, each a
``shmrdv.Worker`` that samples itself (``soak_sample.py``) as it goes.

Pacing: the consumer sends a credit (a 1-element array, back through shmrdv) after every
``batch`` handoffs; the producer runs at most ``lag`` batches ahead. At each sample point
(every ~N/``samples`` handoffs, a multiple of ``batch``) both sides are quiet: the producer
takes every earlier credit and then sends a sync message; the consumer, having received
the batch and the sync, samples and only then sends the batch's credit; the producer
samples once it has that credit. So neither samples with a message in flight, and the
``/dev/shm`` counts are comparable from sample to sample.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from .._procs import ChildFailed, wait_for_close
from .soak_plan import CONSUMER_TASK, PRODUCER_TASK, STEP, SoakConfig, soak_keys, soak_sizes
from .soak_sample import process_sample

__all__ = ["consumer_main", "producer_main"]


def _stamp(buf: npt.NDArray[Any], i: int) -> None:
    buf[:8].view(np.int64)[0] = i
    buf[-8:].view(np.int64)[0] = i


def producer_main(conn: Connection, cfg: SoakConfig, namespace: str, go: Any) -> None:
    import shmrdv

    sizes = soak_sizes(cfg)
    keys, credit, sync = soak_keys()
    n_total, interval = cfg.handoffs, cfg.interval
    with shmrdv.Worker(PRODUCER_TASK, namespace=namespace) as w:
        rdv = w.rendezvous(STEP)
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
        w.cleanup(STEP)
    conn.send(("bye",))


def consumer_main(conn: Connection, cfg: SoakConfig, namespace: str, go: Any) -> None:
    import shmrdv

    sizes = soak_sizes(cfg)
    keys, credit, sync = soak_keys()
    n_total, interval = cfg.handoffs, cfg.interval
    bad: list[str] = []
    with shmrdv.Worker(CONSUMER_TASK, namespace=namespace) as w:
        rdv = w.rendezvous(STEP)
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
        w.cleanup(STEP)
    conn.send(("bye",))
