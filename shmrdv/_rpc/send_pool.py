"""SendPool: the memory of the producer's copies of tensors for other hosts, kept for reuse.

``send`` to a consumer on another host copies the value (the caller may write into its
array at once), and the copy waits in the outbox until gRPC has written it. A pipeline
that runs a window ahead holds up to ``max_inflight_bytes`` of such copies at once. Made
by ``malloc`` and freed together once written, glibc gives that heap back to the system
between bursts (its trim), and the next burst faults every page in again: measured here
(one CPU, a 64 KiB copy), 37 us and 16 minor page faults into fresh memory against 1.8 us
into memory used before. In the 64 KiB pipeline (``bench --pipeline``) that copy took
about two thirds of the producer's sending thread.

``SendPool.copy`` makes the copy in a block of memory that an earlier copy of the same
size class (its size rounded up to a page) used, when one is free:

* **Never reused while referenced**: a copy is a read-only array whose numpy base is a
  ``_Lease`` of its block; the block comes back to the pool only when the lease is
  collected, that is when the copy and every view of it (the outbox's value, the
  message pieces made of it) are gone.
* **Bounded**: the free blocks total at most ``max_bytes``; a block that does not fit
  pushes out the blocks of the size class freed least recently, or is freed as usual.
  Only copies of ``MIN_BYTES`` and more are pooled (smaller ones come warm from
  ``malloc``'s bins).
* ``close`` frees the free blocks; copies still alive are freed as usual when they go.

Thread model: ``copy`` runs in sending threads; a block comes back in the thread that
drops the last reference (the server's event loop, mostly). One re-entrant lock: a
collection that frees a copy while ``copy`` holds the lock in the same thread gives its
block back there.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["MIN_BYTES", "SendPool"]

#: Smallest copy made in pooled memory.
MIN_BYTES = 32 << 10
_PAGE = 4096


class SendPool:
    """Blocks of memory for the producer's copies, reused per size class (module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._lock = threading.RLock()
        # size class -> its free blocks; the dict's order: the class given a block back
        # least recently first (the one pushed out when the pool is full).
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = {}
        self._free_bytes = 0
        self._closed = False
        self._stats = {"send_pool_reused": 0, "send_pool_made": 0}

    def __repr__(self) -> str:
        return f"<SendPool {self._free_bytes}/{self._max} bytes free closed={self._closed}>"

    def copy(self, value: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
        """A read-only, C-contiguous copy of ``value`` in pooled memory; None for a value
        the pool does not take (under ``MIN_BYTES``, over the bound, of objects, or the
        pool closed): copy it as usual."""
        nbytes = value.nbytes
        if nbytes < MIN_BYTES or nbytes > self._max or value.dtype.hasobject or self._closed:
            return None
        size = -(-nbytes // _PAGE) * _PAGE
        block = None
        with self._lock:
            free = self._free.get(size)
            if free:
                block = free.pop()
                self._free_bytes -= size
                self._stats["send_pool_reused"] += 1
            else:
                self._stats["send_pool_made"] += 1
        if block is None:
            block = np.empty(size, np.uint8)
        lease = _Lease()
        lease.pool = self
        lease.block = block
        lease.__array_interface__ = {
            "data": (block.ctypes.data, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        out: npt.NDArray[Any] = np.asarray(lease).view(value.dtype).reshape(value.shape)
        np.copyto(out, value, casting="no")
        out.flags.writeable = False
        return out

    def give_back(self, block: npt.NDArray[np.uint8]) -> None:
        """``block``'s last copy is gone (its lease): keep it for the next, if it fits."""
        size = block.nbytes
        with self._lock:
            if self._closed or size > self._max:
                return
            while self._free_bytes + size > self._max:  # push out the stalest class
                oldest = next(iter(self._free))
                blocks = self._free[oldest]
                blocks.pop()
                self._free_bytes -= oldest
                if not blocks:
                    del self._free[oldest]
            blocks = self._free.pop(size, [])
            blocks.append(block)
            self._free[size] = blocks  # now the class given a block back most recently
            self._free_bytes += size

    def close(self) -> None:
        """Free the free blocks and pool no more. Idempotent."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._free_bytes = 0

    def stats(self) -> dict[str, int]:
        """Copies made in reused and in new blocks, and the bytes of the free blocks."""
        with self._lock:
            out = dict(self._stats)
            out["send_pool_free_bytes"] = self._free_bytes
        return out


class _Lease:
    """One copy's hold on its block: the numpy base of the copy and of its views; when
    it is collected (they are all gone), the block goes back to its pool."""

    __slots__ = ("__array_interface__", "block", "pool")

    pool: SendPool
    block: npt.NDArray[np.uint8]
    __array_interface__: dict[str, Any]

    def __del__(self) -> None:
        self.pool.give_back(self.block)
