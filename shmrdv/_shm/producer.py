"""The sending half of the same-host transport: a message's number, bytes and name.

Per consumer worker the producer keeps a ``Route`` (derived once per pair of tasks): the
ring it appends that consumer's records to (``ring.py``) and the consumer's doorbell. A
small value travels inline, as a ring record; a larger one is copied into a warm pool slot
(``pool.py``; else a fresh fallocated segment) or was written there by its producer
(``allocate``), given its header, and published with one rename (no replace) to the
message's name, derived from (namespace, step, key, producer incarnation, sequence number):
the consumer never sees a half-written tensor, also if the producer dies mid-write (only a
``t`` name is left, for ``gc``). A notice of it goes in the ring, so the consumer goes
straight to that name. Then the consumer's doorbell is posted, unless a post is pending
already: whoever takes that one drains every ring after it.

A large copy is split into chunks that the sending thread and a few helper threads take
one at a time (numpy releases the GIL while it copies): one thread leaves memory bandwidth
unused. Helpers run only where CPUs are free: at most one less than the CPUs this thread
may use (3 at most), none while the host's load says they are taken.

Thread model (``docs/threads.md``): any thread may call ``send`` / ``allocate``. ``_lock``
serialises the sequence numbers and the rings (one writer per ring) and guards the
allocations and the routes' doorbells; it is never held across a call that can block.
Helpers ("shmrdv-copy-<n>") wait on a queue; no lock is held while copying.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._cluster import canonical_task
from .._errors import InternalError, InvalidArgumentError, RendezvousError, closed_error
from .._keys import ParsedKey
from .._window import counted_bytes
from .bell import Bell
from .files import Segment, move_noreplace
from .header import FLAG_DEAD, FLAG_NOTICE, Template
from .inflight import Inflight, Ticket
from .naming import Names
from .pool import ProducerAlive, Slot, SlotPool
from .ring import RINGS_SUPPORTED, Ring, ring_size

if TYPE_CHECKING:
    import posix_ipc

__all__ = ["PARALLEL_MIN", "RING_LIMIT", "Producer", "copy_into", "helpers", "inline_max"]

_log = logging.getLogger("shmrdv.shm")

#: Values of at most this many bytes (``SHMRDV_INLINE_MAX``, default and maximum 64 KiB; 0
#: turns it off) travel inline in the ring: for them the dozen system calls of a segment
#: cost far more than copying the bytes.
RING_LIMIT = 64 << 10
#: The bytes of records a ring holds (``ring_size`` adds its words).
RING_CAPACITY = 1 << 20
#: Below this many bytes a copy is one ``np.copyto``: a thread handoff costs more.
PARALLEL_MIN = 4 << 20
_CHUNK = 1 << 20  # a copy's chunk: page-aligned, small enough that a late helper costs little
_MAX_HELPERS = 3
# How often a producer looks again for the doorbell of a consumer that has not started.
_BELL_LOOK_S = 0.02
# Header templates kept: one per (dtype, shape, key length); emptied when full.
_TEMPLATES_MAX = 1024
# ``Route.reader`` of a route without a ring: no reader ever changes it.
_NO_READER = memoryview(bytes(8)).cast("Q")


def inline_max() -> int:
    """The inline limit in bytes from ``SHMRDV_INLINE_MAX`` (default and maximum 64 KiB)."""
    try:
        wanted = int(os.environ.get("SHMRDV_INLINE_MAX", str(RING_LIMIT)))
    except ValueError:
        return RING_LIMIT
    return max(0, min(wanted, RING_LIMIT))


class Route:
    """What a producer keeps per consumer worker: its ring (given up, with segments from
    then on, if its file is found truncated) and its doorbell (opened on first use: the
    consumer may not have started yet), and what it sent there. Its fields change under
    the producer's lock.

    ``reader`` is the ring's reader word (``Ring.reader_word``: the incarnation of the
    consumer process that reads it) and ``bell_reader`` its value when the doorbell was
    opened: a consumer task that restarted writes its own, and has a doorbell of its own,
    which the next send opens (``follow``)."""

    __slots__ = (
        "bell",
        "bell_at",
        "bell_reader",
        "fd",
        "reader",
        "ring",
        "seg",
        "sem",
        "sent",
        "sent_bytes",
        "size",
        "task",
    )

    def __init__(self, names: Names, producer: str, incarnation: int, task: str) -> None:
        self.task = task
        self.seg: Segment | None = None
        self.ring: Ring | None = None
        self.bell: Bell | None = None
        self.sem: posix_ipc.Semaphore | None = None  # ``bell.semaphore`` while it is set
        self.bell_at = 0.0  # when to look for the doorbell again
        self.fd = -1  # the ring file's descriptor and size, for its check before each write
        self.size = 0
        self.sent = self.sent_bytes = 0
        self.reader: memoryview = _NO_READER
        self.bell_reader = 0
        if RINGS_SUPPORTED:
            self._make_ring(names, producer, incarnation)

    def _make_ring(self, names: Names, producer: str, incarnation: int) -> None:
        """Make the ring of this producer run for the consumer, published under its name
        only once formatted; none where one cannot be made (segments only, found by name)."""
        seg = None
        try:
            seg = Segment.create(names, ring_size(RING_CAPACITY), keep_fd=True)
            meta = {"producer": producer, "incarnation": incarnation, "consumer": self.task}
            ring = Ring.format(memoryview(seg.buf), RING_CAPACITY, json.dumps(meta).encode())
            move_noreplace(seg.path, Names.path(names.ring(producer, incarnation, self.task)))
        except (OSError, RendezvousError) as e:
            _log.warning("no ring to %s (%s); segments only, found by name", self.task, e)
            if seg is not None:
                seg.unlink_quietly()
                seg.close()
            return
        seg.name = names.ring(producer, incarnation, self.task)
        self.seg, self.ring, self.fd, self.size = seg, ring, seg.fd, seg.size
        self.reader = ring.reader_word()

    def ring_intact(self) -> Ring | None:
        """The ring, if its file still holds it (one ``lseek``). A process of this user that
        kept a descriptor may have truncated it, and writing to a lost page would be a
        SIGBUS: such a ring is given up, and the consumer is sent segments, found by name."""
        try:
            if os.lseek(self.fd, 0, os.SEEK_END) >= self.size:
                return self.ring
        except OSError:
            pass
        seg, ring = self.seg, self.ring
        if seg is None or ring is None:
            return None
        try:
            seg.check_size(seg.size)  # says what is wrong
            why = "its descriptor failed"
        except (InternalError, ValueError) as e:
            why = str(e)
        _log.warning("the ring to %s is unusable (%s); segments from now on", self.task, why)
        self._let_go_reader()
        ring.release()
        seg.unlink_quietly()  # nothing in it can be read any more
        seg.close()
        self.seg = self.ring = None
        self.fd = -1
        return None

    def _let_go_reader(self) -> None:
        word, self.reader = self.reader, _NO_READER
        if word is not _NO_READER:
            word.release()

    def follow(self) -> None:
        """The ring has another reader than the doorbell's (``reader[0] != bell_reader``):
        its consumer task restarted, or attached the ring after the doorbell was opened.
        The doorbell is let go, and looked up again at the next post."""
        bell = self.bell
        self.bell = self.sem = None
        self.bell_at = 0.0
        self.bell_reader = int(self.reader[0])
        if bell is not None:
            bell.close()

    def doorbell(self, names: Names) -> posix_ipc.Semaphore | None:
        """The consumer's doorbell semaphore, opened on first use (looked for again every
        ``_BELL_LOOK_S`` while the consumer has not started); None while there is none."""
        if self.sem is not None:
            return self.sem
        now = time.monotonic()
        if now < self.bell_at:
            return None
        self.bell_at = now + _BELL_LOOK_S
        self.bell_reader = int(self.reader[0])  # (read first: a later reader is followed)
        try:
            bell = Bell.open(names, self.task)
        except RendezvousError:
            _log.warning("doorbell of %s refused (not ours); relying on its tick", self.task)
            self.bell_at = now + 3600.0
            return None
        if bell is not None:
            self.bell, self.sem = bell, bell.semaphore
        return self.sem

    def close(self) -> None:
        """Unmap the ring and close the doorbell. The ring keeps its name while it holds
        records its consumer has not taken (they are the consumer task's: this process's,
        or its next one's after a crash); one whose records are all taken goes."""
        seg, ring, bell = self.seg, self.ring, self.bell
        self.seg = self.ring = self.bell = self.sem = None
        self.fd = -1
        self._let_go_reader()
        if seg is not None and ring is not None:
            try:
                seg.check_size(seg.size)  # a truncated ring's words may be gone
                if not ring.pending():
                    seg.unlink_quietly()
            except InternalError:
                pass
            ring.release()
            seg.close()
        if bell is not None:
            bell.close()


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
        inflight: Inflight | None = None,
        holder_alive: ProducerAlive | None = None,
    ) -> None:
        self._names = names
        self._task = task
        self._inc = incarnation
        self._pid = os.getpid()
        self._inflight = inflight  # the max_inflight_bytes windows, if any
        self._inline_max = inline_max() if RINGS_SUPPORTED else -1
        self._lock = threading.Lock()
        self._seqs: dict[int, dict[str, int]] = {}  # step -> key -> next sequence number
        self._templates: dict[tuple[Any, tuple[int, ...], int], Template] = {}
        self._routes: dict[str, Route] = {}  # by a key's dst device, as written
        self._by_task: dict[str, Route] = {}  # the same routes, by consumer task
        self._allocations: dict[int, _Allocation] = {}
        # A consumer run that holds a slot and is gone gives it back (``SlotPool``).
        self._pool = SlotPool(names, task, incarnation, pool_bytes, holder_alive=holder_alive)
        self._closed = False
        self.zero_copy = self.ring_full = 0

    def _route(self, key: ParsedKey) -> Route:
        """The route to the consumer of ``key``: one per consumer task, made on first use."""
        route = self._routes.get(key.dst_device)
        if route is None:
            task = str(canonical_task(key.dst))
            with self._lock:
                route = self._by_task.get(task)
                if route is None:
                    route = self._by_task[task] = Route(self._names, self._task, self._inc, task)
                self._routes[key.dst_device] = route
        return route

    def _template(self, dtype: Any, shape: tuple[int, ...], key_len: int) -> Template:
        """The header template of (dtype, shape, key length), made once."""
        k = (dtype, shape, key_len)
        t = self._templates.get(k)
        if t is None:
            t = Template(dtype, shape, key_len)
            if len(self._templates) >= _TEMPLATES_MAX:
                self._templates.clear()
            self._templates[k] = t
        return t

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
            raise InvalidArgumentError(f"allocate({key.full_key!r}): negative dimension in {shp}")
        if dt.hasobject:
            raise InvalidArgumentError(
                f"allocate({key.full_key!r}): dtype {dt} holds Python objects, which cannot be "
                "shared"
            )
        t = self._template(dt, shp, len(key.full_key.encode()))
        seg: Segment | None = None
        slot: Slot | None = None
        if 0 < t.nbytes <= self._inline_max:
            arr: npt.NDArray[Any] = np.empty(shp, dt)  # inline when sent: plain memory serves
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
        if alloc.sent:
            if alloc.slot is not None:
                # Nothing of the producer's reads the slot any more: it may carry the next
                # message once its consumer gives it back (``SlotPool.unpin``).
                self._pool.unpin(alloc.slot)
            return
        if alloc.slot is not None:  # allocated and never sent: the memory is still ours
            self._pool.release(alloc.slot)
        elif alloc.segment is not None:
            alloc.segment.unlink()
            alloc.segment.close()

    def _segment(self, size: int) -> tuple[Slot | None, Segment]:
        slot = self._pool.acquire(size)
        if slot is not None:
            return slot, slot.segment
        return None, Segment.create(self._names, size)

    def _allocated(
        self, step_id: int, key: ParsedKey, value: npt.NDArray[Any]
    ) -> _Allocation | None:
        """The allocation ``value`` is, if any, now marked sent (``InvalidArgumentError`` if
        it was sent already, or is sent under another key or step)."""
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

    # -- send -------------------------------------------------------------------------

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None = None,
    ) -> None:
        """Publish ``value`` as the next message of (step, key): inline in the consumer's
        ring when it is small and fits, else in a segment (an array from ``allocate``: its
        own, with no copy). With a ``max_inflight_bytes`` window, room in it first (the
        bytes of an empty value count too: it is a record or a file)."""
        if self._closed:
            raise closed_error(self._task)
        ticket = None
        if self._inflight is not None:
            flight = self._inflight.for_key(key)
            ticket = flight.reserve(counted_bytes(value.nbytes), timeout, key.full_key)
        alloc = None
        try:
            if self._allocations:
                alloc = self._allocated(step_id, key, value)
            route = self._routes.get(key.dst_device) or self._route(key)
            fk = key.full_key
            raw = fk.encode()
            t = self._templates.get((value.dtype, value.shape, len(raw)))
            if t is None:
                t = self._template(value.dtype, value.shape, len(raw))
            flags = FLAG_DEAD if is_dead else 0
            seg = alloc.segment if alloc is not None else None
            if not (
                seg is None
                and t.nbytes <= self._inline_max
                and self._append(step_id, fk, raw, t, value.tobytes(), flags, route, ticket)
            ):
                self._send_segment(step_id, fk, raw, t, value, seg, alloc, flags, route, ticket)
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
        seg: Segment | None,
        alloc: _Allocation | None,
        flags: int,
        route: Route,
        ticket: Ticket | None,
    ) -> None:
        """Publish the message in a segment: ``seg``, an allocation's (no copy), else a pool
        slot (or a fresh segment) the value is copied into."""
        slot = alloc.slot if alloc is not None else None
        if seg is None:
            slot, seg = self._segment(t.segment_size)
            try:
                if t.nbytes:
                    copy_into(np.ndarray(value.shape, value.dtype, seg.buf, t.data_offset), value)
                name = self._publish(step_id, fk, raw, t, seg, slot, flags, route)
            except BaseException:
                self._discard(slot, seg)
                raise
        else:
            name = self._publish(step_id, fk, raw, t, seg, slot, flags, route)
            self.zero_copy += 1
        if ticket is not None:
            ticket.segment(name)
        if slot is not None:
            # An allocation's slot is pinned: it carries no other message while the
            # producer's array (or a view of it: views keep it alive) can still be read.
            self._pool.lend(slot, name, route.task, pinned=alloc is not None)
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
        """Append the message to the consumer's ring, header and data in one call, and post
        its doorbell; False (nothing written) if it has no ring or no room."""
        with self._lock:
            ring = route.ring_intact()
            if ring is None:
                return False
            at = ring.reserve(t.data_offset + t.nbytes)
            if at < 0:
                self.ring_full += 1
                return False  # full: this one goes through a segment, in sequence
            seqs = self._seqs.get(step_id)
            if seqs is None:
                seqs = self._seqs[step_id] = {}
            seq = seqs.get(fk, 0)
            t.write(ring.buf, at, raw, flags, step_id, seq, self._inc, self._pid, -1,
                    time.time_ns(), data)  # fmt: skip
            end = ring.commit()
            seqs[fk] = seq + 1
            route.sent += 1
            route.sent_bytes += t.nbytes
            if route.reader[0] != route.bell_reader:  # its consumer task restarted
                route.follow()
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
        """Give the message its sequence number, header and name, atomically, and put a
        notice of it in the consumer's ring (with no ring, or a full one, the consumer finds
        it by name: ``Ring.lost`` tells it to look). Returns the name.

        Raises ``InternalError`` if a file has that name already (planted by another user,
        or an earlier run's unreceived message): it is neither replaced nor written into.
        That sequence number is skipped (the consumer skips it too).
        """
        ticket = -1 if slot is None else slot.ticket
        with self._lock:
            seqs = self._seqs.get(step_id)
            if seqs is None:
                seqs = self._seqs[step_id] = {}
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
                if route.reader[0] != route.bell_reader:  # its consumer task restarted
                    route.follow()
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
        """Post the consumer's doorbell unless a post is pending: whoever takes that one
        drains every ring after it, so also this record (its ``head`` store came first, and
        the lock's release, an atomic read-modify-write, lies between). A saturated or
        closed semaphore is left as it is: the consumer's tick finds the message."""
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

    def _discard(self, slot: Slot | None, seg: Segment) -> None:
        if slot is not None:
            self._pool.release(slot)
        else:
            seg.unlink_quietly()
            seg.close()

    # -- steps and lifetime -----------------------------------------------------------

    def cleanup_step(self, step_id: int) -> None:
        if self._seqs:
            with self._lock:
                self._seqs.pop(step_id, None)

    def close(self) -> None:
        """Sweep the pool, unmap the rings, close the doorbells. The caller has already
        unlinked this worker's own doorbell (``pool.give_back`` relies on that order)."""
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
            out["inflight_bytes"] = self._inflight.used()
            out["window_waits"] = self._inflight.waits()
        return out


