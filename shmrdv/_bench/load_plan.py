"""What a ``shmrdv bench --load`` run sends: its configuration, and the plan every process
derives from it (who sends which sizes on which key).

Shape: ``producers`` spawned processes, each a ``shmrdv.Worker`` task, send
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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import options
from .common import parse_array_size

__all__ = [
    "CONSUMER_TASK",
    "HEADER",
    "MAGIC",
    "PAYLOAD_SLACK",
    "PRODUCER_TASK",
    "SIZE_BUCKETS",
    "STEP",
    "LoadConfig",
    "LoadPlan",
    "draw_sizes",
    "key_name",
    "make_plan",
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
STEP = 0
PAYLOAD_SLACK = 1 << 16  # the random payload source is this much longer than a message


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
