"""What a ``shmrdv bench --soak`` process measures of itself at a sample point: RSS, open
descriptors, threads, and the namespace's objects in ``/dev/shm`` (pool slots apart).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["process_sample"]

# Per-peer small-message rings are bounded like the pool (one per producer/consumer pair).
_POOL_KINDS = frozenset({"pool", "held", "returned", "ring"})
_PAGE = os.sysconf("SC_PAGE_SIZE")


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
    from .._shm.reaper import list_objects

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
