"""The sending half of the same-host transport: a message's number, bytes and name.

A small value is a record in its consumer's ring (``Route``). A larger one is copied into
a pool slot or fresh segment (or was written there through ``allocate``) and published by
one no-replace rename to the message's name, so no half-written tensor is ever seen; a
notice goes in the ring. With ``max_inflight_bytes`` a send first reserves room in its
consumer's window (``Flight``).

Thread model (``docs/threads.md``): any thread may send or allocate; ``_lock`` is never held
across a call that can block; the copy helpers ("shmrdv-copy-<n>") copy under no lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._cluster import canonical_task
from .._errors import InternalError, InvalidArgumentError, RendezvousError, closed_error
from .._keys import DeviceName, ParsedKey
from .._values import shape_problem
from .._window import ConsumerWatch, InflightWindow, Windows, counted_bytes
from .bell import Bell
from .files import Segment, inode, move_noreplace
from .header import FLAG_DEAD, FLAG_NOTICE, Template
from .naming import Names
from .pool import ProducerAlive, Slot, SlotPool
from .ring import RINGS_SUPPORTED, Ring, ring_size

if TYPE_CHECKING:
    import posix_ipc

    from .._transport import PeerDirectory

__all__ = ["PARALLEL_MIN", "Flight", "Inflight", "Producer", "Ticket", "copy_into", "helpers"]

_log = logging.getLogger("shmrdv.shm")

# Values of at most this many bytes (``SHMRDV_INLINE_MAX``, default and maximum; 0: none)
# travel inline: a segment's dozen system calls cost far more than their bytes.
RING_LIMIT = 64 << 10
RING_CAPACITY = 1 << 20  # the bytes of records a ring holds
PARALLEL_MIN = 4 << 20  # below it a copy is one np.copyto: a thread handoff costs more
_CHUNK = 1 << 20  # page-aligned, small enough that a late helper costs little
_MAX_HELPERS = 3
_BELL_LOOK_S = 0.02  # how often to look again for the doorbell of a consumer not started
_TEMPLATES_MAX = 1024  # header templates kept (emptied when full)
LSTATS_PER_REFRESH = 32  # published names one ``Flight.refresh`` looks at, at most
_NO_READER = memoryview(bytes(8)).cast("Q")  # the reader word of a route without a ring


def inline_max() -> int:
    """The inline limit in bytes from ``SHMRDV_INLINE_MAX`` (default and maximum 64 KiB)."""
    try:
        return max(0, min(int(os.environ.get("SHMRDV_INLINE_MAX", RING_LIMIT)), RING_LIMIT))
    except ValueError:
        return RING_LIMIT


@dataclass(eq=False, slots=True)
class Route:
    """What a producer keeps per consumer worker, under its lock: the ring, the doorbell
    (opened on first use: the consumer may not have started) and what was sent.
    ``bell_reader``: the ring's reader word when the doorbell was opened."""

    task: str
    seg: Segment | None = None
    ring: Ring | None = None
    bell: Bell | None = None
    sem: posix_ipc.Semaphore | None = None  # ``bell.semaphore`` while it is set
    bell_at: float = 0.0  # when to look for the doorbell again
    fd: int = -1  # the ring file's descriptor and size, checked before each write
    size: int = 0
    sent: int = 0
    sent_bytes: int = 0
    reader: memoryview = _NO_READER
    bell_reader: int = 0

    def open_ring(self, names: Names, producer: str, incarnation: int) -> None:
        """Make the ring, published once formatted; none if it cannot be (segments only)."""
        seg = None
        name = names.ring(producer, incarnation, self.task)
        try:
            seg = Segment.create(names, ring_size(RING_CAPACITY), keep_fd=True)
            meta = {"producer": producer, "incarnation": incarnation, "consumer": self.task}
            ring = Ring.format(memoryview(seg.buf), RING_CAPACITY, json.dumps(meta).encode())
            move_noreplace(seg.path, Names.path(name))
        except (OSError, RendezvousError) as e:
            _log.warning("no ring to %s (%s); segments only, found by name", self.task, e)
            if seg is not None:
                seg.unlink_quietly()
                seg.close()
            return
        seg.name = name
        self.seg, self.ring, self.fd, self.size = seg, ring, seg.fd, seg.size
        self.reader = ring.reader_word()

    def ring_intact(self) -> Ring | None:
        """The ring, if its file still holds it (one ``lseek``: a process of this user may
        have truncated it, and writing a lost page is a SIGBUS), a new reader followed."""
        try:
            if os.lseek(self.fd, 0, os.SEEK_END) >= self.size:
                if self.reader[0] != self.bell_reader:  # a restarted consumer: its own doorbell
                    bell, self.bell, self.sem, self.bell_at = self.bell, None, None, 0.0
                    self.bell_reader = int(self.reader[0])
                    if bell is not None:
                        bell.close()  # the next post looks the new one up
                return self.ring
        except OSError:
            pass
        if self.ring is not None:
            _log.warning("the ring to %s was truncated; segments from now on", self.task)
            self.close_ring(lost=True)
        return None

    def doorbell(self, names: Names) -> posix_ipc.Semaphore | None:
        """The consumer's doorbell semaphore, opened on first use; None while there is none."""
        now = time.monotonic()
        if now < self.bell_at:
            return None
        self.bell_at = now + _BELL_LOOK_S
        self.bell_reader = int(self.reader[0])  # read first: a later reader is followed
        try:
            bell = Bell.open(names, self.task)
        except RendezvousError:
            _log.warning("doorbell of %s refused (not ours); relying on its tick", self.task)
            self.bell_at = now + 3600.0
            return None
        if bell is not None:
            self.bell, self.sem = bell, bell.semaphore
        return self.sem

    def close_ring(self, lost: bool = False) -> None:
        """Unmap the ring. Unless ``lost``, its name stays while it holds records not taken:
        the consumer task's (this process's, or its next one's after a crash)."""
        seg, ring = self.seg, self.ring
        self.seg = self.ring = None
        self.fd = -1
        word, self.reader = self.reader, _NO_READER
        if word is not _NO_READER:
            word.release()
        if seg is not None and ring is not None:
            with contextlib.suppress(InternalError):
                seg.check_size(seg.size)  # a truncated ring's words may be gone
                lost = lost or not ring.pending()
            if lost:
                seg.unlink_quietly()
            ring.release()
            seg.close()

    def close(self) -> None:
        self.close_ring()
        bell, self.bell, self.sem = self.bell, None, None
        if bell is not None:
            bell.close()


