"""The receiving half of the same-host transport: one channel table, fed by the rings.

Each (step, key) is a ``Channel`` of one ``WaiterTable``: values not taken, or waiting
receives. Draining a producer's ring (``ring.py``) hands each record (the value, or a notice
naming its segment) to the oldest waiter, or queues it. Names are the truth: what no record
shows is found by name (``recovery.py``); a lost doorbell post costs a tick, never a
message. A queued value keeps its ring record (``Held``) until taken, so the task's next
process reads exactly what was not taken. Once per tick, producers with waiters are looked
up: a death fails their receives (``UnavailableError``), a restart those of keys pinned to
the old run (``AbortedError``, as TensorFlow words it).

Thread model (docs/threads.md): every method takes ``lock``; deliveries, frees and
collections found under it run after it, in the same thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from posix_ipc import Semaphore

from .._channels import MISSING, WaiterTable
from .._cluster import canonical_task
from .._errors import (
    AbortedError,
    InternalError,
    RendezvousError,
    ResourceExhaustedError,
    UnavailableError,
    cleanup_error,
    closed_error,
)
from .._keys import DeviceName, ParsedKey
from .._rendezvous import Canceller, DoneCallback, Received, invoke_done, received
from .._transport import TaskState, TransportContext
from . import reaper
from .header import FLAG_DEAD, FLAG_NOTICE, Reader, unpack_identity
from .naming import Names
from .pool import SlotMaps, run_alive
from .recovery import Held, InRing, Notice, Recovery

__all__ = ["TICK", "Channel", "Consumer", "Source"]

_log = logging.getLogger("shmrdv.shm")

#: Liveness and fallback period while receives wait: what a lost doorbell post costs.
TICK = 0.2
# Above this many waiting channels of a ringless producer, one listing beats an open each.
_LISTDIR_ABOVE = 64
_INF = float("inf")
_ndarray = np.ndarray
# What a producer seen alive less than a tick ago is taken to be, without a look.
_ALIVE = TaskState("alive")

#: A delivery to make outside the lock: ``done``, whether to copy, the value or the error.
Item = tuple[DoneCallback, bool, Received | BaseException]


#: What a channel queues: a value, a notice or an error; ``Held`` while its ring record stays.
Queued = Received | Notice | BaseException | Held
#: A message to free: producer task, step, key, incarnation, seq, slot.
Orphan = tuple[str, int, str, int, int, int]
#: What is found under the lock to do after it: deliveries, producer runs over, orphans.
_Work = tuple[list[Item], list[tuple[str, int]], list[Orphan]]


class Channel:
    """One (step, key), hashed by identity: ``seq`` of its next message not queued yet, of
    producer run ``inc`` (0: not known yet)."""

    __slots__ = ("inc", "key", "pk", "seen_alive", "seq", "src", "step")

    def __init__(self, step: int, key: str, src: Source, inc: int) -> None:
        self.step, self.key, self.src, self.inc = step, key, src, inc
        self.seq = 0
        self.pk: ParsedKey | None = None  # set by its first receive
        self.seen_alive = False


class Waiter:
    """One queued receive (``blocking``: its receiver polls; else a callback waits)."""

    __slots__ = ("blocking", "channel", "copy", "done")

    def __init__(self, done: DoneCallback, copy: bool, channel: Channel, blocking: bool) -> None:
        self.done, self.copy, self.channel, self.blocking = done, copy, channel, blocking


@dataclass(eq=False, slots=True)
class Source:
    """One producer task, as this consumer sees it."""

    task: str
    dev: DeviceName
    inc: int = 0  # of its live worker, or of the last one seen
    rings: list[InRing] = field(default_factory=list)
    ring_incs: set[int] = field(default_factory=set)  # runs whose ring is attached
    tried: set[int] = field(default_factory=set)  # earlier runs whose ring was looked for
    retired: set[int] = field(default_factory=set)  # runs whose ring was let go: never again
    look_at: float = 0.0  # when to look for its ring again
    alive_at: float = -1.0  # when it was last seen alive (with incarnation ``inc``)
    waiting: dict[Channel, None] = field(default_factory=dict)  # channels with waiters
    unseen: list[Channel] = field(default_factory=list)  # waiting, not marked seen_alive
    was_alive: bool = False
    restarted: bool = False
    broken: InternalError | None = None  # why its ring was failed, told once

    def ringless(self, inc: int) -> bool:
        """Whether run ``inc``'s messages can only be found by name (no ring attached)."""
        return (inc or self.inc) not in self.ring_incs

    def lost(self) -> bool:
        """Whether one of its rings lost records not recovered yet (as of the last drain)."""
        return any(r.lost != r.lost_seen for r in self.rings)


