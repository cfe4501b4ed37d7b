"""The producer side of the same-host transport: sending a message (its number, bytes, name).

``send`` writes the array into a segment — a warm pool slot when one fits, else a fresh
fallocated segment — writes the header, then publishes it with one rename (no replace)
to the message's name, derived from (namespace, step, key, producer incarnation,
sequence number). The consumer can never see a half-written tensor: the name appears
only once the bytes are complete, also if the producer dies mid-write (then only a
``t``/``p`` name is left, for ``gc``). Small tensors instead travel inline in the ring
this producer keeps for their consumer (``ring.py``), on its route to that consumer
(``route.py``: the ring, the doorbell). Then the consumer's doorbell is posted: for an
inline message unless a post is waiting already (whoever takes that one drains every
ring after it); for a segment, as soon as its bytes are complete (before its header, its
rename and its ring notice, and for a large copy before its last ``copier.TAIL`` bytes):
its consumer's wake-up then runs while they are done, and it finds the message by its
spin, or by a second post if it slept again (``_publish``).

Thread model (``docs/threads.md``): any thread may call ``send`` / ``allocate``.
``_publish_lock`` serialises the sequence numbers and the rings (single producer per
ring); ``_lock`` guards the allocation table and the routes' doorbell caches
(``Route.lock``). Neither is held across a call that can block.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import InternalError, InvalidArgumentError, closed_error
from .._keys import DeviceName, ParsedKey
from .._window import counted_bytes
from . import header as layout
from .copier import copy_into
from .files import Segment, move_noreplace
from .inflight import Inflight, Ticket
from .naming import Names
from .pool import ProducerAlive, Slot, SlotPool
from .ring import RINGS_SUPPORTED
from .route import SEEK_END, EarlyPost, Route, file_size

__all__ = ["RING_LIMIT", "Producer", "inline_max", "task_name"]

# Tensors of at most this many bytes (SHMRDV_INLINE_MAX, default and maximum 64 KiB; 0
# turns it off) travel inline in the producer's ring for their consumer (``ring.py``)
# instead of a segment of their own: for them the dozen system calls of a segment cost
# far more than copying the bytes (a 64 B round trip drops from ~750 µs to ~150 µs here).
RING_LIMIT = 64 << 10


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
    template: layout.Template
    segment: Segment | None  # None: a small array, sent inline through the ring
    slot: Slot | None
    sent: bool = False


class _KeyOut:
    """What a send of one key needs that does not change from one message to the next:
    the key (its string and UTF-8 bytes), its route, the header template of the (dtype,
    shape) last sent under it, that header with the key in place (``Template.keyed``),
    whether such a message goes inline (``inline``: through the ring) and, for a live one,
    what its ring record needs: the header around the per-message fields (``head``,
    ``tail``: ``Template.live_parts``), its packer (``pack``: ``Template.pack_live``, header
    and data in one call) and its payload's size; and how many ring records it sent
    (``sent``, under the publish lock: each has the template's ``nbytes`` of data, so one
    attribute counts messages and bytes; ``Producer._fold`` keeps them when it goes)."""

    __slots__ = (
        "dtype",
        "fk",
        "inline",
        "payload",
        "raw",
        "route",
        "sent",
        "shape",
        "template",
    )

    def __init__(self, fk: str, raw: bytes, route: Route, t: layout.Template, inline: bool) -> None:
        self.fk = fk
        self.raw = raw
        self.route = route
        self.template = t
        self.dtype = t.dtype
        self.shape = t.shape
        self.inline = inline
        self.payload = t.data_offset + t.nbytes
        self.sent = 0


_time_ns = time.time_ns
# Header templates kept (per key; a key's dtype or shape change replaces its entry).
_TEMPLATES_MAX = 4096


class Producer:
    """The sending half of one worker's shared-memory transport (see the module docstring)."""

    def __init__(
        self,
        names: Names,
        task: str,
        incarnation: int,
        pool_bytes: int,
        inflight: Inflight | None = None,
        peer_alive: ProducerAlive | None = None,
    ) -> None:
        self._names = names
        self._inflight = inflight  # the max_inflight_bytes windows, if any
        self._task = task
        self._inc = incarnation
        self._pid = os.getpid()
        self._inline_max = inline_max() if RINGS_SUPPORTED else -1
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        # step -> key -> next sequence number: a step's table goes in one piece at cleanup.
        self._seqs: dict[int, dict[str, int]] = {}
        self._templates: dict[tuple[np.dtype[Any], tuple[int, ...], int], layout.Template] = {}
        self._outs: dict[str, _KeyOut] = {}  # by full key: what its sends reuse
        # The ring records of ``_KeyOut``s no longer in ``_outs``: messages, data bytes.
        self._folded = [0, 0]
        # By full key: (step, seq, name) of the key's next segment message, computed after
        # its last one was announced (``_publish``), when its consumer has the message.
        self._names_ahead: dict[str, tuple[int, int, str]] = {}
        self._allocations: dict[int, _Allocation] = {}
        self._routes: dict[str, Route] = {}  # by the key's dst device, as written
        self._consumers: dict[str, Route] = {}  # by consumer task
        # Every route made, also after ``close``: ``stats`` adds up what they sent.
        self._routes_made: list[Route] = []
        # ``peer_alive(task, incarnation)``: whether that worker run lives; a pool slot held
        # by a consumer run that is gone is taken back (``SlotPool``).
        self._pool = SlotPool(names, task, incarnation, pool_bytes, holder_alive=peer_alive)
        self.counters = {"sent_zero_copy": 0, "ring_full": 0}  # (sent: per route)

    # -- what is derived once ---------------------------------------------------------

    def _template(
        self, dtype: np.dtype[Any], shape: tuple[int, ...], key_len: int
    ) -> layout.Template:
        """The header template of (dtype, shape, key length), cached."""
        k = (dtype, shape, key_len)
        t = self._templates.get(k)
        if t is None:
            t = layout.Template(dtype, shape, key_len)
            if len(self._templates) >= _TEMPLATES_MAX:
                self._templates.clear()
            self._templates[k] = t
        return t

    def _route(self, key: ParsedKey) -> Route:
        """The route to the consumer of ``key`` (its ring made on first use)."""
        with self._publish_lock:
            route = self._routes.get(key.dst_device)
            if route is not None:
                return route
            task = task_name(key.dst)
            route = self._consumers.get(task)
            if route is None:
                route = Route.open(self._names, self._task, self._inc, task, self._lock)
                self._consumers[task] = route
                self._routes_made.append(route)
            self._routes[key.dst_device] = route
            return route

    def _next_seq(self, step_id: int, key: str) -> int:
        """The sequence number of the next message of (step, key) (under the publish lock)."""
        seqs = self._seqs.get(step_id)
        if seqs is None:
            seqs = self._seqs[step_id] = {}
        return seqs.get(key, 0)

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
        t = self._template(dt, shp, len(key.full_key.encode()))
        seg: Segment | None = None
        slot: Slot | None = None
        if 0 < t.nbytes <= self._inline_max:
            # Small: it will travel inline through the ring (copying a few KiB costs less
            # than publishing a segment), so plain memory serves.
            arr: npt.NDArray[Any] = np.empty(shp, dt)
        else:
            slot, seg = self._segment_for(t.segment_size)
            # A pool slot's size was checked by its acquire a moment ago (``SlotPool._intact``).
            # (The header is written when it is sent: ``_publish``.)
            arr = seg.view(t.dtype, t.shape, t.data_offset, t.nbytes, checked=slot is not None)
        alloc = _Allocation(weakref.ref(arr), step_id, key.full_key, t, seg, slot)
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

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None = None,
    ) -> None:
        if self._inflight is not None or self._allocations or is_dead:
            self._send_checked(step_id, key, value, is_dead, timeout)
            return
        # The hot path of a send (a live value, no window, no array from ``allocate``):
        # what the key's messages share is cached (``_KeyOut``), and a small one goes
        # straight to the ring (``_send_inline``).
        out = self._outs.get(key.full_key)
        if out is None or out.dtype is not value.dtype or out.shape != value.shape:
            out = self._key_out(key, value)
        if out.inline and self._send_inline(step_id, out, value, 0, None):
            return
        self._send_copy(step_id, key, out.raw, value, out.template, out.route, 0, None)

    def _send_checked(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None,
    ) -> None:
        """``send`` with a ``max_inflight_bytes`` window, or while arrays from ``allocate``
        are out (``value`` may be one of them)."""
        if self._inflight is None:
            self._send(step_id, key, value, is_dead, None)
            return
        # Backpressure: room in the consumer's window before anything is copied or published
        # (an empty value counts too: it is a ring record or a segment file).
        nbytes = counted_bytes(value.nbytes)
        ticket = self._inflight.for_key(key).reserve(nbytes, timeout, key.full_key)
        try:
            self._send(step_id, key, value, is_dead, ticket)
        finally:
            ticket.cancel()  # a no-op once published

    def _send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        ticket: Ticket | None,
    ) -> None:
        if self._allocations:
            alloc = self._allocations.get(id(value))
            if alloc is not None and alloc.ref() is value:
                self._send_allocated(step_id, key, value, is_dead, alloc, ticket)
                return
        out = self._outs.get(key.full_key)
        if out is None or out.dtype is not value.dtype or out.shape != value.shape:
            out = self._key_out(key, value)
        flags = 1 if is_dead else 0
        if out.inline and self._send_inline(step_id, out, value, flags, ticket):
            return
        self._send_copy(step_id, key, out.raw, value, out.template, out.route, flags, ticket)

    def _key_out(self, key: ParsedKey, value: npt.NDArray[Any]) -> _KeyOut:
        """The ``_KeyOut`` of ``key`` for arrays like ``value`` (made, or remade for a new
        dtype or shape)."""
        raw = key.full_key.encode()
        t = self._template(value.dtype, value.shape, len(raw))
        route = self._routes.get(key.dst_device) or self._route(key)
        out = _KeyOut(key.full_key, raw, route, t, t.nbytes <= self._inline_max)
        with self._publish_lock:  # no ring record is counted meanwhile (``_fold``)
            outs = self._outs
            if len(outs) >= _TEMPLATES_MAX:
                self._fold(outs.values())
                outs.clear()
            else:
                old = outs.get(key.full_key)
                if old is not None:
                    self._fold((old,))
            outs[key.full_key] = out
        return out

    def _fold(self, outs: Iterable[_KeyOut]) -> None:
        """Keep the counts of ``outs``' ring records, which leave ``_outs`` (publish lock
        held)."""
        folded = self._folded
        for out in outs:
            folded[0] += out.sent
            folded[1] += out.sent * out.template.nbytes

    def _send_inline(
        self,
        step_id: int,
        out: _KeyOut,
        value: npt.NDArray[Any],
        flags: int,
        ticket: Ticket | None,
    ) -> bool:
        """Append the message to the consumer's ring; False if it has no ring or no room.

        One lock, one ``lseek`` (``Route.ring_intact``), the header and the data in the ring
        (a live message's in one C call, ``Template.pack_live``; a dead one's header
        stamped with its flags, then the data), one store of ``head``, and the doorbell
        unless a post is waiting (``Route.post_record``). Every small message goes this way,
        ``send``'s hot path first.
        """
        data = value.tobytes()  # (``nbytes`` bytes: the template's dtype and shape)
        route = out.route
        lock = self._publish_lock
        lock.acquire()
        try:
            ring = route.ring
            if ring is None:
                return False  # the ring was failed: segments from now on
            # The SIGBUS guard (``Route.ring_intact``): the file's size, one ``lseek``.
            try:
                intact = file_size(route.ring_fd, 0, SEEK_END) >= route.ring_size
            except OSError:
                intact = False
            if not intact and not route.ring_intact():
                return False
            at = ring.reserve(out.payload)
            if at < 0:
                self.counters["ring_full"] += 1
                return False  # full: this one goes through a segment, in sequence
            seqs = self._seqs.get(step_id)
            if seqs is None:
                seqs = self._seqs[step_id] = {}
            fk = out.fk
            seq = seqs.get(fk, 0)
            out.template.write(
                route.ring_buf, at, out.raw, flags, step_id, seq, self._inc, self._pid, -1,
                _time_ns(), data,
            )  # fmt: skip
            end = ring.commit()
            seqs[fk] = seq + 1
            out.sent += 1
        finally:
            lock.release()
        if ticket is not None:
            ticket.record(ring, end)
        # The doorbell, unless a post is waiting already: whoever takes that one drains
        # every ring after it, so also this record (the ``head`` store came first). A burst
        # of sends then leaves one post, not one per message for the consumer to take, and
        # costs a read of the semaphore's value per message (no system call, no call).
        sem = route.sem
        try:
            if sem is not None and sem.value > 0:
                return True
        except Exception:
            pass  # closed: ``post_record`` says what is wrong
        route.post_record()
        return True

    def _send_copy(
        self,
        step_id: int,
        key: ParsedKey,
        raw: bytes,
        value: npt.NDArray[Any],
        t: layout.Template,
        route: Route,
        flags: int,
        ticket: Ticket | None,
    ) -> None:
        """Copy ``value`` into a pool slot (or a one-off segment) and publish it."""
        slot, seg = self._segment_for(t.segment_size)
        try:
            if t.nbytes:
                dst: npt.NDArray[Any] = np.ndarray(
                    value.shape, dtype=value.dtype, buffer=seg.buf, offset=t.data_offset
                )
                early = EarlyPost(route.post)
                copy_into(dst, value, early)  # (posts the doorbell as the copy ends)
                del dst
            else:
                early = EarlyPost(None)
            name, posted = self._publish(
                step_id, key, raw, t, seg, _slot_index(slot), route, flags, early.posted
            )
            if ticket is not None:
                ticket.segment(name)
        except BaseException:
            if slot is not None:
                self._pool.release(slot)
            else:
                seg.unlink()
                seg.close()
            raise
        if slot is not None:
            self._pool.lend(slot, key.full_key, name, route.task)
        else:
            seg.close()
        route.after_publish(t.nbytes, posted)

    def _send_allocated(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        alloc: _Allocation,
        ticket: Ticket | None,
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
        with self._lock:
            if alloc.sent:
                raise InvalidArgumentError(
                    f"this array from allocate() was already sent (key {alloc.key!r})"
                )
            alloc.sent = True
        t = alloc.template
        # What the key's sends reuse (its template is ``t`` while the key's dtype and shape
        # are the allocation's: ``_template`` caches).
        out = self._outs.get(key.full_key)
        if out is None or out.template is not t:
            out = self._key_out(key, value)
        raw, route = out.raw, out.route
        flags = 1 if is_dead else 0
        if alloc.segment is None:
            # A small one: inline through the ring, else (ring full) a segment of its own.
            try:
                small = out if out.template is t else _KeyOut(key.full_key, raw, route, t, True)
                if not self._send_inline(step_id, small, value, flags, ticket):
                    self._send_copy(step_id, key, raw, value, t, route, flags, ticket)
                elif small is not out:  # counted by a ``_KeyOut`` no table keeps
                    with self._publish_lock:
                        self._fold((small,))
            except BaseException:
                alloc.sent = False
                raise
            value.flags.writeable = False
            return
        try:
            name, posted = self._publish(
                step_id, key, raw, t, alloc.segment, _slot_index(alloc.slot), route, flags
            )
            if ticket is not None:
                ticket.segment(name)
        except BaseException:
            alloc.sent = False
            raise
        # The memory is the consumer's from here on: stop the producer writing into it.
        value.flags.writeable = False
        if alloc.slot is not None:
            self._pool.lend(alloc.slot, key.full_key, name, route.task)
        else:
            alloc.segment.close()
        self.counters["sent_zero_copy"] += 1
        route.after_publish(t.nbytes, posted)

    def _publish(
        self,
        step_id: int,
        key: ParsedKey,
        raw: bytes,
        t: layout.Template,
        seg: Segment,
        slot: int,
        route: Route,
        flags: int,
        posted: bool = False,
    ) -> tuple[str, bool]:
        """Give the message its sequence number and its name, atomically; return the name
        and whether the consumer's doorbell was posted. (``header``: ``t.keyed(raw)``, if
        the caller keeps it.)

        Then append a notice of it to the consumer's ring, so that the consumer goes
        straight to that name (with no ring, or a full one, it finds it by name).

        The doorbell is posted first, the bytes being complete (unless ``posted``: the
        copy posted it as it ended, ``copier.TAIL``): a consumer asleep on another CPU
        takes tens of µs to run again, more after a large copy has left the caches cold,
        and the header, the rename and the notice are done meanwhile instead of before.
        A consumer that wakes before the notice is there finds it by its spin; one that
        took the post and slept again gets a second one (``Route.after_publish``).

        Raises ``InternalError`` if a file has that name already (planted by another user,
        or left by an earlier run with the same incarnation): it is neither replaced nor
        written into. That sequence number is skipped (the consumer skips it too: it
        refuses the file, or reads the earlier run's message).
        """
        fk = key.full_key
        post = None if posted else route.post
        if post is not None:
            try:
                post()  # ``Bell.post`` (see the docstring)
                posted = True
            except Exception:  # closed or saturated: ``after_publish`` rings, and says why
                pass
        with self._publish_lock:
            seq = self._next_seq(step_id, fk)
            now = time.time_ns()
            t.write(seg.buf, 0, raw, flags, step_id, seq, self._inc, self._pid, slot, now)
            ahead = self._names_ahead.get(fk)
            if ahead is not None and ahead[0] == step_id and ahead[1] == seq:
                name = ahead[2]
            else:
                name = self._names.message(step_id, fk, self._inc, seq)
            try:
                move_noreplace(seg.path, Names.path(name))
            except FileExistsError as e:
                self._seqs[step_id][fk] = seq + 1
                raise InternalError(
                    f"cannot publish key {fk!r} (step {step_id}, message {seq}): {name} "
                    "exists already — planted by another process, or an unreceived message of an "
                    "earlier run with this incarnation; it was left untouched"
                ) from e
            except OSError as e:
                raise InternalError(f"cannot publish key {fk!r} as {name}: {e}") from e
            seg.name = name
            self._seqs[step_id][fk] = seq + 1
            ring = route.ring if route.ring_intact() else None
            if ring is not None:
                at = ring.reserve(t.data_offset)
                if at < 0:
                    self.counters["ring_full"] += 1
                    ring.count_lost()
                else:
                    t.write(
                        ring.buf, at, raw, flags | layout.FLAG_NOTICE, step_id, seq,
                        self._inc, self._pid, slot, now,
                    )  # fmt: skip
                    ring.commit()
        self._name_ahead(step_id, fk, seq + 1)
        return name, posted

    def _name_ahead(self, step_id: int, fk: str, seq: int) -> None:
        """Compute the name of message ``seq`` of ``fk`` in ``step_id`` now, for its
        ``_publish``: a keyed digest, a few µs once a large message has left the caches
        cold, which then is not done between the doorbell post and the ring notice that
        its consumer waits for. Called once the last one is announced."""
        ahead = self._names_ahead
        if len(ahead) >= _TEMPLATES_MAX and fk not in ahead:
            ahead.clear()
        try:
            ahead[fk] = (step_id, seq, self._names.message(step_id, fk, self._inc, seq))
        except InvalidArgumentError:  # past the last sequence number: refused when used
            ahead.pop(fk, None)

    # -- steps and lifetime -----------------------------------------------------------

    def cleanup_step(self, step_id: int) -> None:
        with self._publish_lock:
            self._seqs.pop(step_id, None)

    def close(self) -> None:
        """Sweep the pool, unmap the rings, close the doorbells. The caller has already
        unlinked this worker's own doorbell (``pool.give_back`` relies on that order)."""
        if self._inflight is not None:
            self._inflight.close(closed_error(self._task))  # before the rings are unmapped
        self._pool.close()
        with self._publish_lock:
            routes = list(self._consumers.values())
            self._consumers.clear()
            self._routes.clear()
            for route in routes:
                route.close_ring()
        bells = [b for b in (r.drop_bell() for r in routes) if b is not None]
        for b in bells:
            b.close()

    def stats(self) -> dict[str, int]:
        routes = list(self._routes_made)
        with self._publish_lock:
            records = [(o.sent, o.template.nbytes) for o in self._outs.values()]
            folded = list(self._folded)
        out = {
            "sent": sum(r.sent for r in routes) + folded[0] + sum(n for n, _ in records),
            "sent_bytes": (
                sum(r.sent_bytes for r in routes) + folded[1] + sum(n * b for n, b in records)
            ),
            **self.counters,
        }
        with self._lock:
            out["allocations"] = len(self._allocations)
        out["rings_out"] = sum(1 for r in list(self._consumers.values()) if r.ring is not None)
        out.update(self._pool.stats())
        if self._inflight is not None:
            out["inflight_bytes"] = self._inflight.used()
            out["window_waits"] = self._inflight.waits()
        return out


def _slot_index(slot: Slot | None) -> int:
    """What a header says of the slot: its ticket (the names of this lend), or -1."""
    return -1 if slot is None else slot.ticket
