"""What a ``shmrdv bench --soak`` run does: its configuration, the size of every handoff, its
tasks and keys (the same in every process of the run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import options
from .common import parse_array_size

__all__ = [
    "CONSUMER_TASK",
    "PRODUCER_TASK",
    "SOAK_SIZES",
    "STEP",
    "SoakConfig",
    "soak_keys",
    "soak_sizes",
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
STEP = 0


@dataclass(frozen=True)
class SoakConfig:
    """What a soak run does (``soak_roles.py`` says what ``batch`` and ``lag`` pace)."""

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


def soak_keys() -> tuple[list[Any], Any, Any]:
    import shmrdv

    src, dst = PRODUCER_TASK + "/device:CPU:0", CONSUMER_TASK + "/device:CPU:0"
    data = [shmrdv.parse_key(shmrdv.create_key(src, 0, dst, f"soak_{k}")) for k in range(16)]
    credit = shmrdv.parse_key(shmrdv.create_key(dst, 0, src, "soak_credit"))
    sync = shmrdv.parse_key(shmrdv.create_key(src, 0, dst, "soak_sync"))
    return data, credit, sync
