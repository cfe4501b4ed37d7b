"""The same-host transport: tensors through POSIX shared memory named by key.

Producer (``send``): write the array into a segment — a warm pool slot when one fits,
else a fresh fallocated segment — write the header, then publish it with one
``rename`` to the message's name, derived from (namespace, step, key, producer
incarnation, sequence number). The consumer can never see a half-written tensor: the
name appears only once the bytes are complete, also if the producer dies mid-write
(then only a ``t``/``p`` name is left, for ``gc``). Then post the consumer's doorbell.

Consumer (``recv``): each (step, key) is a channel with the next sequence number it
expects. A receive opens that name; if it is not there yet the waiter is queued and the
transport's one dispatcher thread, woken by the doorbell, opens it when it appears. The
array handed out is a view over the mapped segment (zero copy), writable and the
consumer's alone; the segment's name is unlinked (or, for a pool slot, renamed to
``held``) at once, so the memory goes back when the array is garbage-collected — or
when the consumer dies, since nothing names it any more (a held slot: by ``gc``).

Names are the truth, the doorbell is a hint: a lost or extra post costs at most one
dispatcher tick (``_TICK``), never a message. The same tick checks, for channels with
waiters, whether their producer died (its presence record's flock, released by the
kernel at death — a stopped process still holds it): a receive whose producer was
alive and then died fails with ``UnavailableError`` within a second.

Thread model: any thread may send or receive; one dispatcher thread per transport,
whatever the number of pending keys, runs the ``done`` callbacks of receives that had
to wait, outside every lock.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._callbacks import DoneCallback
from .._devices import DeviceName
from .._errors import (
    AbortedError,
    InternalError,
    InvalidArgumentError,
    RendezvousError,
    UnavailableError,
)
from .._keys import ParsedKey
from .._received import Received
from .._rendezvous import Canceller, RecvSlot, _timeout_error
from . import layout
from .bell import Bell
from .copier import copy_into
from .naming import Names, parse_name
from .pool import Slot, SlotPool
from .presence import read_presence
from .ring import RINGS_SUPPORTED, Ring, ring_size
from .segment import Segment, peek_header

if TYPE_CHECKING:
    from .._worker import Worker

__all__ = ["ShmTransport"]

_log = logging.getLogger("shmrdv.shm")

# Dispatcher wake-up period while receives are pending: bounds the cost of a lost
# doorbell post and the time to notice a dead producer (the issue asks for < 1 s).
_TICK = 0.2
# Above this many channels with waiters, one listdir of /dev/shm is cheaper than one
# open() attempt per channel.
_LISTDIR_ABOVE = 64
# Before blocking on the doorbell, a polling thread tries it without blocking for this
# long: waking a process that sleeps on another vCPU costs 30-70 µs on this kind of VM
# (research/peer_numbers.md), so a reply that comes within the spin is taken at once.
# The spin adapts (``_adapt_spin``) between these bounds; an idle consumer spins at most
# once per _TICK: under 0.1 % of a core. (500 µs measured no better here: two spinning
# processes on two vCPUs starve the one doing the work.)
_SPIN_MIN_NS = 20_000
_SPIN_MAX_NS = 100_000
# Tensors of at most this many bytes (SHMRDV_INLINE_MAX, default and maximum 64 KiB; 0
# turns it off) travel inline in the producer's ring for their consumer (``ring.py``)
# instead of a segment of their own: for them the dozen system calls of a segment cost
# far more than copying the bytes (a 64 B round trip drops from ~750 µs to ~150 µs here).
_RING_LIMIT = 64 << 10
# How often a consumer looks for a producer's ring that is not there yet.
_RING_LOOK_S = 0.02


def _inline_max() -> int:
    try:
        wanted = int(os.environ.get("SHMRDV_INLINE_MAX", str(_RING_LIMIT)))
    except ValueError:
        return _RING_LIMIT
    return max(0, min(wanted, _RING_LIMIT))


_RING_CAPACITY = 1 << 20

# renameat2(2) with RENAME_NOREPLACE (Linux >= 3.15 on tmpfs, glibc >= 2.28): an atomic
# move that refuses an existing target. Plain rename() replaces the target, and as root it
# even replaces another user's file in the sticky /dev/shm: a planted file, or an
# unreceived message of an earlier run, would be silently destroyed.
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2: Any = _libc.renameat2
    _renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    _renameat2.restype = ctypes.c_int
except (AttributeError, OSError):  # pragma: no cover - an old libc
    _renameat2 = None


def _move_noreplace(old: str, new: str) -> None:
    """Move the file ``old`` to the name ``new`` atomically; ``FileExistsError`` if ``new`` exists.

    Raises other ``OSError`` s unchanged (``FileNotFoundError`` when ``old`` is gone).
    """
    if _renameat2 is not None:
        if (
            _renameat2(_AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), _RENAME_NOREPLACE)
            == 0
        ):
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), old, None, new)
    # No renameat2 here: link() refuses an existing name too (pitfalls.md §3); the old name
    # goes right after (both names briefly exist, which no reader minds).
    os.link(old, new, follow_symlinks=False)
    try:
        os.unlink(old)
    except FileNotFoundError:
        pass


@dataclass(eq=False)
class _Waiter:
    done: DoneCallback
    copy: bool
    channel: _Channel | None = None
    # A thread blocked in recv_blocking polls the doorbell itself; only callback waiters
    # (recv_async, futures, asyncio) need the dispatcher thread.
    blocking: bool = False


@dataclass(eq=False)
class _Channel:
    """The consumer side of one (step, key): the next sequence number and who waits for it."""

    step: int
    key: ParsedKey
    inc: int = 0  # producer incarnation the names are computed with (0 = not known yet)
    seq: int = 0
    seen_alive: bool = False
    waiters: deque[_Waiter] = field(default_factory=deque)
    _name: str | None = None
    _name_for: tuple[int, int] = (-1, -1)

    def name(self, names: Names) -> str:
        if self._name_for != (self.inc, self.seq):
            self._name = names.message(self.step, self.key.full_key, self.inc, self.seq)
            self._name_for = (self.inc, self.seq)
        assert self._name is not None
        return self._name


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


def _return_slot(
    names: Names, producer_task: str, incarnation: int, slot: int, held_names: set[str]
) -> None:
    """Consumer side, when the last array over a pool slot is collected: give it back.

    ``held`` -> ``returned``; if the producer is gone (closed, dead or restarted) nobody
    will take it back, so unlink it instead. Runs in whatever thread collected the array
    (possibly inside the garbage collector: it takes no lock).
    """
    held_name = names.held(producer_task, incarnation, slot)
    held_names.discard(held_name)
    _give_back(names, producer_task, incarnation, slot, Names.path(held_name))


def _give_back(names: Names, producer_task: str, incarnation: int, slot: int, path: str) -> None:
    """Rename the pool slot file at ``path`` to its ``returned`` name, for its producer.

    If the producer is no longer the live worker of that incarnation, nobody will take it
    back: unlink it instead. A missing ``path`` (removed by close or gc meanwhile) is fine.

    No ``returned`` file outlives a closing producer: its ``close`` unlinks its doorbell
    first and then removes the ``returned`` names of its lent slots. We rename first, then
    look for the doorbell, then for its live presence record; if we see both, the doorbell
    we saw was that producer's (a successor's appears only after the record is gone), so
    our rename came before its sweep, which will find the file.
    """
    ret = Names.path(names.returned(producer_task, incarnation, slot))
    try:
        _move_noreplace(path, ret)
    except FileNotFoundError:
        return  # removed by close or gc meanwhile
    except OSError as e:
        _log.warning("cannot give pool slot %s back (%s); unlinking it", path, e)
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        alive = os.path.lexists(names.bell_path(producer_task))
        if alive:
            alive = _producer_alive(names, producer_task, incarnation)
    except Exception:  # a corrupt or foreign record: treat as gone
        alive = False
    if not alive:
        try:
            os.unlink(ret)
        except OSError:
            pass


# (namespace, task) -> ((st_dev, st_ino) of the record, its incarnation, an fd on it).
_records: dict[tuple[str, str], tuple[tuple[int, int], int, int]] = {}


def _producer_alive(names: Names, task: str, incarnation: int) -> bool:
    """Is ``task``'s live worker the producer of that incarnation? Cheap and lock-free.

    ``_give_back`` runs once per received message, possibly inside the garbage collector,
    so this takes no Python lock and reads the record only when its inode changes: in the
    steady state it is one ``stat`` and one ``flock`` test.
    """
    path = Names.path(names.presence(task))
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (names.namespace, task)
    cached = _records.get(key)
    if cached is None or cached[0] != (st.st_dev, st.st_ino):
        info = read_presence(names, task)
        if info is None:
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        fst = os.fstat(fd)
        cached = ((fst.st_dev, fst.st_ino), info.incarnation, fd)
        # Lock-free, so two callers (threads, or gc inside one) may both get here: the
        # one whose pop finds the old entry closes it, exactly once.
        old = _records.pop(key, None)
        _records[key] = cached
        if old is not None:
            os.close(old[2])
    if cached[1] != incarnation:
        return False
    try:
        fcntl.flock(cached[2], fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # its owner holds the lock: alive
    except OSError:
        return False
    fcntl.flock(cached[2], fcntl.LOCK_UN)
    return False


def _flock_held(names: Names, task: str) -> bool:
    from .presence import PeerWatch

    with PeerWatch(names, task) as w:
        return w.state() == "alive"


class ShmTransport:
    """Shared-memory transport of one Worker (see the module docstring)."""

    name = "shm"

    def __init__(self, worker: Worker, *, pool_bytes: int) -> None:
        self._w = worker
        self._names: Names = worker._names
        self._task = worker.task
        self._inc = worker.incarnation
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._polling = False  # a thread is waiting on the doorbell (recv_blocking, _run)
        self._spin_ns = _SPIN_MIN_NS
        self._inline_max = _inline_max()
        self._wait_avg_ns = _SPIN_MAX_NS
        self._publish_lock = threading.Lock()
        self._closed = False
        self._send_seq: dict[tuple[int, str], int] = {}
        self._channels: dict[tuple[int, str], _Channel] = {}
        self._waiting: dict[tuple[int, str], _Channel] = {}
        self._aborted: dict[int, BaseException] = {}
        # ``held`` names of pool slots whose arrays this consumer still has. Finalizers do not
        # run at exit, so close() unlinks what is left (the mappings stay valid).
        self._held: set[str] = set()
        # Headers of published messages, by name (names are never reused), for finding the
        # incarnation of a producer that is gone (``_orphan_incarnation``).
        self._orphans: dict[str, tuple[int, str, int, int, int]] = {}
        self._orphans_at = 0.0
        # Producer task -> (incarnation, when it was last seen alive), see _recently_alive.
        self._alive_at: dict[tuple[str, int, int], tuple[int, float]] = {}
        self._allocations: dict[int, _Allocation] = {}
        self._peer_bells: dict[str, Bell] = {}
        self._counters = {
            "sent": 0,
            "sent_bytes": 0,
            "sent_zero_copy": 0,
            "received": 0,
            "received_bytes": 0,
            "dispatcher_scans": 0,
        }
        # Producer side: consumer task -> (segment, ring), or None where a ring cannot be made.
        self._rings_out: dict[str, tuple[Segment, Ring] | None] = {}
        # Consumer side: (producer task, incarnation) -> (segment, ring), attached rings, and
        # what was taken from them: (step, key) -> {(incarnation, seq): value}.
        self._rings_in: dict[tuple[str, int], tuple[Segment, Ring]] = {}
        self._stash: dict[tuple[int, str], dict[tuple[int, int], Received]] = {}
        self._rings_listed_at = 0.0
        self._ring_look_at: dict[tuple[str, int], float] = {}  # see _take_inline
        self._pool = SlotPool(self._names, self._task, self._inc, pool_bytes)
        self._bell = Bell.create(self._names, self._task, replace_stale=True)
        self._thread = threading.Thread(
            target=self._run, name=f"shmrdv-shm-dispatch {self._task}", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<ShmTransport {self._task} pending={len(self._waiting)} closed={self._closed}>"

    # -- producer side --------------------------------------------------------------

    def _check_open(self, step: int) -> None:
        if self._closed:
            raise AbortedError(f"Worker {self._task} is closed")
        err = self._aborted.get(step)
        if err is not None:
            raise err

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        self._check_open(step_id)
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

    def send(self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool) -> None:
        self._check_open(step_id)
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
        task = _canonical_task(dst)
        if task in self._rings_out:
            entry = self._rings_out[task]
            return None if entry is None else entry[1]
        entry = None
        seg: Segment | None = None
        name = self._names.ring(self._task, self._inc, task)
        try:
            seg = Segment.create(self._names, ring_size(_RING_CAPACITY))
            meta = json.dumps({"producer": self._task, "incarnation": self._inc, "consumer": task})
            ring = Ring.format(memoryview(seg.buf), _RING_CAPACITY, meta.encode())
            _move_noreplace(seg.path, Names.path(name))  # published only once formatted
            seg.name = name
            entry = (seg, ring)
        except (OSError, RendezvousError) as e:
            _log.warning("no small-message ring to %s (%s); segments only", task, e)
            if seg is not None:
                self._unlink_quietly(seg)
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
        self._counters["sent_zero_copy"] += 1
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
                _move_noreplace(seg.path, Names.path(name))
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
        self._counters["sent"] += 1
        self._counters["sent_bytes"] += nbytes
        bell = self._peer_bell(key.dst)
        if bell is not None:
            bell.ring()

    def _peer_bell(self, dst: DeviceName) -> Bell | None:
        task = _canonical_task(dst)
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

    # -- consumer side --------------------------------------------------------------

    def start_recv(
        self,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        copy: bool,
        *,
        blocking: bool = False,
    ) -> Canceller:
        k = (step_id, key.full_key)
        with self._lock:
            self._check_open(step_id)
            ch = self._channels.get(k)
            if ch is None:
                ch = _Channel(step_id, key, inc=key.src_incarnation)
                self._channels[k] = ch
            result: Received | BaseException | None = None
            if not ch.waiters:
                result = self._try_take(ch)
                if result is None and not ch.seen_alive and not self._recently_alive(ch):
                    # Note now whether the producer is alive (so that its death is noticed
                    # even before the dispatcher's first look), or fail a stale incarnation.
                    result = self._producer_failure(ch)
            if result is None:
                waiter = _Waiter(done, copy, ch, blocking)
                ch.waiters.append(waiter)
                self._waiting[k] = ch
                if not blocking:
                    self._wake.notify_all()
        if result is None:
            return lambda: self._cancel(waiter)
        self._deliver([(done, copy, result)])
        return _already_done

    def _cancel(self, waiter: _Waiter) -> bool:
        with self._lock:
            ch = waiter.channel
            if ch is None:
                return False
            try:
                ch.waiters.remove(waiter)
            except ValueError:
                return False
            waiter.channel = None
            if not ch.waiters:
                self._waiting.pop((ch.step, ch.key.full_key), None)
            return True

    def _resolve_incarnation(self, ch: _Channel) -> bool:
        if ch.inc:
            return True
        try:
            info = self._w.peer_watch(ch.key.src).info()
        except RendezvousError as e:  # a record that is not ours, or corrupt
            _log.warning("presence record of %s: %s", _canonical_task(ch.key.src), e)
            return False
        if info is not None:
            ch.inc = info.incarnation
            return True
        # No record: the producer has not started, or it closed after sending. Its
        # messages are still there, under names computed with its incarnation.
        ch.inc = self._orphan_incarnation(ch)
        return ch.inc != 0

    def _orphan_incarnation(self, ch: _Channel) -> int:
        """The incarnation of the message a gone producer left for the channel's next receive.

        0 if there is none. Reads the headers of this namespace's published messages (each
        once; at most one directory listing per ``_TICK / 2``). The newest wins if runs of
        several incarnations left one.
        """
        now = time.monotonic()
        if now - self._orphans_at >= _TICK / 2:
            self._orphans_at = now
            try:
                entries = os.listdir(Names.path(""))
            except OSError:
                entries = []
            marker = self._names.prefix + "m"
            present = {e for e in entries if e.startswith(marker)}
            for name in list(self._orphans):
                if name not in present:
                    del self._orphans[name]
            for name in present - self._orphans.keys():
                h = peek_header(Names.path(name))
                if h is not None:
                    self._orphans[name] = (
                        h.step_id,
                        h.key,
                        h.seq,
                        h.producer_incarnation,
                        h.created_ns,
                    )
        if RINGS_SUPPORTED:
            self._find_rings()
            self._drain_rings()
            for inc, seq in self._stash.get((ch.step, ch.key.full_key), {}):
                if seq == ch.seq:
                    return inc
        best, best_at = 0, -1
        for step, key, seq, inc, created in self._orphans.values():
            if step == ch.step and seq == ch.seq and key == ch.key.full_key and created > best_at:
                best, best_at = inc, created
        return best

    def _try_take(self, ch: _Channel) -> Received | BaseException | None:
        """Open the channel's next message if it is published (under the lock).

        None: not published yet. An exception: that message cannot be used (a file another
        user planted under its name, a corrupt header) and is skipped, or the process is
        out of descriptors (the message stays for the next receive).
        """
        if not self._resolve_incarnation(ch):
            return None
        inline = self._take_inline(ch)
        if inline is not None:
            return inline
        name = ch.name(self._names)
        try:
            seg = Segment.attach(self._names, name)
        except FileNotFoundError:
            return None
        except InternalError as e:
            ch.seq += 1  # refused (not ours) or unreadable: never read it, never wait for it
            return e
        except RendezvousError as e:
            return e  # out of descriptors: the message stays where it is
        try:
            header = layout.unpack(seg.buf, seg.size)
            if header.key != ch.key.full_key or header.seq != ch.seq or header.step_id != ch.step:
                raise InternalError(
                    f"segment {name} holds key {header.key!r} step {header.step_id} "
                    f"seq {header.seq}, expected {ch.key.full_key!r} step {ch.step} seq {ch.seq}"
                )
            arr = seg.ndarray(header)  # checks the file's size first
        except RendezvousError as e:
            self._unlink_quietly(seg)
            seg.close()
            ch.seq += 1
            return e
        ch.seq += 1
        held = (
            self._names.held(_canonical_task(ch.key.src), header.producer_incarnation, header.slot)
            if header.slot >= 0
            else None
        )
        if held is not None:
            try:
                # From here on the name says "a consumer holds it"; the memory goes back when
                # the array is collected (``_return_slot``).
                _move_noreplace(seg.path, Names.path(held))
            except OSError as e:
                _log.warning("cannot mark %s as held (%s); it will not return to its pool", name, e)
                held = None
        if held is None:
            self._unlink_quietly(seg)
        else:
            seg.name = held
            self._held.add(held)
            seg.on_release(
                _return_slot,
                self._names,
                _canonical_task(ch.key.src),
                header.producer_incarnation,
                header.slot,
                self._held,
            )
        seg.close()
        self._counters["received"] += 1
        self._counters["received_bytes"] += header.nbytes
        return Received(arr, header.is_dead)

    def _take_inline(self, ch: _Channel) -> Received | BaseException | None:
        """The channel's next message if it came through a ring (under the lock)."""
        src = _canonical_task(ch.key.src)
        owner = (src, ch.inc)
        try:
            if owner not in self._rings_in:
                # A producer without a ring (the default) must not cost every receive a
                # hash and a failing open(): look again at most every _RING_LOOK_S.
                now = time.monotonic()
                if now >= self._ring_look_at.get(owner, 0.0):
                    self._ring_look_at[owner] = now + _RING_LOOK_S
                    self._attach_ring(self._names.ring(src, ch.inc, self._task), owner)
            if self._rings_in:
                self._drain_rings()
        except RendezvousError as e:
            return e
        box = self._stash.get((ch.step, ch.key.full_key))
        if not box:
            return None
        got = box.pop((ch.inc, ch.seq), None)
        if got is None:
            return None
        if not box:
            del self._stash[(ch.step, ch.key.full_key)]
        ch.seq += 1
        self._counters["received"] += 1
        self._counters["received_bytes"] += got.value.nbytes
        return got

    def _attach_ring(self, name: str, expect: tuple[str, int] | None) -> None:
        """Map a producer's ring for this consumer and unlink its name (the mapping stays:
        the memory goes when both sides have unmapped it, whoever dies first)."""
        try:
            seg = Segment.attach(self._names, name)
        except FileNotFoundError:
            return
        try:
            ring = Ring(memoryview(seg.buf))
            meta = json.loads(ring.meta())
            owner = (str(meta["producer"]), int(meta["incarnation"]))
            if meta["consumer"] != self._task or (expect is not None and owner != expect):
                raise InternalError(f"ring {name} is {meta}, not for {self._task}")
        except (RendezvousError, ValueError, KeyError, TypeError) as e:
            seg.close()
            raise InternalError(f"refusing ring {name}: {e}") from e
        self._unlink_quietly(seg)
        self._rings_in[owner] = (seg, ring)

    def _drain_rings(self) -> None:
        """Copy every record waiting in the attached rings out, by (step, key)."""
        for (src, inc), (_seg, ring) in self._rings_in.items():
            if not ring.pending():
                continue
            for payload in ring.take():
                try:
                    header = layout.unpack(payload, len(payload))
                except RendezvousError as e:
                    _log.warning("dropping a corrupt record of the ring from %s: %s", src, e)
                    continue
                if self._w.is_cleaned_up(header.step_id):
                    continue  # a late send of a step this worker already cleaned up
                arr: npt.NDArray[Any] = np.empty(header.shape, header.dtype)
                if header.nbytes:
                    arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(
                        payload, np.uint8, header.nbytes, header.data_offset
                    )
                box = self._stash.setdefault((header.step_id, header.key), {})
                box[(inc, header.seq)] = Received(arr, header.is_dead)

    def _find_rings(self) -> None:
        """Attach the rings addressed to this worker that a listing shows (a producer that
        closed before we learned its incarnation); at most once per half tick."""
        now = time.monotonic()
        if now - self._rings_listed_at < _TICK / 2:
            return
        self._rings_listed_at = now
        marker = self._names.prefix + "q"
        try:
            entries = [e for e in os.listdir(Names.path("")) if e.startswith(marker)]
        except OSError:
            return
        for name in entries:
            try:
                self._attach_ring(name, None)
            except RendezvousError as e:
                _log.debug("%s", e)

    @staticmethod
    def _unlink_quietly(seg: Segment) -> None:
        try:
            seg.unlink()
        except RendezvousError as e:
            _log.warning("%s", e)

    def _deliver(self, items: list[tuple[DoneCallback, bool, Received | BaseException]]) -> None:
        """Call each ``done`` (outside every lock), emptying ``items``.

        Holds no reference to a delivered value afterwards: a mapped array the receiver
        drops (or that ``copy`` replaced) releases its segment at once.
        """
        items.reverse()
        while items:
            done, copy, result = items.pop()
            if isinstance(result, BaseException):
                done(result, None)
                continue
            if copy:
                # Rebinding drops the mapped original before the receiver wakes up.
                result = Received(np.array(result.value, copy=True), result.is_dead)
            done(None, result)
            del result

    # -- the dispatcher ---------------------------------------------------------------

    def recv_blocking(
        self, step_id: int, key: ParsedKey, timeout: float | None, copy: bool
    ) -> Received:
        """A blocking receive in which the calling thread waits on the doorbell itself.

        One thread at a time polls the doorbell (leader/follower): a receiver that finds
        no one polling spins on it briefly, then blocks on it, scans and delivers what
        arrived — to itself and to every other waiter — and hands the role on. The value
        thus reaches a lone receiver with one wake-up, not two (doorbell -> dispatcher
        thread -> receiver). Other receivers wait until delivered or the role is free.
        Raises ``DeadlineExceededError`` when ``timeout`` expires (the waiter removed).
        """
        box = RecvSlot()
        cancel = self.start_recv(step_id, key, box.done, copy, blocking=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        expired = False
        try:
            while not box.filled:
                wait = _TICK
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        if cancel():
                            expired = True
                            break
                        box.wait(None)  # lost the race to a delivery: it is on its way
                        break
                with self._lock:
                    if box.filled:
                        break
                    leader = not self._polling and not self._closed
                    if leader:
                        self._polling = True
                    else:
                        self._wake.wait(wait)
                if leader:
                    try:
                        self._poll(wait)
                    finally:
                        with self._lock:
                            self._polling = False
                            self._wake.notify_all()
        except BaseException:
            # Interrupted (Ctrl-C): remove the waiter so that it cannot take a later send.
            if not box.filled and not cancel():
                _log.warning("recv of %r interrupted as its value arrived; dropped", key.full_key)
            raise
        if expired:
            raise _timeout_error(key, timeout)
        if box.error is not None:
            raise box.error
        assert box.received is not None
        return box.received

    def _adapt_spin(self, waited_ns: int) -> None:
        """Spin about twice as long as doorbells have lately taken to ring, within bounds.

        Ping-pong traffic (a reply within a few hundred µs) is then caught spinning, with
        no sleep and wake-up at all; sparse traffic spins only ``_SPIN_MIN_NS``. The
        average is over the last ~8 waits that ended with a post.
        """
        avg = self._wait_avg_ns = (7 * self._wait_avg_ns + waited_ns) // 8
        self._spin_ns = (
            _SPIN_MIN_NS if avg > _SPIN_MAX_NS else min(2 * avg + _SPIN_MIN_NS, _SPIN_MAX_NS)
        )

    def _has_callback_waiters(self) -> bool:
        return any(not w.blocking for ch in self._waiting.values() for w in ch.waiters)

    def _run(self) -> None:
        """The dispatcher: polls the doorbell while callback receives are pending and no
        blocked receiver is polling it already."""
        while True:
            with self._wake:
                while not self._closed and (self._polling or not self._has_callback_waiters()):
                    self._wake.wait()
                if self._closed:
                    return
                self._polling = True
            try:
                self._poll(_TICK)
            finally:
                with self._lock:
                    self._polling = False
                    self._wake.notify_all()

    def _poll(self, wait: float) -> None:
        """Wait up to ``wait`` s for the doorbell (spinning first), then scan and deliver."""
        bell = self._bell
        rang = False
        start = time.perf_counter_ns()
        end = start + self._spin_ns
        while time.perf_counter_ns() < end:
            if bell.wait(0):
                rang = True
                break
        if not rang:
            rang = bell.wait(max(wait, 0.0))
        if rang:
            self._adapt_spin(time.perf_counter_ns() - start)
            bell.drain()
        with self._lock:
            if self._closed:
                return
            try:
                items = self._scan()
            except Exception:  # pragma: no cover - keep polling whatever happens
                _log.exception("shm dispatcher of %s: scan failed", self._task)
                items = []
        if items:
            self._deliver(items)
        # Drop the batch before waiting again: a received array kept alive here would
        # hold its pool slot (and its ``held`` name) until the next wake-up.
        del items

    def _scan(self) -> list[tuple[DoneCallback, bool, Received | BaseException]]:
        """Deliver every published message that has a waiter; fail waiters of dead producers."""
        self._counters["dispatcher_scans"] += 1
        out: list[tuple[DoneCallback, bool, Received | BaseException]] = []
        channels = list(self._waiting.values())
        present: set[str] | None = None
        if len(channels) > _LISTDIR_ABOVE:
            try:
                present = {
                    e for e in os.listdir(Names.path("")) if e.startswith(self._names.prefix)
                }
            except OSError:
                present = None
        for ch in channels:
            while ch.waiters:
                if present is not None and self._resolve_incarnation(ch):
                    # The listing says whether a segment is there; the ring, whether an
                    # inline message is (its stash is a dict lookup).
                    result = self._take_inline(ch)
                    if result is None and ch.name(self._names) in present:
                        result = self._try_take(ch)
                else:
                    result = self._try_take(ch)
                if result is None:
                    break
                waiter = ch.waiters.popleft()
                waiter.channel = None
                out.append((waiter.done, waiter.copy, result))
            if ch.waiters:
                failure = self._producer_failure(ch)
                if failure is not None:
                    # What the producer published before it died is visible now: deliver it.
                    while ch.waiters:
                        result = self._try_take(ch)
                        if result is None:
                            break
                        waiter = ch.waiters.popleft()
                        waiter.channel = None
                        out.append((waiter.done, waiter.copy, result))
                    while ch.waiters:
                        waiter = ch.waiters.popleft()
                        waiter.channel = None
                        out.append((waiter.done, waiter.copy, failure))
            if not ch.waiters:
                self._waiting.pop((ch.step, ch.key.full_key), None)
        return out

    def _recently_alive(self, ch: _Channel) -> bool:
        """Whether the channel's producer was seen alive, with a fitting incarnation, less than
        a tick ago (then ``seen_alive`` is set without a look at its record: a fresh key per
        step must not cost a stat and a flock each)."""
        seen = self._alive_at.get(ch.key.src.task_key())
        if seen is None or time.monotonic() - seen[1] > _TICK:
            return False
        inc = seen[0]
        if ch.key.src_incarnation not in (0, inc) or ch.inc not in (0, inc):
            return False
        ch.seen_alive = True
        return True

    def _producer_failure(self, ch: _Channel) -> BaseException | None:
        """Why the channel's producer can no longer send, or None while it may."""
        watch = self._w.peer_watch(ch.key.src)
        src = _canonical_task(ch.key.src)
        try:
            state = watch.state()
            info = watch.info()
        except RendezvousError as e:
            return UnavailableError(
                f"producer {src} of key {ch.key.full_key!r} cannot be trusted: {e}"
            )
        if state == "alive" and info is not None:
            if ch.key.src_incarnation and info.incarnation != ch.key.src_incarnation:
                return AbortedError(
                    "RecvTensor expects a different device incarnation: "
                    f"{ch.key.src_incarnation:016x} vs. {info.incarnation:016x}. "
                    f'Your worker job ("{src}") was probably restarted (now pid {info.pid}); '
                    f"key {ch.key.full_key!r}"
                )
            if not ch.key.src_incarnation and ch.inc and info.incarnation != ch.inc:
                # Restarted producer and a key that does not pin an incarnation: follow the
                # new run from its first message.
                ch.inc, ch.seq = info.incarnation, 0
                return None
            ch.seen_alive = True
            self._alive_at[ch.key.src.task_key()] = (info.incarnation, time.monotonic())
            return None
        if ch.seen_alive:
            how = "exited" if state == "absent" else "died"
            pid = f" (pid {info.pid})" if info is not None else ""
            return UnavailableError(
                f"producer {src}{pid} {how} while key {ch.key.full_key!r} was awaited "
                f"in step {ch.step}"
            )
        return None

    # -- steps and lifetime -------------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        with self._lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            items: list[tuple[DoneCallback, bool, Received | BaseException]] = []
            for k, ch in list(self._waiting.items()):
                if ch.step != step_id:
                    continue
                while ch.waiters:
                    waiter = ch.waiters.popleft()
                    waiter.channel = None
                    items.append((waiter.done, waiter.copy, error))
                del self._waiting[k]
        self._deliver(items)
        with self._lock:
            self._wake.notify_all()  # blocked receivers waiting for the poller role

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; free the unreceived messages addressed to this worker in it."""
        with self._lock:
            for k in [k for k in self._channels if k[0] == step_id]:
                del self._channels[k]
            for k in [k for k in self._send_seq if k[0] == step_id]:
                del self._send_seq[k]
            self._aborted.pop(step_id, None)
            try:
                self._drain_rings()
            except RendezvousError as e:
                _log.warning("%s", e)
            for k in [k for k in self._stash if k[0] == step_id]:
                del self._stash[k]
        self._free_unreceived(step_id)

    def _free_unreceived(self, step_id: int | None) -> int:
        """Free the messages of ``step_id`` (every step: None) addressed to this worker."""
        freed = 0
        try:
            entries = os.listdir(Names.path(""))
        except OSError:
            return 0
        marker = self._names.prefix + "m"
        for entry in entries:
            if not entry.startswith(marker) or parse_name(entry) is None:
                continue
            path = Names.path(entry)
            header = peek_header(path)
            if header is None or (step_id is not None and header.step_id != step_id):
                continue
            src, dst = _parse_ends(header.key)
            if dst is None or not self._w._is_own_task(dst):
                continue
            if header.slot >= 0 and src is not None:
                # A pool slot: hand it back to its producer rather than drop it.
                _give_back(
                    self._names,
                    _canonical_task(src),
                    header.producer_incarnation,
                    header.slot,
                    path,
                )
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    _log.warning("cannot free unreceived message %s: %s", path, e)
                    continue
            freed += 1
        return freed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            items: list[tuple[DoneCallback, bool, Received | BaseException]] = []
            error = AbortedError(f"Worker {self._task} closed")
            for ch in self._waiting.values():
                while ch.waiters:
                    waiter = ch.waiters.popleft()
                    waiter.channel = None
                    items.append((waiter.done, waiter.copy, error))
            self._waiting.clear()
            self._wake.notify_all()
        self._bell.ring()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._deliver(items)
        # The doorbell goes before the pool's last sweep: consumers giving a slot back look
        # for it to know that this producer will still take the slot (``_give_back``).
        self._bell.unlink()
        self._pool.close()
        self._unlink_held()
        self._close_rings()
        self._bell.close()
        for b in self._peer_bells.values():
            b.close()
        self._peer_bells.clear()

    def _close_rings(self) -> None:
        """Unmap the rings. A ring of ours that its consumer never attached keeps its name
        while it holds messages (they are the consumer's); an empty one goes."""
        with self._publish_lock:
            for entry in self._rings_out.values():
                if entry is not None:
                    seg, ring = entry
                    if not ring.pending():
                        self._unlink_quietly(seg)
                    ring.release()
                    seg.close()
            self._rings_out.clear()
        with self._lock:
            for seg, ring in self._rings_in.values():
                ring.release()
                seg.close()
            self._rings_in.clear()
            self._stash.clear()

    def _unlink_held(self) -> None:
        """Unlink the ``held`` names of arrays this consumer still has (their mappings stay).

        Without this they would outlive the process: the finalizers that give them back do
        not run at exit. Their producers see the slots gone and forget them (``pool``).
        """
        while True:
            try:
                held = list(self._held)  # a finalizer may discard meanwhile
                break
            except RuntimeError:  # pragma: no cover - changed size during the copy
                continue
        for name in held:
            self._held.discard(name)
            try:
                os.unlink(Names.path(name))
            except FileNotFoundError:
                pass
            except OSError as e:
                _log.warning("cannot unlink held pool slot %s: %s", name, e)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["pending_keys"] = len(self._waiting)
            out["pending_receives"] = sum(len(ch.waiters) for ch in self._waiting.values())
            out["channels"] = len(self._channels)
            out["allocations"] = len(self._allocations)
            out["rings"] = len(self._rings_in) + sum(1 for e in self._rings_out.values() if e)
            out["held"] = len(self._held)
        # One fd per producer whose liveness we test (cached, closed when it restarts).
        out["liveness_fds"] = sum(1 for k in list(_records) if k[0] == self._names.namespace)
        out.update(self._pool.stats())
        return out


def _already_done() -> bool:
    return False


def _canonical_task(dev: DeviceName) -> str:
    job, replica, task = dev.task_key()
    return f"/job:{job}/replica:{replica}/task:{task}"


def _parse_ends(full_key: str) -> tuple[DeviceName | None, DeviceName | None]:
    from .._keys import parse_key

    try:
        pk = parse_key(full_key)
    except RendezvousError:
        return None, None
    return pk.src, pk.dst