class Flight:
    """One consumer's messages in flight, for its window: a segment while its own file (by
    inode) is at its name; a ring record until ``tail`` passes it; none once the consumer
    died. Only a reservation that does not fit looks. No filesystem call under the lock."""

    __slots__ = ("_closed", "_lock", "_records", "_ring", "_segments", "_watch", "window")

    def __init__(self, window: InflightWindow, watch: ConsumerWatch) -> None:
        self.window = window
        self._watch = watch
        self._lock = threading.Lock()
        self._segments: deque[tuple[str, tuple[int, int], int]] = deque()  # name, inode, bytes
        self._records: deque[tuple[int, int]] = deque()  # end in the ring, bytes
        self._ring: Ring | None = None
        self._closed: BaseException | None = None

    def reserve(self, nbytes: int, timeout: float | None, what: str) -> Ticket:
        """Reserve ``nbytes`` (blocks while the window is full, up to ``timeout``). Raises
        ``ResourceExhaustedError`` then, or the closing error once the producer closed."""
        self.window.reserve(nbytes, timeout, self.refresh, what)
        if self._closed is not None:
            self.window.release(nbytes)
            raise self._closed
        return Ticket(self, nbytes)

    def refresh(self) -> None:
        """Give back what the consumer took (everything, if it died): up to ``tail``, then
        at most ``LSTATS_PER_REFRESH`` names, oldest first, round robin."""
        if self._watch.died():
            self.forget()
            return
        freed = 0
        with self._lock:
            if self._records and self._ring is not None:
                tail, records = self._ring.tail, self._records
                while records and records[0][0] <= tail:
                    freed += records.popleft()[1]
            n = min(len(self._segments), LSTATS_PER_REFRESH)
            looking = [self._segments.popleft() for _ in range(n)]
        still = []
        for item in looking:
            if inode(Names.path(item[0]), ours=True) == item[1]:
                still.append(item)
            else:
                freed += item[2]  # taken (renamed or unlinked): maybe another file is there now
        with self._lock:
            self._segments.extend(still)  # to the back: the next refresh looks at others
        if freed:
            self.window.release(freed)

    def forget(self) -> None:
        """The consumer died (or this producer closes): nothing counts any more."""
        with self._lock:
            self._segments.clear()
            self._records.clear()
            self._ring = None
        self.window.reset()


