"""The consumer side of the same-host transport: channels, taking messages, incoming rings.

Each (step, key) is a channel with the next sequence number it expects. Every message a
producer sends leaves a record in the ring that producer keeps for this consumer: the
tensor itself when small (inline), else a notice "message (step, key, seq) is published
as a segment". Draining a ring therefore leads each arrival straight to its own channel:
no name is opened or probed per channel, nothing is listed, however many receives are
pending (issue 15 §1). A record with nobody waiting is kept (``_stash``) for the receive
that will come.

Names are the truth, rings and the doorbell are the fast path: a producer without a ring
(not x86-64, or it could not make one) is read by name, and a producer whose ring was
full counts the records it lost, which makes the consumer look for that producer's
messages by one listing (``_recover``, rate-limited). A lost doorbell post costs at most
one tick (``TICK``), never a message.

The array handed out for a segment is a view over the mapped segment (zero copy),
writable and the consumer's alone; the segment's name is unlinked (or, for a pool slot,
renamed to ``held``) at once, so the memory goes back when the array is garbage-collected
— or when the consumer dies, since nothing names it any more (a held slot: by ``gc``).

Once per tick, per producer task with waiters (not per channel), its presence record is
checked: a receive whose producer was alive and then died fails with ``UnavailableError``
within a second; its flock is released by the kernel at death, a stopped process keeps it.

Thread model: every public method takes ``lock`` itself (callers never hold it); none
blocks on a peer or calls a ``done`` callback: they return ``(done, copy, result)`` items
that the caller delivers outside the lock (``deliver``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._callbacks import DoneCallback, invoke_done
from .._devices import DeviceName
from .._errors import (
    AbortedError,
    InternalError,
    RendezvousError,
    UnavailableError,
    closed_error,
)
from .._keys import ParsedKey, parse_key
from .._received import Received
from .._transport import TransportContext
from .._values import shape_problem
from . import layout
from .listing import Listing
from .naming import Names, parse_name
from .ownership import is_ours
from .pool import give_back, return_slot
from .producer import task_name
from .ring import RINGS_SUPPORTED, Ring
from .segment import Segment, move_noreplace, peek_header
from .slotmaps import SlotMaps

__all__ = ["TICK", "Consumer", "Item", "deliver"]

_log = logging.getLogger("shmrdv.shm")

# Liveness and fallback period while receives are pending: bounds the cost of a lost
# doorbell post and the time to notice a dead producer (the issue asks for < 1 s).
TICK = 0.2
# Above this many waiting channels of a ringless producer, one listdir of /dev/shm is
# cheaper than one open() attempt per channel.
_LISTDIR_ABOVE = 64
# How often a consumer looks for a producer's ring that is not there yet.
_RING_LOOK_S = 0.02
# A notice record's data is in a segment: its header is checked against no file size.
_NO_FILE = 1 << 63
# Names a listing found not ours (another user's, not a regular file, a ring for another
# consumer, no valid header) are remembered, up to this many, and skipped without a system
# call afterwards: a flood of planted names costs one ``lstat`` each, once (issue 13 §2).
_REFUSED_MAX = 1 << 17
# At most this many names new to the consumer are looked at per listing (one ``lstat``,
# then maybe one open each); the rest wait for the next listing. Bounds a listing's work
# whatever another user plants.
_NEW_PER_LISTING = 32768

#: A delivery to make outside the lock: ``done``, whether to copy, the value or the error.
Item = tuple[DoneCallback, bool, Received | BaseException]


class _Notice:
    """A stashed notice: the message is the segment of its name (``slot``: pool slot or -1)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class _Waiter:
    __slots__ = ("blocking", "channel", "copy", "done")

    def __init__(self, done: DoneCallback, copy: bool, channel: _Channel, blocking: bool) -> None:
        self.done = done
        self.copy = copy
        self.channel: _Channel | None = channel
        # A blocked receiver polls the doorbell itself (``Transport.wait``); only callback
        # waiters (recv_async, futures, asyncio) need the dispatcher thread.
        self.blocking = blocking


class _Channel:
    """One (step, key): the next sequence number, what is stashed for it, who waits."""

    __slots__ = ("inc", "key", "nready", "pk", "seen_alive", "seq", "src", "step", "waiters")

    def __init__(self, step: int, key: str, src: _Src, inc: int) -> None:
        self.step = step
        self.key = key
        self.src = src
        self.pk: ParsedKey | None = None  # set by the first receive
        self.inc = inc  # producer incarnation (0 = not known yet)
        self.seq = 0
        self.nready = 0  # stashed messages (any sequence number)
        self.seen_alive = False
        self.waiters: deque[_Waiter] = deque()


class _InRing:
    """A producer's ring for this consumer, attached (its name already unlinked)."""

    __slots__ = ("inc", "lost", "lost_seen", "ring", "segment")

    def __init__(self, segment: Segment, ring: Ring, inc: int) -> None:
        self.segment, self.ring, self.inc = segment, ring, inc
        self.lost_seen = 0
        self.lost = 0  # the ring's lost count at the last (size-checked) drain


