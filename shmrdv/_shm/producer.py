"""The producer side of the same-host transport: sequence numbers, publish, rings, doorbells.

``send`` writes the array into a segment — a warm pool slot when one fits, else a fresh
fallocated segment — writes the header, then publishes it with one rename (no replace)
to the message's name, derived from (namespace, step, key, producer incarnation,
sequence number). The consumer can never see a half-written tensor: the name appears
only once the bytes are complete, also if the producer dies mid-write (then only a
``t``/``p`` name is left, for ``gc``). Small tensors instead travel inline in the ring
this producer keeps for their consumer (``ring.py``). Then the consumer's doorbell is
posted.

Thread model: any thread may call ``send`` / ``allocate``. ``_publish_lock`` serialises
the sequence numbers and the rings (single producer per ring); ``_lock`` guards the
allocation table and the doorbell cache. Neither is held across a call that can block.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .._devices import DeviceName
from .._errors import InternalError, InvalidArgumentError, RendezvousError
from .._keys import ParsedKey
from . import layout
from .bell import Bell
from .copier import copy_into
from .naming import Names
from .pool import Slot, SlotPool
from .ring import RINGS_SUPPORTED, Ring, ring_size
from .segment import Segment, move_noreplace

__all__ = ["RING_CAPACITY", "RING_LIMIT", "Producer", "inline_max", "task_name"]

_log = logging.getLogger("shmrdv.shm")

# Tensors of at most this many bytes (SHMRDV_INLINE_MAX, default and maximum 64 KiB; 0
# turns it off) travel inline in the producer's ring for their consumer (``ring.py``)
# instead of a segment of their own: for them the dozen system calls of a segment cost
# far more than copying the bytes (a 64 B round trip drops from ~750 µs to ~150 µs here).
RING_LIMIT = 64 << 10
RING_CAPACITY = 1 << 20


def inline_max() -> int:
    """The inline limit in bytes from ``SHMRDV_INLINE_MAX`` (default and maximum 64 KiB)."""
    try:
        wanted = int(os.environ.get("SHMRDV_INLINE_MAX", str(RING_LIMIT)))
    except ValueError:
        return RING_LIMIT
    return max(0, min(wanted, RING_LIMIT))


def task_name(dev: DeviceName) -> str:
    """The canonical task part of ``dev``: ``/job:<j>/replica:<r>/task:<t>``."""
    job, replica, task = dev.task_key()
    return f"/job:{job}/replica:{replica}/task:{task}"


@dataclass(eq=False)
class _Allocation:
    """An array handed out by ``allocate``: where it lives and what it may be sent as."""

    ref: weakref.ref[npt.NDArray[Any]]
    step: int
    key: str
    header: layout.Header
    segment: Segment | None  # None: a small array, sent inline through the ring
    slot: Slot | None
    sent: bool = False


class Producer:
    """The sending half of one worker's shared-memory transport (see the module docstring)."""

    def __init__(self, names: Names, task: str, incarnation: int, pool_bytes: int) -> None:
        self._names = names
        self._task = task
        self._inc = incarnation
        self._pid = os.getpid()
        self._inline_max = inline_max()
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._send_seq: dict[tuple[int, str], int] = {}
        self._allocations: dict[int, _Allocation] = {}
        self._peer_bells: dict[str, Bell] = {}
        # consumer task -> (segment, ring), or None where a ring cannot be made.
        self._rings_out: dict[str, tuple[Segment, Ring] | None] = {}
        self._pool = SlotPool(names, task, incarnation, pool_bytes)
        self.counters = {"sent": 0, "sent_bytes": 0, "sent_zero_copy": 0}

    # -- allocate ---------------------------------------------------------------------

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        try:
            dt = np.dtype(dtype)
            shp = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"allocate({key.full_key!r}): bad shape {shape!r} or dtype {dtype!r}: {e}"
            ) from e
        if any(d < 0 for d in shp):
            raise InvalidArgumentError(
                f"allocate({key.full_key!r}): negative dimension in shape {shp}"
            )
        if dt.hasobject:
            raise InvalidArgumentError(
                f"allocate({key.full_key!r}): dtype {dt} holds Python objects, "
                "which cannot be shared"
            )
        header = layout.Header.build(
            key=key.full_key,
            dtype=dt,
            shape=shp,
            step_id=step_id,
            seq=0,
            producer_incarnation=self._inc,
            producer_pid=self._pid,
        )
        seg: Segment | None = None
        slot: Slot | None = None
        if header.nbytes <= self._inline_max and RINGS_SUPPORTED and header.nbytes:
            # Small: it will travel inline through the ring (copying a few KiB costs less
            # than publishing a segment), so plain memory serves.
            arr: npt.NDArray[Any] = np.empty(shp, dt)
        else:
            slot, seg = self._segment_for(header.segment_size)
            if slot is not None:
                header = replace(header, slot=slot.index)
            arr = seg.ndarray(header)
        alloc = _Allocation(weakref.ref(arr), step_id, key.full_key, header, seg, slot)
        with self._lock:
            self._allocations[id(arr)] = alloc
        weakref.finalize(arr, self._allocation_dropped, id(arr), alloc)
        return arr

    def _allocation_dropped(self, ident: int, alloc: _Allocation) -> None:
        with self._lock:
            if self._allocations.get(ident) is alloc:
                del self._allocations[ident]
        if alloc.sent:
            return
        # Allocated and never sent: the memory is still the producer's.
        if alloc.slot is not None:
            self._pool.release(alloc.slot)
        elif alloc.segment is not None:
            alloc.segment.unlink()
            alloc.segment.close()

    def _segment_for(self, size: int) -> tuple[Slot | None, Segment]:
        slot = self._pool.acquire(size)
        if slot is not None:
            return slot, slot.segment
        return None, Segment.create(self._names, size)

    # -- send -------------------------------------------------------------------------

    def send(self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool) -> None:
        alloc = self._allocations.get(id(value)) if self._allocations else None
        if alloc is not None and alloc.ref() is value:
            self._send_allocated(step_id, key, value, is_dead, alloc)
            return
        header = layout.Header.build(
            key=key.full_key,
            dtype=value.dtype,
            shape=value.shape,
            step_id=step_id,
            seq=0,
            producer_incarnation=self._inc,
            producer_pid=self._pid,
            is_dead=is_dead,
        )
        if (
            header.nbytes <= self._inline_max
            and RINGS_SUPPORTED
            and self._send_inline(step_id, key, value, header)
        ):
            return
        self._send_copy(step_id, key, value, header)

    def _send_copy(
        self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], header: layout.Header
    ) -> None:
        """Copy ``value`` into a pool slot (or a one-off segment) and publish it."""
        slot, seg = self._segment_for(header.segment_size)
        try:
            if slot is not None:
                header = replace(header, slot=slot.index)
            if header.nbytes:
                dst: npt.NDArray[Any] = np.ndarray(
                    value.shape, dtype=value.dtype, buffer=seg.buf, offset=header.data_offset
                )
                copy_into(dst, value)
                del dst
            name = self._publish(step_id, key, header, seg)
        except BaseException:
            if slot is not None:
                self._pool.release(slot)
            else:
                seg.unlink()
                seg.close()
            raise
        if slot is not None:
            self._pool.lend(slot, key.full_key, name)
        else:
            seg.close()
        self._after_publish(key, header.nbytes)

    def _ring_to(self, dst: DeviceName) -> Ring | None:
        """This producer's ring for the consumer ``dst`` (made on first use), or None."""
        task = task_name(dst)
        if task in self._rings_out:
            entry = self._rings_out[task]
            return None if entry is None else entry[1]
        entry = None
        seg: Segment | None = None
        name = self._names.ring(self._task, self._inc, task)
        try:
            seg = Segment.create(self._names, ring_size(RING_CAPACITY))
            meta = json.dumps({"producer": self._task, "incarnation": self._inc, "consumer": task})
            ring = Ring.format(memoryview(seg.buf), RING_CAPACITY, meta.encode())
            move_noreplace(seg.path, Names.path(name))  # published only once formatted
            seg.name = name
            entry = (seg, ring)
        except (OSError, RendezvousError) as e:
            _log.warning("no small-message ring to %s (%s); segments only", task, e)
            if seg is not None:
                _unlink_quietly(seg)
                seg.close()
        self._rings_out[task] = entry
        return None if entry is None else entry[1]

    def _send_inline(
        self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], header: layout.Header
    ) -> bool:
        """Append the message to the consumer's ring; False if it has no ring or no room."""
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        k = (step_id, key.full_key)
        with self._publish_lock:
            ring = self._ring_to(key.dst)
            if ring is None:
                return False
            seq = self._send_seq.get(k, 0)
            head = layout.pack(replace(header, seq=seq))
            pad = header.data_offset - len(head)
            if not ring.try_put((head, bytes(pad), data.data)):
                return False  # full: this one goes through a segment, in sequence
            self._send_seq[k] = seq + 1
        self._after_publish(key, header.nbytes)
        return True

    def _send_allocated(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        alloc: _Allocation,
    ) -> None:
        if alloc.sent:
            raise InvalidArgumentError(
                f"this array from allocate() was already sent (under key {alloc.key!r}); "
                "its memory belongs to the consumer now: allocate a new one"
            )
        if alloc.key != key.full_key or alloc.step != step_id:
            raise InvalidArgumentError(
                f"this array was allocated for key {alloc.key!r} in step {alloc.step} and "
                f"cannot be sent under key {key.full_key!r} in step {step_id}"
            )
        header = replace(alloc.header, is_dead=is_dead, created_ns=time.time_ns())
        with self._lock:
            if alloc.sent:
                raise InvalidArgumentError(
                    f"this array from allocate() was already sent (key {alloc.key!r})"
                )
            alloc.sent = True
        if alloc.segment is None:
            # A small one: inline through the ring, else (ring full) a segment of its own.
            try:
                if not self._send_inline(step_id, key, value, header):
                    self._send_copy(step_id, key, value, header)
            except BaseException:
                alloc.sent = False
                raise
            value.flags.writeable = False
            return
        try:
            name = self._publish(step_id, key, header, alloc.segment)
        except BaseException:
            alloc.sent = False
            raise
        # The memory is the consumer's from here on: stop the producer writing into it.
        value.flags.writeable = False
        if alloc.slot is not None:
            self._pool.lend(alloc.slot, key.full_key, name)
        else:
            alloc.segment.close()
        self.counters["sent_zero_copy"] += 1
        self._after_publish(key, header.nbytes)

    def _publish(self, step_id: int, key: ParsedKey, header: layout.Header, seg: Segment) -> str:
        """Give the message its sequence number and its name, atomically; return the name.

        Raises ``InternalError`` if a file has that name already (planted by another user,
        or left by an earlier run with the same incarnation): it is neither replaced nor
        written into. That sequence number is skipped (the consumer skips it too: it
        refuses the file, or reads the earlier run's message).
        """
        k = (step_id, key.full_key)
        with self._publish_lock:
            seq = self._send_seq.get(k, 0)
            header = replace(header, seq=seq)
            layout.pack_into(seg.buf, header)
            name = self._names.message(step_id, key.full_key, self._inc, seq)
            try:
                move_noreplace(seg.path, Names.path(name))
            except FileExistsError as e:
                self._send_seq[k] = seq + 1
                raise InternalError(
                    f"cannot publish key {key.full_key!r} (step {step_id}, message {seq}): {name} "
                    "exists already — planted by another process, or an unreceived message of an "
                    "earlier run with this incarnation; it was left untouched"
                ) from e
            except OSError as e:
                raise InternalError(f"cannot publish key {key.full_key!r} as {name}: {e}") from e
            seg.name = name
            self._send_seq[k] = seq + 1
        return name

    def _after_publish(self, key: ParsedKey, nbytes: int) -> None:
        self.counters["sent"] += 1
        self.counters["sent_bytes"] += nbytes
        bell = self._peer_bell(key.dst)
        if bell is not None:
            bell.ring()

    def _peer_bell(self, dst: DeviceName) -> Bell | None:
        task = task_name(dst)
        bell = self._peer_bells.get(task)
        if bell is None:
            try:
                bell = Bell.open(self._names, task)
            except RendezvousError:
                _log.warning(
                    "doorbell of %s refused (not ours); relying on the dispatcher tick", task
                )
                return None
            if bell is None:
                return None  # consumer not started: it scans when it starts
            with self._lock:
                bell = self._peer_bells.setdefault(task, bell)
        return bell

    # -- steps and lifetime -----------------------------------------------------------

    def cleanup_step(self, step_id: int) -> None:
        with self._publish_lock:
            for k in [k for k in self._send_seq if k[0] == step_id]:
                del self._send_seq[k]

    def close(self) -> None:
        """Sweep the pool, unmap the rings, close the doorbells. The caller has already
        unlinked this worker's own doorbell (``pool.give_back`` relies on that order)."""
        self._pool.close()
        with self._publish_lock:
            for entry in self._rings_out.values():
                if entry is not None:
                    seg, ring = entry
                    # A ring its consumer never attached keeps its name while it holds
                    # messages (they are the consumer's); an empty one goes.
                    if not ring.pending():
                        _unlink_quietly(seg)
                    ring.release()
                    seg.close()
            self._rings_out.clear()
        with self._lock:
            bells = list(self._peer_bells.values())
            self._peer_bells.clear()
        for b in bells:
            b.close()

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        with self._lock:
            out["allocations"] = len(self._allocations)
        out["rings_out"] = sum(1 for e in list(self._rings_out.values()) if e)
        out.update(self._pool.stats())
        return out


def _unlink_quietly(seg: Segment) -> None:
    try:
        seg.unlink()
    except RendezvousError as e:
        _log.warning("%s", e)