class Ticket:
    """One reservation: published (a segment or a ring record) or cancelled, once."""

    __slots__ = ("_flight", "_open", "nbytes")

    def __init__(self, flight: Flight, nbytes: int) -> None:
        self._flight = flight
        self.nbytes = nbytes
        self._open = True

    def segment(self, name: str) -> None:
        """Published as segment ``name``: in flight while its file is at that name."""
        if not self._open:
            return
        self._open = False
        ino = inode(Names.path(name), ours=True)
        if ino is None:  # taken already (or never ours)
            self._flight.window.release(self.nbytes)
            return
        with self._flight._lock:
            self._flight._segments.append((name, ino, self.nbytes))

    def record(self, ring: Ring, end: int) -> None:
        """Appended to ``ring``, ending at ``end``: in flight until ``tail`` passes it."""
        if self._open:
            self._open = False
            with self._flight._lock:
                self._flight._ring = ring
                self._flight._records.append((end, self.nbytes))

    def cancel(self) -> None:
        """Nothing of the message was published: give its bytes back."""
        if self._open:
            self._open = False
            self._flight.window.release(self.nbytes)


class Inflight:
    """A producer's flights, one per consumer task, all under one ``max_inflight_bytes``."""

    def __init__(self, limit: int, peers: PeerDirectory) -> None:
        self.windows = Windows(limit)
        self._peers = peers
        self._flights: dict[InflightWindow, Flight] = {}
        self._lock = threading.Lock()
        self._closed: BaseException | None = None

    def for_key(self, key: ParsedKey) -> Flight:
        """The flight to ``key``'s consumer (dict look-ups once known: the send path)."""
        return self._flights.get(self.windows.for_key(key)) or self.of(key.dst)

    def of(self, consumer: DeviceName) -> Flight:
        """The flight to the task of device ``consumer`` (made on first use)."""
        window = self.windows.of(consumer)
        flight = self._flights.get(window)
        if flight is None:
            watch = ConsumerWatch(self._peers, consumer)  # looks once: outside the lock
            with self._lock:
                flight = self._flights.setdefault(window, Flight(window, watch))
                flight._closed = self._closed
        return flight

    def close(self, error: BaseException) -> None:
        """Forget every flight; a reservation waiting or made from now on raises ``error``."""
        with self._lock:
            self._closed = error
            flights = list(self._flights.values())
        for f in flights:
            f._closed = error
            f.forget()


@dataclass(eq=False)
class _Allocation:
    """An array ``allocate`` handed out: where it lives and what it may be sent as."""

    ref: weakref.ref[npt.NDArray[Any]]
    step: int
    key: str
    segment: Segment | None  # None: a small array, sent inline
    slot: Slot | None
    sent: bool = False