def deliver(done: DoneCallback, copy: bool, result: Received | BaseException) -> None:
    """Call ``done`` with ``result`` (copied if ``copy``), outside every lock."""
    if type(result) is Received:
        if copy:
            result = Received(np.array(result.value, copy=True), result.is_dead)
        invoke_done(done, None, result)
    else:
        invoke_done(done, result, None)  # type: ignore[arg-type]  # an error


class Consumer:
    """The receiving half of one worker's shared-memory transport (see the module docstring)."""

    def __init__(
        self, ctx: TransportContext, names: Names, kick: Callable[[], None], bell: Semaphore
    ) -> None:
        self._ctx = ctx
        self._bell = bell  # its value: doorbell posts not taken yet
        self._task = ctx.task_name
        self._names = names
        self._wake_dispatcher = kick  # a callback receive is queued: someone must poll
        self.lock = threading.Lock()
        self._closed = False
        self._aborted: dict[int, BaseException] = {}
        self.refusing = False  #: whether ``check_open`` may raise (closed, a step aborted)
        self._table: WaiterTable[Channel, Queued, Waiter] = WaiterTable()
        self._steps: dict[int, dict[str, Channel]] = {}
        self.srcs: dict[str, Source] = {}  # by task
        self._src_by_device: dict[str, Source] = {}  # by a key's src device, as written
        self._rings: list[InRing] = []
        self._reader = Reader()
        alive = run_alive(ctx.peers)
        self._maps = SlotMaps(names, ctx.incarnation, alive)
        self._recovery = Recovery(ctx, names, self, alive)
        #: Queued callback (non-blocking) waiters: the dispatcher thread polls while > 0.
        self.callback_waiters = 0
        self._tick_at = 0.0
        # Found under the lock, done after it: deliveries, runs over, messages to free.
        self._out: list[Item] = []
        self._over: list[tuple[str, int]] = []
        self._late: list[Orphan] = []
        self.received = self.received_bytes = self.refused = self.scans = 0
        self._records = 0  # ring records drained
        self._unexplained = False  # a post brought no record: a ring this consumer lacks
        self._behind = False  # a drain stopped before its ring's end: a first look reads on
        self._want: Channel | bool = False  # the channel of a receive's first look

    def source(self, task: str) -> Source:
        """The producer ``task`` (canonical name), known from now on."""
        src = self.srcs.get(task)
        if src is None:
            src = self.srcs[task] = Source(task, DeviceName.parse(task))
        return src

    def channel(self, step: int, key: str, src: Source, inc: int) -> Channel:
        """The channel of (step, key), made if new (of ``src``'s run ``inc``)."""
        chans = self._steps.setdefault(step, {})
        ch = chans.get(key)
        if ch is None:
            ch = chans[key] = Channel(step, key, src, inc)
        return ch

    def find(self, step: int, key: str) -> Channel | None:
        return self._steps.get(step, {}).get(key)

    def queue(self, ch: Channel, value: Queued) -> None:
        """Hand the channel's next message to its oldest waiter, or queue it."""
        if type(value) is Notice and ch in ch.src.waiting:
            opened = self._open(ch, value.seq, value.inc, value)
            if type(opened) is ResourceExhaustedError:
                self._fail(ch, opened)  # out of descriptors: the waiting receives fail,
                self._table.put(ch, value)  # and the unread message is the next one's
                return
            value = opened  # type: ignore[assignment]
        waiter = self._table.put(ch, value)
        if waiter is not None:
            self._out.append(self._served(waiter, value))

    def _work(self) -> _Work | None:
        if not (self._out or self._over or self._late):
            return None
        work = self._out, self._over, self._late
        self._out, self._over, self._late = [], [], []
        return work

    def _after(self, work: _Work | None) -> None:
        """Do what was found under the lock, now released."""
        if work is None:
            return
        out, over, late = work
        for task, inc in over:
            reaper.after_producer(self._names, task, inc, self._task)
        for args in late:
            self._recovery.free(*args)
        # Nothing kept: a mapped array the receiver drops goes back at once.
        out.reverse()
        while out:
            deliver(*out.pop())

    def check_open(self, step: int) -> None:
        if self._closed:
            raise closed_error(self._task)
        err = self._aborted.get(step)
        if err is not None:
            raise err

    def start_recv(
        self,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        """``Transport.start_recv``: deliver the next value now, or queue a waiter."""
        result: Received | BaseException | None = None
        first = False
        with self.lock:
            if self._closed or self._aborted:
                self.check_open(step_id)
            chans = self._steps.get(step_id)
            ch = chans.get(key.full_key) if chans is not None else None
            if ch is None:
                src = self._src_by_device.get(key.src_device)
                if src is None:
                    src = self.source(str(canonical_task(key.src)))
                    self._src_by_device[key.src_device] = src
                if chans is None and self._ctx.cleaned_up(step_id):  # raced its cleanup
                    raise cleanup_error(step_id, self._task)  # (no state made for it)
                ch = self.channel(step_id, key.full_key, src, key.src_incarnation)
            if ch.pk is None:
                ch.pk = key
                if key.src_incarnation:
                    ch.inc = key.src_incarnation
            src = ch.src
            if ch not in src.waiting:
                got = self._table.take(ch)
                result = self._first_look(ch, src) if got is MISSING else self._taken(ch, got)
            if result is None:
                waiter = Waiter(done, copy, ch, blocking)
                if self._table.wait(ch, waiter):
                    src.waiting[ch] = None
                if ch.seen_alive:
                    src.was_alive = True
                else:
                    src.unseen.append(ch)
                if not blocking:
                    self.callback_waiters += 1
                    first = self.callback_waiters == 1
            elif type(result) is Received:
                self.received += 1
                self.received_bytes += result.value.nbytes
            work = self._work()
        if work is not None:
            self._after(work)
        if result is not None:
            deliver(done, copy, result)
            return bool  # a canceller that returns False: nothing left to cancel
        if first:
            self._wake_dispatcher()  # it sleeps while no callback receive is pending
        return lambda: self.cancel(waiter)

    def _first_look(self, ch: Channel, src: Source) -> Received | BaseException | None:
        """What a receive finds before it waits: the value (from a ring due for a look, or by
        name), a failed ring's error, or its producer's death or restart, seen now."""
        self._want = ch  # a ring attached now is read until it brings ch's value
        try:
            if src.look_at != _INF:
                self._recovery.look_for_ring(src)
            if ch.inc and ch.inc not in src.ring_incs and ch.inc not in src.tried:
                src.tried.add(ch.inc)  # a key pinned to a run that is not the live one
                self._recovery.attach_run(src, ch.inc)
        finally:
            self._want = False
        if self._behind and ch not in self._table:
            self._catch_up(ch)
        result = self.take(ch, src.ringless(ch.inc) or src.lost())
        if result is None and src.broken is not None:
            result, src.broken = src.broken, None
        if result is None and not ch.seen_alive:
            result = self._failure(ch, self._look(src))
        return result

    def cancel(self, waiter: Waiter) -> bool:
        """Remove a queued waiter: True if it was still queued (its ``done`` never runs)."""
        with self.lock:
            ch = waiter.channel
            if not self._table.cancel(ch, waiter):
                return False
            if not waiter.blocking:
                self.callback_waiters -= 1
            if ch not in self._table:
                ch.src.waiting.pop(ch, None)
            return True

    def take(self, ch: Channel, by_name: bool) -> Received | BaseException | None:
        """The channel's next value if it is there: queued, or by its name (``by_name``)."""
        got = self._table.take(ch)
        if got is not MISSING:
            return self._taken(ch, got)
        if not by_name:
            return None
        if ch.src.lost():
            self._recovery.recover(ch.src)
        elif not ch.inc:
            self._recovery.resolve_incarnation(ch)  # may attach a gone producer's ring
        got = self._table.take(ch)
        if got is not MISSING:
            return self._taken(ch, got)
        if not ch.inc:
            return None  # its name cannot be computed yet
        result = self._open(ch, ch.seq, ch.inc, None)
        if result is not None and type(result) is not ResourceExhaustedError:
            ch.seq += 1  # (out of descriptors: not read, taken by a later receive)
        return result

    def _taken(self, ch: Channel, got: Queued) -> Received | BaseException:
        if type(got) is Held:
            got.r.taken(got.pos)
            got = got.value
        if type(got) is Notice:
            opened = self._open(ch, got.seq, got.inc, got)
            if type(opened) is ResourceExhaustedError:
                self._table.put(ch, got, front=True)  # not read: still the next one
            got = opened  # type: ignore[assignment]
        return got  # type: ignore[return-value]  # opened

    def _served(self, waiter: Waiter, value: Queued) -> Item:
        """The delivery of ``value`` to ``waiter``, counted."""
        ch = waiter.channel
        if ch not in self._table:
            ch.src.waiting.pop(ch, None)
        if not waiter.blocking:
            self.callback_waiters -= 1
        if type(value) is Received:
            self.received += 1
            self.received_bytes += value.value.nbytes
        return waiter.done, waiter.copy, value  # type: ignore[return-value]  # opened

    def serve(self, ch: Channel, by_name: bool) -> None:
        """Hand the channel's waiters what is there for them (by name too if ``by_name``)."""
        while ch in ch.src.waiting:
            result = self.take(ch, by_name)
            if result is None:
                return
            waiter = self._table.put(ch, result)
            assert waiter is not None  # it has waiters
            self._out.append(self._served(waiter, result))

    def _fail(self, ch: Channel, error: BaseException) -> None:
        while ch in ch.src.waiting:
            waiter = self._table.put(ch, error)
            assert waiter is not None
            self._out.append(self._served(waiter, error))

    def _open(
        self, ch: Channel, seq: int, inc: int, notice: Notice | None
    ) -> Received | BaseException | None:
        """Message ``seq`` of ``ch`` by its name: None if not published, an error if gone."""
        watch = next((r.watch for r in ch.src.rings if r.inc == inc), None)
        if notice is None:
            return self._maps.take(ch.src.task, ch.step, ch.key, inc, seq, watch=watch)
        got = self._maps.take(
            ch.src.task, ch.step, ch.key, inc, seq, notice.slot, notice.array, watch
        )
        if got is None:
            return InternalError(
                f"message {seq} of key {ch.key!r} from {ch.src.task} was announced but its "
                "segment is gone"
            )
        return got

    def adopt(self, r: InRing) -> None:
        """A ring ``Recovery.attach`` mapped: known from now on, and drained."""
        r.src.rings.append(r)
        r.src.ring_incs.add(r.inc)
        self._rings.append(r)
        self.drain(r, self._want)

    def drain(self, r: InRing, want: Channel | bool = False) -> None:
        """Every record of ring ``r`` to its channel's oldest waiter, or queued as ``Held``
        (past half the ring held, ``Recovery.spill`` moves out what earlier drains read); if
        ``want`` (a channel, or True), only until no receive waits and ``want`` has a value
        (``_behind``). A refused record's receiver gets the error; a lost ring is failed."""
        if not r.intact():
            self._fail_ring(r)
            return
        ring, src, inc = r.ring, r.src, r.inc
        before = ring.read
        buf, read, cleaned_up = ring.buf, self._reader.read, self._ctx.cleaned_up
        held, put = ring.held, self._table.put
        last_step: int | None = None
        late = False
        chans: dict[str, Channel] = {}
        while True:
            try:
                spans = ring.spans()
            except InternalError as e:
                _log.warning("ring from %s: %s", src.task, e)
                return
            finally:
                r.lost = ring.lost  # (``spans`` reads it first)
            if not spans:
                if ring.passed:
                    ring.consume()  # past records an earlier process took
                break
            at = -1
            try:
                for at, end in spans:
                    value: Received | Notice | BaseException
                    try:
                        flags, dtype, shape, offset, nbytes, step, seq, _, _, slot, _, key = read(
                            buf, at, end
                        )
                    except RendezvousError as e:
                        who = self._refused(src, buf[at:end], e)
                        if who is None:
                            if held:  # nobody will take it
                                ring.mark_taken(ring.position(at))
                            continue
                        step, seq, key, value = who
                        slot = -1
                    else:
                        dead = bool(flags & FLAG_DEAD)
                        if flags & FLAG_NOTICE:
                            value = Notice(seq, inc, slot, (dtype, shape, offset, nbytes, dead))
                        elif nbytes:
                            value = received(_ndarray(shape, dtype, buf, at + offset).copy(), dead)
                        else:
                            value = received(np.empty(shape, dtype), dead)
                    if step != last_step:
                        last_step, late = step, cleaned_up(step)
                        if not late:
                            chans = self._steps.get(step) or self._steps.setdefault(step, {})
                    if late:  # sent to a step this worker cleaned up already: freed
                        if type(value) is Notice:
                            self._late.append((src.task, step, key, inc, seq, slot))
                        if held:
                            ring.mark_taken(ring.position(at))
                        continue
                    self._records += 1
                    ch = chans.get(key)
                    if ch is None:
                        ch = chans[key] = Channel(step, key, src, inc)
                    if ch.inc != inc:
                        # Its run first heard of (earlier messages may be by name), or a restart.
                        fill = not ch.inc and seq
                        ch.inc = inc
                        if fill:
                            self._recovery.fill(ch, seq, r)
                    elif seq != ch.seq:
                        if seq < ch.seq:  # taken by its name already
                            if held:
                                ring.mark_taken(ring.position(at))
                            continue
                        self._recovery.fill(ch, seq, r)
                    ch.seq = seq + 1
                    if ch in ch.src.waiting:
                        if held:  # taken while an older record is not
                            ring.mark_taken(ring.position(at))
                        self.queue(ch, value)
                    else:
                        put(ch, Held(value, r, ring.hold(at)))
            except BaseException:
                ring.consume(at)  # what came before it is passed; it is found again
                raise
            if not ring.consume():
                break
            if want and not self._table.pending_waiters and (want is True or want in self._table):
                self._behind = True
                break
        if held and ring.read - held[0] > ring.capacity >> 1:
            self._recovery.spill(r, before)

    def _catch_up(self, want: Channel | bool = False) -> None:
        """Drain the rings a lazy drain left unread (until ``want``'s value, if given)."""
        self._behind = False
        for r in list(self._rings):
            self.drain(r, want)

    def _refused(
        self, src: Source, payload: memoryview, e: RendezvousError
    ) -> tuple[int, int, str, InternalError] | None:
        """(step, seq, key, error) of a refused record; None if it does not say whose."""
        self.refused += 1
        _log.warning("refusing a record of the ring from %s: %s", src.task, e)
        who = unpack_identity(payload)
        if who is None:
            return None
        step, seq, key = who
        why = f"refusing message {seq} of key {key!r} (step {step}) from producer {src.task}: {e}"
        return step, seq, key, InternalError(why)

    def _fail_ring(self, r: InRing) -> None:
        """Give up a ring whose file no longer holds it. Its producer goes on by name: the
        waiting receives look by name, then fail; else the next receive hears of it once."""
        src = r.src
        error = InternalError(
            f"the ring from producer {src.task} is unusable: its file was truncated below "
            f"its {r.size} bytes"
        )
        _log.warning("%s", error)
        r.segment.unlink_quietly()  # nothing in it can be read any more
        src.retired.add(r.inc)
        self._forget_ring(r)
        src.look_at = _INF  # a restarted producer makes a new one
        if src.waiting:
            for ch in list(src.waiting):
                self.serve(ch, True)
                self._fail(ch, error)
        else:
            src.broken = error

    def _forget_ring(self, r: InRing) -> None:
        self._rings.remove(r)
        r.src.rings.remove(r)
        r.src.ring_incs.discard(r.inc)
        r.release()

    def scan(self, posted: bool = True) -> int:
        """Drain the rings; per doorbell post (``posted``), look by name for producers
        without a ring; once per tick, check producers with waiters and let go of rings of
        runs that are over. Returns how many values a scan no post asked for delivered."""
        with self.lock:
            if self._closed:
                return 0
            self.scans += 1
            records = self._records
            try:
                for r in list(self._rings):
                    self.drain(r, True)
                if posted and records == self._records:
                    # A post no ring explains: a ring not attached yet, or a producer without.
                    self._unexplained = True
                    for src in list(self.srcs.values()):
                        if src.waiting and src.ringless(0):
                            self._recovery.look_for_ring(src, force=True)
                if posted and self._table.pending_waiters:
                    self._probe_ringless()
                now = time.monotonic()
                if now >= self._tick_at:
                    self._tick_at = now + TICK
                    self._maps.sweep()
                    for src in list(self.srcs.values()):
                        if src.waiting:
                            self._tick(src)
                    self._retire_over()
            except Exception:  # pragma: no cover - keep polling whatever happens
                _log.exception("shm consumer of %s: scan failed", self._task)
            work = self._work()
        if work is None:
            return 0
        found = 0 if posted else sum(1 for _, _, v in work[0] if type(v) is Received)
        self._after(work)
        return found

    def _tick(self, src: Source) -> None:
        """Once per tick for a producer with waiters: its ring, names and liveness."""
        self._recovery.look_for_ring(src, force=not src.rings)
        if src.lost():
            self._recovery.recover(src)
        if not src.inc or src.tried:
            for ch in self._recovery.find_gone(src):
                self.serve(ch, True)
        if src.tried or src.ringless(0):  # (else every waiting channel's run has its ring)
            for ch in list(src.waiting):
                if src.ringless(ch.inc):
                    self.serve(ch, True)
        if not src.waiting:
            return
        seen = self._look(src)
        if isinstance(seen, TaskState) and seen.state == "alive":
            if src.restarted:
                src.restarted = False
                for ch in list(src.waiting):
                    failure = self._failure(ch, seen)  # follows it, or fails
                    if failure is not None:
                        self._fail(ch, failure)
            for ch in src.unseen:
                ch.seen_alive = True
            src.was_alive = src.was_alive or bool(src.unseen)
            src.unseen.clear()
            return
        if isinstance(seen, TaskState) and not src.was_alive:
            return  # not started yet (or gone before anyone here saw it): wait
        src.was_alive = False
        for ch in list(src.waiting):
            failure = self._failure(ch, seen)
            if failure is not None:
                self.serve(ch, True)  # what it published before it died is delivered first
                self._fail(ch, failure)

    def _look(self, src: Source) -> TaskState | RendezvousError:
        """The producer's state (looked up at most once per tick while it lives; a new run
        noted), or the error of a record that cannot be trusted."""
        now = time.monotonic()
        if src.alive_at >= 0 and now - src.alive_at <= TICK:
            return _ALIVE
        try:
            seen = self._ctx.peers.state(src.dev)
        except RendezvousError as e:
            return e
        if seen.state == "alive" and seen.record is not None:
            if seen.record.incarnation != src.inc:
                src.restarted = bool(src.inc)
                src.inc = seen.record.incarnation
                src.look_at = 0.0  # a restarted producer: look for its new ring
            src.alive_at = now
        else:
            src.alive_at = -1.0
        return seen

    def _failure(self, ch: Channel, seen: TaskState | RendezvousError) -> BaseException | None:
        """Why the channel's producer can no longer send, or None while it may."""
        key = ch.pk.full_key if ch.pk is not None else ch.key
        src = ch.src.task
        if isinstance(seen, RendezvousError):
            return UnavailableError(f"producer {src} of key {key!r} cannot be trusted: {seen}")
        if seen.state == "alive":
            inc = ch.src.inc
            pinned = ch.pk.src_incarnation if ch.pk is not None else 0
            if pinned and inc != pinned:
                return AbortedError(
                    "RecvTensor expects a different device incarnation: "
                    f"{pinned:016x} vs. {inc:016x}. "
                    f'Your worker job ("{src}") was probably restarted; key {key!r}'
                )
            if not pinned and ch.inc and inc != ch.inc:
                # A restart, a key not pinned: follow the new run from its first message.
                ch.inc, ch.seq = inc, 0
                return None
            ch.seen_alive = True
            return None
        if ch.seen_alive:
            how = "exited" if seen.state == "absent" else "died"
            pid = f" (pid {seen.record.pid})" if seen.record is not None and seen.record.pid else ""
            return UnavailableError(
                f"producer {src}{pid} {how} while key {key!r} was awaited in step {ch.step}"
            )
        return None

    def _run_over(self, src: Source, inc: int) -> bool:
        """Whether run ``inc`` of the producer can send nothing more."""
        seen = self._look(src)  # (which notes the live run in ``src.inc``)
        if isinstance(seen, RendezvousError):
            return False
        return seen.state != "alive" or src.inc not in (0, inc)

    def _probe_ringless(self) -> None:
        """Per doorbell post: the waiting channels of producers without a ring, by name."""
        for src in list(self.srcs.values()):
            if not src.waiting or not src.inc or not src.ringless(0):
                continue
            chans = [c for c in src.waiting if src.ringless(c.inc)]
            if len(chans) > _LISTDIR_ABOVE:
                chans = self._recovery.published(chans)
            for ch in chans:
                self.serve(ch, True)

    def _retire_over(self) -> None:
        """Let go of the rings of runs over once every record is taken (collected after)."""
        for r in list(self._rings):
            if not self._run_over(r.src, r.inc):
                continue
            self.drain(r)
            if r in self._rings and not r.ring.pending():
                r.src.tried.add(r.inc)
                r.src.retired.add(r.inc)
                if r.src.inc == r.inc:
                    r.src.look_at = _INF  # a restarted producer is looked for again
                self._forget_ring(r)
                self._over.append((r.src.task, r.inc))

    def abort_step(self, step_id: int, error: BaseException) -> bool:
        """Fail the step's waiters and its later receives; whether any waiter was failed."""
        with self.lock:
            error = self._aborted.setdefault(step_id, error)
            self.refusing = True
            for ch in self._steps.get(step_id, {}).values():
                self._fail(ch, error)
            work = self._work()
        self._after(work)
        return work is not None

    def cleanup_step(self, step_id: int, error: BaseException) -> bool:
        """Fail the step's waiters with ``error`` (unless aborted), forget the step and free
        what it was sent and not received: what its channels hold, and what a listing shows
        where a message may have come with no record. Whether any waiter was failed."""
        # Under the lock even for a step that looks empty: a drain may be adding its channels.
        with self.lock:
            if self._closed:
                return False  # (every waiter was failed)
            posted = self._bell.value > 0
            if self._behind or posted:  # the step's unread records: freed as they are read
                self._catch_up()
            chans = self._steps.pop(step_id, None)
            if self._aborted:
                error = self._aborted.pop(step_id, error)
                self.refusing = self._closed or bool(self._aborted)
            for ch in (chans or {}).values():
                if ch in ch.src.waiting:
                    self._fail(ch, error)
                while ch in self._table:
                    got = self._table.take(ch)
                    if got is MISSING:
                        break
                    if type(got) is Held:
                        got.r.taken(got.pos)
                        got = got.value
                    if type(got) is Notice:
                        self._late.append(
                            (ch.src.task, ch.step, ch.key, got.inc, got.seq, got.slot)
                        )
            listing = self._unexplained or self._recovery.needed() or posted
            self._unexplained = False
            failed = bool(self._out)
            work = self._work()
        if work is not None:
            self._after(work)
        if listing:
            self._recovery.free_unreceived(step_id)
        return failed

    def close(self) -> None:
        """Fail every waiter with the closed error; the caller then calls ``release``."""
        with self.lock:
            if self._closed:
                return
            if self._behind or self._bell.value > 0:  # what cleaned-up steps were sent: freed
                self._catch_up()
            self._closed = self.refusing = True
            error = closed_error(self._task)
            for ch in list(self._table):
                self._fail(ch, error)
            work = self._work()
        self._after(work)

    def release(self) -> None:
        """After ``close``: unlink held names, unmap the rings, collect what runs that are
        over left unless their ring holds records not taken (kept for the next process)."""
        self._maps.unlink_held()
        with self.lock:
            for r in list(self._rings):
                r.src.alive_at = -1.0  # a fresh look, not the tick's
                if self._run_over(r.src, r.inc) and r.intact() and not r.ring.pending():
                    self._over.append((r.src.task, r.inc))
                self._forget_ring(r)
            self._maps.close()
            self._table = WaiterTable()
            self._steps.clear()
            work = self._work()
        self._after(work)

    @property
    def pending(self) -> int:
        """Channels with waiters."""
        return sum(len(src.waiting) for src in list(self.srcs.values()))

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "received": self.received,
                "received_bytes": self.received_bytes,
                "dispatcher_scans": self.scans,
                "name_probes": self._maps.probes,
                "refused_records": self.refused,
                "pending_keys": self.pending,
                "pending_receives": self._table.pending_waiters,
                "channels": sum(len(c) for c in self._steps.values()),
                "rings_in": len(self._rings),
                "moved_out": sum(r.moved for r in self._rings),  # of the rings attached
                "held": len(self._maps.held),
                "slots_mapped": len(self._maps),
                "slot_map_hits": self._maps.hits,
                "listings": self._recovery.listing.listings,
            }
