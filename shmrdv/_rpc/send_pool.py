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

Thread model (``docs/threads.md``): ``copy`` runs in sending threads; a block comes back
in the thread that drops the last reference (the server's event loop, mostly). One
re-entrant lock: a collection that frees a copy while ``copy`` holds the lock in the same
thread gives its block back there.
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
        self._free: dict[int, list[_Block]] = {}
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
        dtype = value.dtype
        if nbytes < MIN_BYTES or nbytes > self._max or dtype.hasobject or self._closed:
            return None
        size = -(-nbytes // _PAGE) * _PAGE
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
            if block is not None:
                self._free_bytes -= size
                self._stats["send_pool_reused"] += 1
            else:
                self._stats["send_pool_made"] += 1
        if block is None:
            block = _Block(size)
        shape = value.shape
        np.copyto(block.typed(dtype, shape, nbytes), value, casting="no")
        lease = _Lease()
        lease.pool = self
        lease.block = block
        lease.__array_interface__ = block.interface
        out: npt.NDArray[Any] = np.asarray(lease)
        if out.dtype != dtype or out.shape != shape:  # a dtype the interface cannot name
            out = out.view(dtype).reshape(shape)
        return out

    def give_back(self, block: _Block) -> None:
        """``block``'s last copy is gone (its lease): keep it for the next, if it fits."""
        size = block.size
        with self._lock:
            if self._closed or size > self._max:
                return
            while self._free_bytes + size > self._max:  # push out the stalest class
                oldest = next(iter(self._free))
                stale = self._free[oldest]
                stale.pop()
                self._free_bytes -= oldest
                if not stale:
                    del self._free[oldest]
            blocks = self._free.get(size)
            if blocks is None:
                self._free[size] = [block]
            else:
                if next(reversed(self._free)) != size:
                    del self._free[size]  # now the class given a block back most recently
                    self._free[size] = blocks
                blocks.append(block)
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


class _Block:
    """One block of pooled memory: ``size`` bytes, the writable view of it a copy of a
    dtype and shape is made through, and the read-only array interface of that copy
    (both kept for the next copy of the same dtype and shape)."""

    __slots__ = ("_key", "_typed", "interface", "memory", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.memory = np.empty(size, np.uint8)
        self._key: tuple[np.dtype[Any], tuple[int, ...]] | None = None
        self._typed: npt.NDArray[Any] = self.memory
        self.interface: dict[str, Any] = {}

    def typed(self, dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int) -> npt.NDArray[Any]:
        """The block's first ``nbytes`` as a writable array of ``dtype`` and ``shape``,
        and ``interface`` set to describe them read-only."""
        key = (dtype, shape)
        if key != self._key:
            self._typed = self.memory[:nbytes].view(dtype).reshape(shape)
            plain = dtype.names is None and dtype.subdtype is None
            address = self.memory.__array_interface__["data"][0]
            self.interface = {
                "data": (address, True),  # read-only
                "shape": shape if plain else (nbytes,),
                "typestr": dtype.str if plain else "|u1",
                "version": 3,
            }
            self._key = key
        return self._typed


class _Lease:
    """One copy's hold on its block: the numpy base of the copy and of its views; when
    it is collected (they are all gone), the block goes back to its pool."""

    __slots__ = ("__array_interface__", "block", "pool")

    pool: SendPool
    block: _Block
    __array_interface__: dict[str, Any]

    def __del__(self) -> None:
        self.pool.give_back(self.block)