class _Src:
    """One producer task, as this consumer sees it."""

    __slots__ = (
        "alive_at",
        "broken",
        "dev",
        "inc",
        "look_at",
        "restarted",
        "ring_incs",
        "rings",
        "task",
        "tried",
        "unseen",
        "waiting",
        "was_alive",
    )

    def __init__(self, task: str, dev: DeviceName) -> None:
        self.task = task
        self.dev = dev
        self.inc = 0  # of its live worker, or of the last one seen
        self.rings: list[_InRing] = []
        self.ring_incs: set[int] = set()  # incarnations whose ring is attached
        self.tried: set[int] = set()  # earlier incarnations whose ring was looked for
        self.look_at = 0.0  # when to look for its ring again
        self.alive_at = -1.0  # when it was last seen alive (with incarnation ``inc``)
        self.waiting: dict[tuple[int, str], _Channel] = {}  # its channels with waiters
        self.unseen: list[_Channel] = []  # waiting channels not yet marked seen_alive
        self.was_alive = False  # some waiting channel has seen it alive
        self.restarted = False  # a new incarnation was seen: its channels need a look
        self.broken: InternalError | None = None  # why its ring was failed, once


def deliver(items: list[Item]) -> None:
    """Call each ``done`` through ``invoke_done`` (outside every lock), emptying ``items``.

    Holds no reference to a delivered value afterwards: a mapped array the receiver
    drops (or that ``copy`` replaced) releases its segment at once.
    """
    items.reverse()
    while items:
        done, copy, result = items.pop()
        if isinstance(result, BaseException):
            invoke_done(done, result, None)
            continue
        if copy:
            # Rebinding drops the mapped original before the receiver wakes up.
            result = Received(np.array(result.value, copy=True), result.is_dead)
        invoke_done(done, None, result)
        del result


