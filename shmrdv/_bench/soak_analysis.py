"""Whether anything grew over a ``shmrdv bench --soak`` run: a line fitted to each series of
samples after warm-up, judged by its kind.

Each process samples: RSS (``/proc/self/statm``), open descriptors (``/proc/self/fd``),
threads (``threading.active_count`` and ``Threads:`` of ``/proc/self/status``), and the
namespace's objects in ``/dev/shm`` (``reaper.list_objects``: how many, bytes held). The
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
"
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["COUNT_SERIES", "INFO_SERIES", "SIZE_SERIES", "SeriesReport", "analyse"]

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
_MIN_SIZE_SLACK = 1 << 20  # a size series may always wander this much


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