# -- the copy ---------------------------------------------------------------------------------

_EMPTY: npt.NDArray[Any] = np.empty(0, np.uint8)
# The CPUs this thread may run on and the host's load, and when they were read (a system
# call and a file read: at most once a second).
_cpus: list[float] = [0.0, 0.0]


def helpers() -> int:
    """Helper threads a large copy uses besides the caller: one less than the CPUs this
    thread may run on (read at most once a second), at most 3, none while the host's load
    says those CPUs are taken; ``SHMRDV_COPY_THREADS=n`` asks for ``n - 1`` whatever the
    load (1: none)."""
    now = time.monotonic()
    if now - _cpus[1] >= 1.0:
        try:
            cpus = len(os.sched_getaffinity(0))
            busy = os.getloadavg()[0] >= cpus
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cpus, busy = os.cpu_count() or 1, False
        _cpus[:] = [0.0 if busy else float(cpus), now]
    wanted = os.environ.get("SHMRDV_COPY_THREADS", "")
    if wanted:
        try:
            return max(0, min(int(wanted) - 1, _MAX_HELPERS))
        except ValueError:
            pass
    return max(0, min(int(_cpus[0]) - 1, _MAX_HELPERS))


class _Job:
    """Chunks handed out one at a time: whoever is free takes the next one, so a helper that
    wakes late (a sleeping CPU takes a while to run) only copies less."""

    __slots__ = ("busy", "chunks", "dst", "error", "idle", "lock", "next", "src")

    def __init__(self, dst: npt.NDArray[Any], src: npt.NDArray[Any], chunks: list[slice]) -> None:
        self.dst, self.src, self.chunks = dst, src, chunks
        self.next = self.busy = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)

    def work(self) -> None:
        """Copy chunks until none is left."""
        while True:
            with self.lock:
                if self.next >= len(self.chunks) or self.error is not None:
                    return
                part = self.chunks[self.next]
                self.next += 1
                self.busy += 1
            try:
                np.copyto(self.dst[part], self.src[part], casting="no")
            except BaseException as e:  # pragma: no cover - same dtype, contiguous
                with self.lock:
                    self.error = e
            finally:
                with self.lock:
                    self.busy -= 1
                    if self.busy == 0:
                        self.idle.notify_all()

    def finish(self) -> None:
        """Stop handing out chunks; wait until no helper is still copying one (none may keep
        the buffers exported: a segment's mapping cannot close under a view)."""
        with self.lock:
            self.next = len(self.chunks)
            while self.busy:
                self.idle.wait()
            self.dst = self.src = _EMPTY