class Consumer:
    """The receiving half of one worker's shared-memory transport (see the module docstring)."""

    def __init__(
        self, ctx: TransportContext, names: Names, on_callback_waiter: Callable[[], None]
    ) -> None:
        self._ctx = ctx
        self._names = names
        self._task = ctx.task_name
        self._wake_dispatcher = on_callback_waiter
        self.lock = threading.Lock()
        self._closed = False
        # step -> key -> channel; a step's table goes in one piece at cleanup.
        self._channels: dict[int, dict[str, _Channel]] = {}
        # step -> (key, incarnation, seq) -> what came for it (a value, a notice, an error).
        self._stash: dict[int, dict[tuple[str, int, int], Received | _Notice | BaseException]] = {}
        self._aborted: dict[int, BaseException] = {}
        self._srcs: dict[str, _Src] = {}  # by task name
        self._src_by_device: dict[str, _Src] = {}  # by the key's src device, as written
        self._rings: list[tuple[_Src, _InRing]] = []  # every attached ring
        self._touched: list[_Channel] = []  # channels with waiters and new stash entries
        self._failed: list[tuple[_Src, InternalError]] = []  # rings failed with waiters
        self._waiting = 0  # channels with waiters
        #: Number of queued callback (non-blocking) waiters: the dispatcher runs while > 0.
        self.callback_waiters = 0
        self._tick_at = 0.0
        self._headers = layout.HeaderCache()
        self._maps = SlotMaps(self._names)
        self._sweep_at = 0.0
        # ``held`` names of pool slots whose arrays this consumer still has. Finalizers do not
        # run at exit, so close() unlinks what is left (the mappings stay valid).
        self._held: set[str] = set()
        # Names of published messages already looked at by a listing (_recover, _orphans).
        self._listed: dict[str, tuple[int, str, int, int, int, int]] = {}
        self._listing = Listing(self._names.prefix, TICK / 2, _REFUSED_MAX)
        self._listed_gen = -1  # the listing generation ``_listed`` reflects
        self._rings_gen = -1  # the listing generation ``_find_rings`` went through
        self.counters = {
            "received": 0,
            "received_bytes": 0,
            "dispatcher_scans": 0,
            "name_probes": 0,
            "refused_records": 0,
        }

    def _producer_alive(self, task: str, incarnation: int) -> bool:
        """``pool.ProducerAlive``: one lock-free look at the producer's presence record."""
        state, record = self._ctx.peers.liveness(DeviceName.parse(task))
        return state == "alive" and record is not None and record.incarnation == incarnation

    # -- receives ---------------------------------------------------------------------

    def check_open(self, step: int) -> None:
        if self._closed:
            raise closed_error(self._task)
        if self._aborted:
            err = self._aborted.get(step)
            if err is not None:
                raise err

    def _src(self, key: ParsedKey) -> _Src:
        src = self._src_by_device.get(key.src_device)
        if src is None:
            name = task_name(key.src)
            src = self._srcs.get(name)
            if src is None:
                src = self._srcs[name] = _Src(name, key.src)
            self._src_by_device[key.src_device] = src
        return src

    def _channel(self, step: int, key: str, src: _Src, inc: int) -> _Channel:
        chans = self._channels.get(step)
        if chans is None:
            chans = self._channels[step] = {}
        ch = chans.get(key)
        if ch is None:
            ch = chans[key] = _Channel(step, key, src, inc)
        return ch

    def start(
        self, step_id: int, key: ParsedKey, done: DoneCallback, copy: bool, blocking: bool
    ) -> tuple[Item | None, _Waiter | None]:
        """Take the next value now (an item to deliver) or queue a waiter (returned)."""
        with self.lock:
            self.check_open(step_id)
            src = self._src(key)
            ch = self._channel(step_id, key.full_key, src, key.src_incarnation)
            if ch.nready and not ch.waiters and src.broken is None:
                # The fast path: a ring brought this very message already (no ring to
                # look for, nothing to drain first: what follows it stays in its ring).
                got = self._stashed(ch, key)
                if got is not None:
                    return (done, copy, got), None
            if ch.pk is None:
                ch.pk = key
                if key.src_incarnation:
                    ch.inc = key.src_incarnation
            result: Received | BaseException | None = None
            if not ch.waiters:
                if src.look_at <= time.monotonic():
                    self._look_for_ring(src)
                if ch.inc and ch.inc not in src.ring_incs and ch.inc not in src.tried:
                    self._look_for_old_ring(src, ch.inc)
                # Rings are drained by whoever polls (``scan``), right after checking their
                # size: reading a truncated ring's words here would be a SIGBUS.
                result = self._take(ch, self._probe(ch))
                if result is None and src.broken is not None:
                    result, src.broken = src.broken, None
                if result is None and not ch.seen_alive:
                    # Note now whether the producer is alive (so that its death is noticed
                    # even before the first tick), or fail a stale incarnation.
                    result = self._producer_failure(ch, self._liveness(src))
            if result is not None:
                return (done, copy, result), None
            waiter = _Waiter(done, copy, ch, blocking)
            if not ch.waiters:
                src.waiting[(step_id, ch.key)] = ch
                self._waiting += 1
            if ch.seen_alive:
                src.was_alive = True
            else:
                src.unseen.append(ch)
            ch.waiters.append(waiter)
            first = False
            if not blocking:
                self.callback_waiters += 1
                first = self.callback_waiters == 1
        if first:
            self._wake_dispatcher()  # it sleeps while no callback receive is pending
        return None, waiter

    def cancel(self, waiter: _Waiter) -> bool:
        """Remove a queued waiter: True if it was still queued (its ``done`` never runs)."""
        with self.lock:
            ch = waiter.channel
            if ch is None:
                return False
            try:
                ch.waiters.remove(waiter)  # O(waiters of this one key)
            except ValueError:
                return False
            self._unqueued(waiter)
            if not ch.waiters:
                self._unwait(ch)
            return True

    @staticmethod
    def _probe(ch: _Channel) -> bool:
        """Whether the channel's messages must be looked for by name: no ring of that
        producer incarnation is attached (a ringless producer, or not known yet)."""
        return (ch.inc or ch.src.inc) not in ch.src.ring_incs

    def _unqueued(self, waiter: _Waiter) -> None:
        waiter.channel = None
        if not waiter.blocking:
            self.callback_waiters -= 1

    def _unwait(self, ch: _Channel) -> None:
        if ch.src.waiting.pop((ch.step, ch.key), None) is not None:
            self._waiting -= 1

    def _serve(self, ch: _Channel, out: list[Item], probe: bool) -> None:
        """Hand the channel's waiters what is there for them."""
        while ch.waiters:
            result = self._take(ch, probe)
            if result is None:
                return
            waiter = ch.waiters.popleft()
            self._unqueued(waiter)
            out.append((waiter.done, waiter.copy, result))
        self._unwait(ch)

    # -- taking a message ---------------------------------------------------------------

    def _take(self, ch: _Channel, probe: bool) -> Received | BaseException | None:
        """The channel's next message, if it is there (under the lock).

        From the stash when a ring brought it; by its name when ``probe`` (a producer
        without a ring), when its ring lost records, or when the stash holds later
        messages but not this one (a sequence number the producer skipped). None: not
        there yet.
        """
        if not ch.nready:
            lost = self._lost_records(ch.src)
            if not (probe or lost):
                return None
            if lost:
                self._recover(ch.src)
            if not ch.nready and not ch.inc:
                self._resolve_incarnation(ch)  # may attach a gone producer's ring
            if not ch.nready:
                return self._take_named(ch) if ch.inc else None
        stash = self._stash.get(ch.step)
        got = None
        if stash is not None:
            if not ch.inc:
                self._adopt_incarnation(ch, stash)
            got = stash.pop((ch.key, ch.inc, ch.seq), None)
        if got is not None:
            ch.nready -= 1
            if not stash:
                del self._stash[ch.step]
            return self._taken(ch, got)
        # Later messages are here but not this one: was it published without a record?
        found = self._take_named(ch)
        if found is not None:
            return found
        if self._recover(ch.src):
            return self._take(ch, probe)
        nxt = self._next_stashed(ch)
        if nxt is None:
            ch.nready = 0  # what was counted is gone (another incarnation's, or stale)
            return None
        _log.debug("message %d of %r never came; skipping to %d", ch.seq, ch.key, nxt)
        ch.seq = nxt
        return self._take(ch, probe)

    def _stashed(self, ch: _Channel, key: ParsedKey) -> Received | BaseException | None:
        """The channel's next message if a ring record of it is stashed (not a notice)."""
        if ch.pk is None:
            ch.pk = key
            if key.src_incarnation:
                ch.inc = key.src_incarnation
        stash = self._stash.get(ch.step)
        if stash is None or not ch.inc:
            return None
        at = (ch.key, ch.inc, ch.seq)
        got = stash.get(at)
        if got is None or isinstance(got, _Notice):
            return None
        del stash[at]
        if not stash:
            del self._stash[ch.step]
        ch.nready -= 1
        ch.seq += 1
        if isinstance(got, Received):
            counters = self.counters
            counters["received"] += 1
            counters["received_bytes"] += got.value.nbytes
        return got

    def _adopt_incarnation(
        self, ch: _Channel, stash: dict[tuple[str, int, int], Received | _Notice | BaseException]
    ) -> None:
        for key, inc, _seq in stash:
            if key == ch.key:
                ch.inc = inc
                return

    def _next_stashed(self, ch: _Channel) -> int | None:
        stash = self._stash.get(ch.step, {})
        seqs = [s for (k, i, s) in stash if k == ch.key and i == ch.inc and s > ch.seq]
        return min(seqs) if seqs else None

    def _taken(
        self, ch: _Channel, got: Received | _Notice | BaseException
    ) -> Received | BaseException:
        if isinstance(got, _Notice):
            named = self._take_named(ch)
            if named is not None:
                return named
            ch.seq += 1
            return InternalError(
                f"message {ch.seq - 1} of key {ch.key!r} from {ch.src.task} was announced but "
                "its segment is gone"
            )
        ch.seq += 1
        if isinstance(got, Received):
            self.counters["received"] += 1
            self.counters["received_bytes"] += got.value.nbytes
        return got

    def _take_named(self, ch: _Channel) -> Received | BaseException | None:
        """Open the channel's next message by its name, if it is published (under the lock).

        None: not published (yet). An exception: that message cannot be used (a file
        another user planted under its name, a corrupt header) and is skipped, or the
        process is out of descriptors (the message stays for the next receive).
        """
        if not ch.inc:
            return None  # the name cannot be computed yet
        self.counters["name_probes"] += 1
        name = self._names.message(ch.step, ch.key, ch.inc, ch.seq)
        try:
            seg, ident, kept = self._maps.open(name)
        except FileNotFoundError:
            return None
        except InternalError as e:
            ch.seq += 1  # refused (not ours) or unreadable: never read it, never wait for it
            return e
        except RendezvousError as e:
            return e  # out of descriptors: the message stays where it is
        # Taken now: a stashed notice of it is stale.
        stash = self._stash.get(ch.step)
        if stash is not None and stash.pop((ch.key, ch.inc, ch.seq), None) is not None:
            ch.nready -= 1
        try:
            header = layout.unpack(seg.buf, seg.size)
            if header.key != ch.key or header.seq != ch.seq or header.step_id != ch.step:
                raise InternalError(
                    f"segment {name} holds key {header.key!r} step {header.step_id} "
                    f"seq {header.seq}, expected {ch.key!r} step {ch.step} seq {ch.seq}"
                )
            problem = shape_problem(header.shape, header.dtype.itemsize)
            if problem is not None:
                raise InternalError(f"segment {name} from {ch.src.task}: {problem}")
            seg.check_size(header.data_offset + header.nbytes)
        except RendezvousError as e:
            _unlink_quietly(seg)
            if kept:
                self._maps.forget(ident)
            else:
                seg.close()
            ch.seq += 1
            return e
        ch.seq += 1
        held = (
            self._names.held(ch.src.task, header.producer_incarnation, header.slot)
            if header.slot >= 0
            else None
        )
        if held is not None:
            try:
                # From here on the name says "a consumer holds it"; the memory goes back when
                # the array is collected (``pool.return_slot``).
                move_noreplace(seg.path, Names.path(held))
            except OSError as e:
                _log.warning("cannot mark %s as held (%s); it will not return to its pool", name, e)
                held = None
        if held is None:
            _unlink_quietly(seg)
            arr = seg.ndarray(header)
            if kept:
                self._maps.forget(ident)
            else:
                seg.close()
        else:
            seg.name = held
            self._held.add(held)
            # An array of its own per message; the mapping is kept for the slot's next one.
            arr = seg.lend(
                header,
                return_slot,
                self._names,
                self._producer_alive,
                ch.src.task,
                header.producer_incarnation,
                header.slot,
                self._held,
            )
            self._maps.keep(seg, ident, ch.src.task, header.producer_incarnation, header.slot)
        self.counters["received"] += 1
        self.counters["received_bytes"] += header.nbytes
        return Received(arr, header.is_dead)

    # -- rings --------------------------------------------------------------------------

    def _look_for_ring(self, src: _Src) -> None:
        """Attach the ring of ``src``'s current incarnation if it is there (rate-limited)."""
        if not RINGS_SUPPORTED:
            src.look_at = float("inf")
            return
        now = time.monotonic()
        src.look_at = now + _RING_LOOK_S
        if not src.inc:
            try:
                record = self._ctx.peers.lookup(src.dev)
            except RendezvousError as e:  # a record that is not ours, or corrupt
                _log.warning("presence record of %s: %s", src.task, e)
                return
            if not (record.final and record.incarnation):
                return
            src.inc = record.incarnation
        if src.inc in src.ring_incs:
            src.look_at = float("inf")  # until the producer restarts
            return
        try:
            self._attach_ring(self._names.ring(src.task, src.inc, self._task), (src.task, src.inc))
        except RendezvousError as e:
            _log.warning("%s", e)
            src.look_at = now + TICK

    def _look_for_old_ring(self, src: _Src, inc: int) -> None:
        """A key pinned to an incarnation that is not (or not yet) the live one: attach that
        run's ring if it left one with messages (once per incarnation)."""
        src.tried.add(inc)
        if not RINGS_SUPPORTED:
            return
        try:
            self._attach_ring(self._names.ring(src.task, inc, self._task), (src.task, inc))
        except RendezvousError as e:
            _log.warning("%s", e)

    def _attach_ring(self, name: str, expect: tuple[str, int] | None) -> bool:
        """Map a producer's ring for this consumer and unlink its name (the mapping stays:
        the memory goes when both sides have unmapped it, whoever dies first)."""
        try:
            seg = Segment.attach(self._names, name)
        except FileNotFoundError:
            return False
        try:
            ring = Ring(memoryview(seg.buf))
            meta = json.loads(ring.meta())
            owner = (str(meta["producer"]), int(meta["incarnation"]))
            if meta["consumer"] != self._task or (expect is not None and owner != expect):
                raise InternalError(f"ring {name} is {meta}, not for {self._task}")
            if not owner[1]:
                raise InternalError(f"ring {name} names incarnation 0")
        except (RendezvousError, ValueError, KeyError, TypeError) as e:
            seg.close()
            raise InternalError(f"refusing ring {name}: {e}") from e
        _unlink_quietly(seg)
        src = self._srcs.get(owner[0])
        if src is None:
            src = self._srcs[owner[0]] = _Src(owner[0], DeviceName.parse(owner[0]))
        if not src.inc:
            src.inc = owner[1]
        r = _InRing(seg, ring, owner[1])
        src.rings.append(r)
        src.ring_incs.add(owner[1])
        self._rings.append((src, r))
        self._drain(src, r)
        return True

    def _drain_all(self, check: bool = True) -> None:
        for src, r in list(self._rings):
            self._drain(src, r, check)

    def _drain(self, src: _Src, r: _InRing, check: bool = True) -> None:
        """Take every record waiting in one ring to its channel's stash.

        First one ``fstat`` (unless ``check`` is False: the caller checked it a moment ago):
        a process that kept a descriptor of the ring may have truncated it, and reading a
        lost page would kill this process (SIGBUS). Such a ring is failed: unmapped, and the
        receives waiting on its producer get the ``InternalError``.
        """
        if check:
            try:
                r.segment.check_size(r.segment.size)
            except InternalError as e:
                self._fail_ring(src, r, e)
                return
        r.lost = r.ring.lost()
        try:
            for payload in r.ring.take():
                self._record(src, r.inc, payload)
        except RendezvousError as e:
            _log.warning("ring from %s: %s", src.task, e)

    def _fail_ring(self, src: _Src, r: _InRing, e: InternalError) -> None:
        error = InternalError(f"the ring from producer {src.task} is unusable: {e}")
        _log.warning("%s", error)
        self._rings = [(s, x) for s, x in self._rings if x is not r]
        src.rings.remove(r)
        src.ring_incs.discard(r.inc)
        src.look_at = float("inf")  # its name is gone; a restarted producer makes a new one
        r.ring.release()
        r.segment.close()
        # A producer that saw the truncation itself went on by name: the waiting receives
        # look for their message by name first (``_serve_failed``), and fail only if it is
        # not there; the next receive of this producer hears of it once (``broken``).
        if src.waiting:
            self._failed.append((src, error))
        else:
            src.broken = error

    def _serve_failed(self, out: list[Item]) -> None:
        """Serve by name the channels of producers whose ring failed, else fail them."""
        while self._failed:
            src, error = self._failed.pop()
            for ch in list(src.waiting.values()):
                self._serve(ch, out, probe=True)
                if ch.waiters:
                    self._fail(ch, out, error)

    def _fail_later(self, ch: _Channel, error: BaseException) -> None:
        """Queue ``error`` for the channel's next receive (delivered like a message)."""
        stash = self._stash.setdefault(ch.step, {})
        key = (ch.key, ch.inc, ch.seq)
        if key not in stash:
            stash[key] = error
            ch.nready += 1
        if ch.waiters:
            self._touched.append(ch)

    def _record(self, src: _Src, inc: int, payload: memoryview) -> None:
        """One ring record: to its channel's stash, and its waiters served when they can be.

        A ring record is the producer's bytes: its header gets ``unpack``'s checks (through
        ``HeaderCache``) and the shared element-count rule (``shape_problem``). A record
        refused for what it says of its array still names its key: its receiver gets the
        ``InternalError``, and what follows in the ring is delivered as usual.
        """
        value: Received | _Notice | BaseException
        try:
            notice = len(payload) > 11 and bool(payload[10] & layout.FLAG_NOTICE)
            # ``unpack_fields`` (or the cache of its verdicts) also applies ``shape_problem``.
            (flags, dtype, shape, offset, nbytes, step, seq, _inc, _pid, slot, _t, key) = (
                self._headers.unpack(payload, _NO_FILE if notice else len(payload))
            )
        except RendezvousError as e:
            self.counters["refused_records"] += 1
            who = layout.unpack_identity(payload)
            _log.warning("refusing a record of the ring from %s: %s", src.task, e)
            if who is None:
                return
            step, seq, key = who
            notice = False
            value = InternalError(
                f"refusing message {seq} of key {key!r} (step {step}) from producer {src.task}: {e}"
            )
        else:
            if notice:
                value = _Notice(slot)
            elif nbytes:
                # One copy out of the ring (the record's bytes are overwritten later).
                arr: npt.NDArray[Any] = np.frombuffer(
                    payload, dtype, nbytes // dtype.itemsize, offset
                ).copy()
                if len(shape) != 1:
                    arr = arr.reshape(shape)
                value = Received(arr, bool(flags & 1))
            else:
                value = Received(np.empty(shape, dtype), bool(flags & 1))
        if self._ctx.cleaned_up(step):
            if notice:  # a late send of a step this worker already cleaned up: free it
                self._free_named(src.task, step, key, inc, seq, slot)
            return
        chans = self._channels.get(step)
        if chans is None:
            chans = self._channels[step] = {}
        ch = chans.get(key)
        if ch is None:
            ch = chans[key] = _Channel(step, key, src, inc)
        elif ch.inc == inc and seq < ch.seq:
            return  # already taken by its name
        stash = self._stash.get(step)
        if stash is None:
            stash = self._stash[step] = {}
        stash[(key, inc, seq)] = value
        ch.nready += 1
        if ch.waiters:
            self._touched.append(ch)

    @staticmethod
    def _lost_records(src: _Src) -> bool:
        # As of the last drain: the ring's words are read only right after a size check.
        return any(r.lost != r.lost_seen for r in src.rings)

    def _recover(self, src: _Src) -> bool:
        """Stash notices for ``src``'s messages whose records its full ring lost (one listing).

        Returns whether it stashed anything. Rate-limited with the other listings.
        """
        lost = [(r, r.lost) for r in src.rings if r.lost != r.lost_seen]
        if not lost or not self._list_messages():
            return False
        for r, n in lost:
            r.lost_seen = n
        incs = {r.inc for r in src.rings}
        found = False
        for step, key, seq, inc, _created, slot in list(self._listed.values()):
            if inc not in incs or self._ctx.cleaned_up(step):
                continue
            ch = self._channels.get(step, {}).get(key)
            if ch is not None and (ch.inc not in (0, inc) or seq < ch.seq):
                continue
            stash = self._stash.setdefault(step, {})
            if (key, inc, seq) in stash:
                continue
            try:
                if task_name(parse_key(key).src) != src.task:
                    continue
            except RendezvousError:
                continue
            stash[(key, inc, seq)] = _Notice(slot)
            ch = self._channel(step, key, src, inc)
            ch.nready += 1
            if ch.waiters:
                self._touched.append(ch)
            found = True
        return found

    def _list_messages(self) -> bool:
        """Bring ``_listed`` up to date with /dev/shm (``Listing``: a listdir at most once
        per half tick, none while the directory is unchanged); False if it may be stale.

        A name new to this consumer costs one ``lstat`` if it is another user's, at most
        ``_NEW_PER_LISTING`` of them per listing, and is never looked at again if refused.
        """
        listing = self._listing
        if not listing.refresh():
            return False
        if self._listed_gen == listing.generation:
            return True
        self._listed_gen = listing.generation
        marker = self._names.prefix + "m"
        listed = self._listed
        present = set()
        new: list[str] = []
        for e in listing.names:
            if e.startswith(marker):
                present.add(e)
                if e not in listed:
                    new.append(e)
        for name in list(listed):
            if name not in present:
                del listed[name]
        if len(new) > _NEW_PER_LISTING:
            del new[_NEW_PER_LISTING:]
            listing.incomplete()
        for name in new:
            h = peek_header(Names.path(name))  # one lstat for another user's name
            if h is None:
                listing.refuse(name)
            else:
                listed[name] = (
                    h.step_id,
                    h.key,
                    h.seq,
                    h.producer_incarnation,
                    h.created_ns,
                    h.slot,
                )
        return True

    def _resolve_incarnation(self, ch: _Channel) -> bool:
        """Find the incarnation of the channel's producer: its presence record, else (it is
        gone) the newest message a listing shows for the channel's next receive."""
        src = ch.src
        if not src.inc:
            try:
                record = self._ctx.peers.lookup(src.dev)
            except RendezvousError as e:  # a record that is not ours, or corrupt
                _log.warning("presence record of %s: %s", src.task, e)
                return False
            if record.final and record.incarnation:
                src.inc = record.incarnation
        if src.inc:
            ch.inc = src.inc
            return True
        # No record: the producer has not started, or it closed after sending. Its
        # messages are still there, under names computed with its incarnation.
        if RINGS_SUPPORTED:
            self._find_rings()
            if ch.nready:
                stash = self._stash.get(ch.step, {})
                self._adopt_incarnation(ch, stash)
                return ch.inc != 0
        self._list_messages()
        best, best_at = 0, -1
        for step, key, seq, inc, created, _slot in self._listed.values():
            if step == ch.step and seq == ch.seq and key == ch.key and created > best_at:
                best, best_at = inc, created
        ch.inc = best
        return best != 0

    def _find_rings(self) -> None:
        """Attach the rings addressed to this worker that a listing shows (a producer that
        closed before we learned its incarnation); each name is tried once."""
        listing = self._listing
        if not listing.refresh() or self._rings_gen == listing.generation:
            return
        self._rings_gen = listing.generation
        marker = self._names.prefix + "q"
        budget = _NEW_PER_LISTING
        for name in listing.names:
            if not name.startswith(marker) or listing.refused(name):
                continue
            if budget <= 0:
                listing.incomplete()
                break
            budget -= 1
            try:
                if not is_ours(os.stat(Names.path(name), follow_symlinks=False)):
                    listing.refuse(name)  # another user's: one lstat, never opened
                    continue
            except OSError:
                continue
            try:
                self._attach_ring(name, None)
            except InternalError as e:  # not ours, or not for this consumer: never again
                listing.refuse(name)
                _log.debug("%s", e)
            except RendezvousError as e:
                _log.debug("%s", e)

    # -- the scan (run by whoever polls the doorbell) ---------------------------------

    def arrived(self) -> bool:
        """Whether a ring holds records not yet drained: a look at shared memory, without
        the lock and without a system call (what a spinning poller checks between turns,
        right after a ``scan`` checked the rings' sizes)."""
        try:
            for _, r in self._rings:
                if r.ring.pending():
                    return True
        except ValueError:  # a ring failed and released meanwhile: let the scan see to it
            return True
        return False

    def scan(self, check: bool = True) -> list[Item]:
        """Drain the rings, serve the channels they brought something for; once per tick,
        check the producers that have waiters (liveness, ringless ones by name).

        ``check=False``: the rings' sizes were checked by a scan a moment ago (before a
        spin on their heads); they are not checked again.
        """
        with self.lock:
            if self._closed:
                return []
            try:
                return self._scan(check)
            except Exception:  # pragma: no cover - keep polling whatever happens
                _log.exception("shm dispatcher of %s: scan failed", self._task)
                return []

    def _scan(self, check: bool = True) -> list[Item]:
        self.counters["dispatcher_scans"] += 1
        out: list[Item] = []
        self._drain_all(check)
        self._serve_touched(out)
        self._serve_failed(out)
        if self._waiting:
            self._probe_ringless(out)
        now = time.monotonic()
        if self._maps and now >= self._sweep_at:
            self._sweep_at = now + TICK
            self._maps.sweep()
        if self._waiting and now >= self._tick_at:
            self._tick_at = now + TICK
            for src in list(self._srcs.values()):
                if src.waiting:
                    self._tick(src, out)
            self._serve_touched(out)
            self._serve_failed(out)
        return out

    def _serve_touched(self, out: list[Item]) -> None:
        while self._touched:
            touched, self._touched = self._touched, []
            for ch in touched:
                if ch.waiters:
                    self._serve(ch, out, probe=self._probe(ch))

    def _tick(self, src: _Src, out: list[Item]) -> None:
        """Once per tick for a producer with waiters: its ring, its messages by name if it
        has no ring (or lost records), its liveness."""
        if not src.rings or src.look_at <= time.monotonic():
            self._look_for_ring(src)
        for r in list(src.rings):
            self._drain(src, r)  # also checks its size once per tick
        if self._lost_records(src):
            self._recover(src)
        if not src.inc or src.tried:
            self._find_gone(src, out)
        if not src.waiting:
            return
        live = self._liveness(src)
        if live[0] == "alive":
            if src.restarted:
                src.restarted = False
                for ch in list(src.waiting.values()):
                    failure = self._producer_failure(ch, live)  # follows it, or fails
                    if failure is not None:
                        self._fail(ch, out, failure)
            for ch in src.unseen:
                ch.seen_alive = True
            src.was_alive = src.was_alive or bool(src.unseen)
            src.unseen.clear()
            return
        if live[0] != "broken" and not src.was_alive:
            return  # not started yet (or gone before anyone here saw it): keep waiting
        src.was_alive = False
        for ch in list(src.waiting.values()):
            failure = self._producer_failure(ch, live)
            if failure is None:
                continue
            # What the producer published before it died is visible now: deliver it.
            self._serve(ch, out, probe=True)
            self._fail(ch, out, failure)

    def _find_gone(self, src: _Src, out: list[Item]) -> None:
        """Messages of a producer whose incarnation is unknown (it is gone, or has not
        started) or of keys pinned to an earlier run: what one listing (rate-limited) shows
        for its waiting channels. Costs O(messages listed), not O(channels)."""
        if RINGS_SUPPORTED:
            self._find_rings()
        self._list_messages()
        for step, key, seq, inc, _created, _slot in list(self._listed.values()):
            chans = self._channels.get(step)
            ch = chans.get(key) if chans is not None else None
            if ch is None or ch.src is not src or not ch.waiters or ch.seq != seq:
                continue
            if ch.inc not in (0, inc):
                continue
            ch.inc = inc
            self._serve(ch, out, probe=True)

    def _probe_ringless(self, out: list[Item]) -> None:
        """Per doorbell wake-up: the waiting channels of known producers without a ring
        are looked for by name (the fallback path: O(their channels), or one listing when
        they are many)."""
        for src in self._srcs.values():
            if not src.waiting or not src.inc or src.inc in src.ring_incs:
                continue
            chans = [c for c in src.waiting.values() if self._probe(c)]
            if len(chans) > _LISTDIR_ABOVE:
                self._list_messages()  # then open only the names that are there
                there = {(s, k, q, i) for s, k, q, i, _c, _sl in self._listed.values()}
                chans = [c for c in chans if (c.step, c.key, c.seq, c.inc) in there]
            for ch in chans:
                self._serve(ch, out, probe=True)

    def _fail(self, ch: _Channel, out: list[Item], failure: BaseException) -> None:
        while ch.waiters:
            waiter = ch.waiters.popleft()
            self._unqueued(waiter)
            out.append((waiter.done, waiter.copy, failure))
        self._unwait(ch)

    # -- producer liveness --------------------------------------------------------------

    def _liveness(self, src: _Src) -> tuple[str, Any]:
        """``(state, record)`` of the producer; a look at most once per tick while alive."""
        now = time.monotonic()
        if src.alive_at >= 0 and now - src.alive_at <= TICK:
            return "alive", None
        try:
            state, record = self._ctx.peers.liveness(src.dev)
        except RendezvousError as e:
            return "broken", e
        if state == "alive" and record is not None:
            if record.incarnation != src.inc:
                src.restarted = bool(src.inc)
                src.inc = record.incarnation
                src.look_at = 0.0  # a restarted producer: look for its new ring
            src.alive_at = now
        else:
            src.alive_at = -1.0
        return state, record

    def _producer_failure(self, ch: _Channel, live: tuple[str, Any]) -> BaseException | None:
        """Why the channel's producer can no longer send, or None while it may."""
        state, record = live
        key = ch.pk.full_key if ch.pk is not None else ch.key
        src = ch.src.task
        if state == "broken":
            return UnavailableError(f"producer {src} of key {key!r} cannot be trusted: {record}")
        if state == "alive":
            inc = ch.src.inc
            pinned = ch.pk.src_incarnation if ch.pk is not None else 0
            if pinned and inc != pinned:
                return AbortedError(
                    "RecvTensor expects a different device incarnation: "
                    f"{pinned:016x} vs. {inc:016x}. "
                    f'Your worker job ("{src}") was probably restarted; key {key!r}'
                )
            if not pinned and ch.inc and inc != ch.inc and not ch.nready:
                # Restarted producer and a key that does not pin an incarnation: follow the
                # new run from its first message.
                ch.inc, ch.seq = inc, 0
                return None
            ch.seen_alive = True
            return None
        if ch.seen_alive:
            how = "exited" if state == "absent" else "died"
            pid = f" (pid {record.pid})" if record is not None and record.pid else ""
            return UnavailableError(
                f"producer {src}{pid} {how} while key {key!r} was awaited in step {ch.step}"
            )
        return None

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> list[Item]:
        with self.lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            items: list[Item] = []
            for ch in self._channels.get(step_id, {}).values():
                while ch.waiters:
                    waiter = ch.waiters.popleft()
                    self._unqueued(waiter)
                    items.append((waiter.done, waiter.copy, error))
                self._unwait(ch)
        return items

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; free the unreceived messages addressed to this worker in it."""
        with self.lock:
            self._drain_all()
            self._channels.pop(step_id, None)
            self._aborted.pop(step_id, None)
            stash = self._stash.pop(step_id, None)
        self._free_unreceived(step_id)
        del stash

    def _free_named(self, src: str, step: int, key: str, inc: int, seq: int, slot: int) -> None:
        path = Names.path(self._names.message(step, key, inc, seq))
        if slot >= 0:
            give_back(self._names, self._producer_alive, src, inc, slot, path)
            return
        try:
            os.unlink(path)
        except OSError:
            pass

    def _free_unreceived(self, step_id: int | None) -> int:
        """Free the messages of ``step_id`` (every step: None) addressed to this worker."""
        freed = 0
        try:
            entries = os.listdir(Names.path(""))
        except OSError:
            return 0
        marker = self._names.prefix + "m"
        own = self._ctx.task.task_key()
        listing = self._listing
        for entry in entries:
            if not entry.startswith(marker) or listing.refused(entry) or parse_name(entry) is None:
                continue
            path = Names.path(entry)
            header = peek_header(path)  # one lstat for another user's name
            if header is None:
                listing.refuse(entry)  # a set.add: safe outside the lock
                continue
            if step_id is not None and header.step_id != step_id:
                continue
            try:
                pk = parse_key(header.key)
            except RendezvousError:
                continue
            if pk.dst.task_key() != own:
                continue
            if header.slot >= 0:
                # A pool slot: hand it back to its producer rather than drop it.
                give_back(
                    self._names,
                    self._producer_alive,
                    task_name(pk.src),
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

    def close(self) -> list[Item]:
        """Fail every waiter (returned, to deliver); the caller then calls ``release``."""
        with self.lock:
            if self._closed:
                return []
            self._closed = True
            items: list[Item] = []
            error = closed_error(self._task)
            for src in self._srcs.values():
                for ch in list(src.waiting.values()):
                    while ch.waiters:
                        waiter = ch.waiters.popleft()
                        self._unqueued(waiter)
                        items.append((waiter.done, waiter.copy, error))
                    self._unwait(ch)
        return items

    def release(self) -> None:
        """Unlink the held names, unmap the rings (after ``close``)."""
        self._unlink_held()
        with self.lock:
            for _src, r in self._rings:
                r.ring.release()
                r.segment.close()
            self._rings.clear()
            self._maps.close()
            for src in self._srcs.values():
                src.rings.clear()
                src.ring_incs.clear()
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

    @property
    def pending(self) -> int:
        return self._waiting

    def stats(self) -> dict[str, int]:
        with self.lock:
            out = dict(self.counters)
            out["pending_keys"] = self._waiting
            out["pending_receives"] = sum(
                len(ch.waiters) for s in self._srcs.values() for ch in s.waiting.values()
            )
            out["channels"] = sum(len(c) for c in self._channels.values())
            out["rings_in"] = len(self._rings)
            out["held"] = len(self._held)
            out["slots_mapped"] = len(self._maps)
            out["slot_map_hits"] = self._maps.hits
            out["listings"] = self._listing.listings
        return out


def _unlink_quietly(seg: Segment) -> None:
    try:
        seg.unlink()
    except RendezvousError as e:
        _log.warning("%s", e)