class Producer:
    """The sending half of one worker's shared-memory transport (see the module docstring)."""

    def __init__(
        self,
        names: Names,
        task: str,
        incarnation: int,
        pool_bytes: int,
        inflight: Inflight | None,
        holder_alive: ProducerAlive,
    ) -> None:
        self._names = names
        self._task = task
        self._inc = incarnation
        self._pid = os.getpid()
        self._inflight = inflight
        self._inline_max = inline_max() if RINGS_SUPPORTED else -1
        self._lock = threading.Lock()
        self._seqs: defaultdict[int, dict[str, int]] = defaultdict(dict)  # step, key: next seq
        self._templates: dict[tuple[Any, tuple[int, ...], int], Template] = {}
        self._routes: dict[str, Route] = {}  # by a key's dst device, as written
        self._by_task: dict[str, Route] = {}  # the same routes, by consumer task
        self._allocations: dict[int, _Allocation] = {}
        self._pool = SlotPool(names, task, incarnation, pool_bytes, holder_alive)
        self._closed = False
        self.zero_copy = self.ring_full = 0

    def _route(self, key: ParsedKey) -> Route:
        task = str(canonical_task(key.dst))
        with self._lock:
            route = self._by_task.get(task)
            if route is None:
                route = self._by_task[task] = Route(task)
                if RINGS_SUPPORTED:
                    route.open_ring(self._names, self._task, self._inc)
            self._routes[key.dst_device] = route
        return route

    def _template(self, dtype: Any, shape: tuple[int, ...], key_len: int) -> Template:
        t = self._templates.get((dtype, shape, key_len))
        if t is None:
            if len(self._templates) >= _TEMPLATES_MAX:
                self._templates.clear()
            t = self._templates[(dtype, shape, key_len)] = Template(dtype, shape, key_len)
        return t

    def _segment(self, size: int) -> tuple[Slot | None, Segment]:
        slot = self._pool.acquire(size)
        if slot is not None:
            return slot, slot.segment
        return None, Segment.create(self._names, size)

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """An array to ``send`` as (step, key) without a copy: in a segment (a pool slot if
        one fits), or plain memory for a value sent inline. Raises ``InvalidArgumentError``
        for a bad shape or dtype, ``ResourceExhaustedError`` when /dev/shm has no room."""
        try:
            dt = np.dtype(dtype)
            shp = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
            problem = shape_problem(shp, dt.itemsize)
        except (TypeError, ValueError) as e:
            problem = f"bad shape {shape!r} or dtype {dtype!r}: {e}"
        if problem is None and dt.hasobject:
            problem = f"dtype {dt} holds Python objects, which cannot be shared"
        if problem is not None:
            raise InvalidArgumentError(f"allocate({key.full_key!r}): {problem}")
        t = self._template(dt, shp, len(key.full_key.encode()))
        seg: Segment | None = None
        slot: Slot | None = None
        if 0 < t.nbytes <= self._inline_max:
            arr: npt.NDArray[Any] = np.empty(shp, dt)  # sent inline: plain memory serves
        else:
            slot, seg = self._segment(t.segment_size)
            # (A pool slot's size was checked by its acquire a moment ago.)
            arr = seg.view(dt, t.shape, t.data_offset, t.nbytes, checked=slot is not None)
        alloc = _Allocation(weakref.ref(arr), step_id, key.full_key, seg, slot)
        with self._lock:
            self._allocations[id(arr)] = alloc
        weakref.finalize(arr, self._allocation_dropped, id(arr), alloc)
        return arr

    def _allocation_dropped(self, ident: int, alloc: _Allocation) -> None:
        with self._lock:
            if self._allocations.get(ident) is alloc:
                del self._allocations[ident]
        if alloc.slot is not None:
            if alloc.sent:  # nothing of ours reads it any more: it may carry the next message
                self._pool.unpin(alloc.slot)
            else:
                self._pool.release(alloc.slot)
        elif alloc.segment is not None and not alloc.sent:
            alloc.segment.unlink()
            alloc.segment.close()

    def _allocated(
        self, step_id: int, key: ParsedKey, value: npt.NDArray[Any]
    ) -> _Allocation | None:
        """The allocation ``value`` is, if any, now marked sent (``InvalidArgumentError`` if
        sent already, or under another key or step)."""
        alloc = self._allocations.get(id(value))
        if alloc is None or alloc.ref() is not value:
            return None
        with self._lock:
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
            alloc.sent = True
        return alloc

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None = None,
    ) -> None:
        """Publish ``value`` as the next message of (step, key): inline when small and it
        fits, else in a segment (an ``allocate`` array's own: no copy). Blocks only for a
        full ``max_inflight_bytes`` window. Raises ``ResourceExhaustedError`` for a full
        window or /dev/shm, ``InternalError`` if the message's name is taken."""
        if self._closed:
            raise closed_error(self._task)
        route = self._routes.get(key.dst_device) or self._route(key)
        ticket = None
        if self._inflight is not None:
            flight = self._inflight.for_key(key)
            ticket = flight.reserve(counted_bytes(value.nbytes), timeout, key.full_key)
        alloc = None
        try:
            if self._allocations:
                alloc = self._allocated(step_id, key, value)
            fk = key.full_key
            raw = fk.encode()
            t = self._templates.get((value.dtype, value.shape, len(raw))) or self._template(
                value.dtype, value.shape, len(raw)
            )
            flags = FLAG_DEAD if is_dead else 0
            if not (
                (alloc is None or alloc.segment is None)
                and t.nbytes <= self._inline_max
                and self._append(step_id, fk, raw, t, value.tobytes(), flags, route, ticket)
            ):
                self._send_segment(step_id, fk, raw, t, value, alloc, flags, route, ticket)
        except BaseException:
            if alloc is not None:
                alloc.sent = False
            raise
        finally:
            if ticket is not None:
                ticket.cancel()  # a no-op once published
        if alloc is not None:
            value.flags.writeable = False  # the consumer's memory from now on

    def _send_segment(
        self,
        step_id: int,
        fk: str,
        raw: bytes,
        t: Template,
        value: npt.NDArray[Any],
        alloc: _Allocation | None,
        flags: int,
        route: Route,
        ticket: Ticket | None,
    ) -> None:
        """Publish the message in the allocation's segment, else in a pool slot or a fresh
        segment the value is copied into."""
        seg, slot = (alloc.segment, alloc.slot) if alloc is not None else (None, None)
        pinned = seg is not None  # the producer's array is over it
        if seg is None:
            slot, seg = self._segment(t.segment_size)
            try:
                if t.nbytes:
                    copy_into(np.ndarray(value.shape, value.dtype, seg.buf, t.data_offset), value)
                name = self._publish(step_id, fk, raw, t, seg, slot, flags, route)
            except BaseException:
                if slot is not None:
                    self._pool.release(slot)
                else:
                    seg.unlink_quietly()
                    seg.close()
                raise
        else:
            name = self._publish(step_id, fk, raw, t, seg, slot, flags, route)
            self.zero_copy += 1
        if ticket is not None:
            ticket.segment(name)
        if slot is not None:
            # A pinned slot carries no other message while the producer's array (or a view
            # of it) can still be read.
            self._pool.lend(slot, name, route.task, pinned=pinned)
        else:
            seg.close()
        self._post(route)

    def _append(
        self,
        step_id: int,
        fk: str,
        raw: bytes,
        t: Template,
        data: bytes,
        flags: int,
        route: Route,
        ticket: Ticket | None,
    ) -> bool:
        """Append the message, header and data, to the consumer's ring and post its
        doorbell; False (nothing written) if it has no ring or no room."""
        with self._lock:
            ring = route.ring_intact()
            if ring is None:
                return False
            at = ring.reserve(t.data_offset + t.nbytes)
            if at < 0:
                self.ring_full += 1
                return False  # full: this one goes through a segment, in sequence
            seqs = self._seqs[step_id]
            seq = seqs.get(fk, 0)
            t.write(ring.buf, at, raw, flags, step_id, seq, self._inc, self._pid, -1,
                    time.time_ns(), data)  # fmt: skip
            end = ring.commit()
            seqs[fk] = seq + 1
            route.sent += 1
            route.sent_bytes += t.nbytes
        if ticket is not None:
            ticket.record(ring, end)
        self._post(route)
        return True

    def _publish(
        self,
        step_id: int,
        fk: str,
        raw: bytes,
        t: Template,
        seg: Segment,
        slot: Slot | None,
        flags: int,
        route: Route,
    ) -> str:
        """Give the message its sequence number, header and name, atomically, and a notice
        in the ring (else ``Ring.lost``); returns the name. ``InternalError`` if the name is
        taken: that file is left alone, its sequence number skipped."""
        ticket = -1 if slot is None else slot.ticket
        with self._lock:
            seqs = self._seqs[step_id]
            seq = seqs.get(fk, 0)
            now = time.time_ns()
            t.write(seg.buf, 0, raw, flags, step_id, seq, self._inc, self._pid, ticket, now)
            name = self._names.message(step_id, fk, self._inc, seq)
            seqs[fk] = seq + 1
            try:
                move_noreplace(seg.path, Names.path(name))
            except FileExistsError as e:
                raise InternalError(
                    f"cannot publish key {fk!r} (step {step_id}, message {seq}): "
                    f"{name} exists already: planted by another process, or an unreceived "
                    "message of an earlier run with this incarnation; it was left untouched"
                ) from e
            except OSError as e:
                raise InternalError(f"cannot publish key {fk!r} as {name}: {e}") from e
            seg.name = name
            route.sent += 1
            route.sent_bytes += t.nbytes
            ring = route.ring_intact()
            if ring is not None:
                at = ring.reserve(t.data_offset)
                if at < 0:
                    self.ring_full += 1
                    ring.count_lost()
                else:
                    t.write(ring.buf, at, raw, flags | FLAG_NOTICE, step_id, seq, self._inc,
                            self._pid, ticket, now)  # fmt: skip
                    ring.commit()
        return name

    def _post(self, route: Route) -> None:
        """Post the doorbell unless a post is pending: whoever takes that one reads the rings
        after it, or leaves them to the next receive (this record's ``head`` store came
        first; the lock's release lies between). A saturated or closed semaphore is left: the consumer's tick finds it."""
        sem = route.sem
        if sem is None:
            with self._lock:
                sem = route.doorbell(self._names)
            if sem is None:
                return
        try:
            if not sem.value:
                sem.release()
        except Exception as e:  # closed by another thread, or saturated
            _log.debug("doorbell of %s not posted: %s", route.task, e)

    def cleanup_step(self, step_id: int) -> None:
        # One dict pop, atomic: a send of the step racing with it numbers a dict no one
        # reads again (what it publishes is freed: the step is cleaned up).
        self._seqs.pop(step_id, None)

    def close(self) -> None:
        """Forget what is in flight, sweep the pool, unmap the rings, close the doorbells.
        The caller unlinked this worker's own doorbell first (``return_slot`` relies on it)."""
        self._closed = True
        if self._inflight is not None:
            self._inflight.close(closed_error(self._task))  # before the rings are unmapped
        self._pool.close()
        with self._lock:
            routes = list(self._by_task.values())
            self._routes.clear()
        for route in routes:
            route.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            routes = list(self._by_task.values())
            out = {
                "sent": sum(r.sent for r in routes),
                "sent_bytes": sum(r.sent_bytes for r in routes),
                "sent_zero_copy": self.zero_copy,
                "ring_full": self.ring_full,
                "allocations": len(self._allocations),
                "rings_out": sum(1 for r in routes if r.ring is not None),
            }
        out.update(self._pool.stats())
        if self._inflight is not None:
            out["inflight_bytes"] = self._inflight.windows.used()
            out["window_waits"] = self._inflight.windows.waits()
        return out