class _Helpers:
    """The helper threads of this process, shared by every Worker (a forked child starts
    its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()

    def offer(self, job: _Job, n: int) -> None:
        """Let ``n`` helpers join ``job`` (starting them the first time)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the threads stayed with the parent
                self._queue, self._threads, self._pid = queue.SimpleQueue(), [], os.getpid()
            while len(self._threads) < n:
                t = threading.Thread(
                    target=self._run,
                    args=(self._queue,),
                    name=f"shmrdv-copy-{len(self._threads)}",
                    daemon=True,
                )
                t.start()
                self._threads.append(t)
            q = self._queue
        for _ in range(n):
            q.put(job)

    @staticmethod
    def _run(q: queue.SimpleQueue[_Job]) -> None:
        while True:
            q.get().work()  # a finished job hands out nothing: returns at once


_helpers = _Helpers()


def copy_into(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """``np.copyto(dst, src, casting="no")``, split across threads when it is large (same
    shape and dtype; ``dst`` C-contiguous). Returns once every byte is copied, also when
    interrupted (no helper writes ``dst`` after)."""
    nbytes = src.nbytes
    n = helpers() if nbytes >= PARALLEL_MIN and src.flags.c_contiguous else 0
    if n == 0:
        np.copyto(dst, src, casting="no")
        return
    d = dst.reshape(-1).view(np.uint8)
    s = src.reshape(-1).view(np.uint8)
    job = _Job(d, s, [slice(i, min(i + _CHUNK, nbytes)) for i in range(0, nbytes, _CHUNK)])
    _helpers.offer(job, n)
    try:
        job.work()
    finally:
        job.finish()
    if job.error is not None:  # pragma: no cover - see _Job.work
        raise job.error