_EMPTY: npt.NDArray[Any] = np.empty(0, np.uint8)
# The CPUs this thread may use (0 while the load average says they are taken), and when
# they were read: at most once a second.
_cpus: list[float] = [0.0, 0.0]


def helpers() -> int:
    """Helper threads a large copy uses besides the caller: one less than the CPUs this
    thread may use, at most 3, none while the load average says those are taken
    (``SHMRDV_COPY_THREADS=n``: ``n - 1``, whatever the load)."""
    now = time.monotonic()
    if now - _cpus[1] >= 1.0:
        try:
            cpus = len(os.sched_getaffinity(0))
            busy = os.getloadavg()[0] >= cpus
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cpus, busy = os.cpu_count() or 1, False
        _cpus[:] = [0.0 if busy else float(cpus), now]
    try:
        wanted = int(os.environ.get("SHMRDV_COPY_THREADS", ""))
    except ValueError:  # unset, or not a number: the CPUs decide
        wanted = int(_cpus[0])
    return max(0, min(wanted - 1, _MAX_HELPERS))


class _Job:
    """Chunks handed out one at a time: a helper that wakes late only copies less."""

    def __init__(self, dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
        self.dst, self.src = dst, src
        self.starts = iter(range(0, src.nbytes, _CHUNK))
        self.busy = 0
        self.error: BaseException | None = None
        self.idle = threading.Condition()

    def work(self) -> None:
        """Copy chunks until none is left."""
        while self.error is None:
            with self.idle:
                at = next(self.starts, None)
                if at is None:
                    return
                self.busy += 1
            try:
                part = slice(at, at + _CHUNK)
                np.copyto(self.dst[part], self.src[part], casting="no")
            except BaseException as e:  # pragma: no cover - same dtype, contiguous
                self.error = e
            finally:
                with self.idle:
                    self.busy -= 1
                    self.idle.notify_all()

    def finish(self) -> None:
        """Hand out no more chunks; wait until no helper copies one (a segment's mapping
        cannot close under a view), then drop the buffers."""
        with self.idle:
            self.starts = iter(())
            self.idle.wait_for(lambda: not self.busy)
            self.dst = self.src = _EMPTY


# The helper threads' queue and count, shared by every Worker of this process.
_jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_started = [0]
_start_lock = threading.Lock()


def _forked() -> None:  # the threads stayed with the parent
    global _jobs, _start_lock
    _jobs, _start_lock, _started[0] = queue.SimpleQueue(), threading.Lock(), 0


os.register_at_fork(after_in_child=_forked)


def _helper(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        jobs.get().work()  # a finished job hands out nothing: returns at once


def copy_into(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """``np.copyto(dst, src, casting="no")``, split across threads when it is large (same
    shape and dtype; ``dst`` C-contiguous). Returns once every byte is copied, also when
    interrupted (no helper writes ``dst`` after)."""
    nbytes = src.nbytes
    n = helpers() if nbytes >= PARALLEL_MIN and src.flags.c_contiguous else 0
    if n == 0:
        np.copyto(dst, src, casting="no")
        return
    job = _Job(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))
    with _start_lock:
        while _started[0] < n:
            threading.Thread(
                target=_helper, args=(_jobs,), name=f"shmrdv-copy-{_started[0]}", daemon=True
            ).start()
            _started[0] += 1
        jobs = _jobs
    for _ in range(n):
        jobs.put(job)
    try:
        job.work()
    finally:
        job.finish()
    if job.error is not None:  # pragma: no cover - see _Job.work
        raise job.error
