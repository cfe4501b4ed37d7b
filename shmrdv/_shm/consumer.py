"""The consumer side of the same-host transport: channels, taking messages, incoming rings.

Each (step, key) is a channel with the next sequence number it expects. A receive takes
that message if it is there (from the producer's ring, or by opening the segment of that
name); if not, the waiter is queued on the channel and a later ``scan`` (run by whoever
polls the doorbell, see ``dispatcher.py``) delivers it. The array handed out is a view
over the mapped segment (zero copy), writable and the consumer's alone; the segment's
name is unlinked (or, for a pool slot, renamed to ``held``) at once, so the memory goes
back when the array is garbage-collected — or when the consumer dies, since nothing names
it any more (a held slot: by ``gc``).

Names are the truth, the doorbell is a hint: a lost or extra post costs at most one
dispatcher tick, never a message. ``scan`` also checks, for channels with waiters, whether
their producer died (its presence record's flock, released by the kernel at death — a
stopped process still holds it): a receive whose producer was alive and then died fails
with ``UnavailableError`` within a second.

Thread model: every method takes ``lock`` itself (callers never hold it). None of them
calls a ``done`` callback: they return ``(done, copy, result)`` items that the caller
delivers outside the lock (``deliver``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._callbacks import DoneCallback, invoke_done
from .._devices import DeviceName
from .._errors import AbortedError, InternalError, RendezvousError, UnavailableError
from .._keys import ParsedKey, parse_key
from .._received import Received
from .._transport import TransportContext
from . import layout
from .naming import Names, parse_name
from .pool import give_back, return_slot
from .producer import task_name
from .ring import RINGS_SUPPORTED, Ring
from .segment import Segment, move_noreplace, peek_header

__all__ = ["TICK", "Consumer", "Item", "deliver"]

_log = logging.getLogger("shmrdv.shm")

# Dispatcher wake-up period while receives are pending: bounds the cost of a lost
# doorbell post and the time to notice a dead producer (the issue asks for < 1 s).
TICK = 0.2
# Above this many channels with waiters, one listdir of /dev/shm is cheaper than one
# open() attempt per channel.
_LISTDIR_ABOVE = 64
# How often a consumer looks for a producer's ring that is not there yet.
_RING_LOOK_S = 0.02

#: A delivery to make outside the lock: ``done``, whether to copy, the value or the error.
Item = tuple[DoneCallback, bool, Received | BaseException]


@dataclass(eq=False)
class _Waiter:
    done: DoneCallback
    copy: bool
    channel: _Channel | None = None
    # A blocked receiver polls the doorbell itself (``Transport.wait``); only callback
    # waiters (recv_async, futures, asyncio) need the dispatcher thread.
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

    def __init__(self, ctx: TransportContext, on_callback_waiter: Callable[[], None]) -> None:
        self._ctx = ctx
        self._names = ctx.names
        self._task = ctx.task_name
        self._wake_dispatcher = on_callback_waiter
        self.lock = threading.Lock()
        self._closed = False
        self._channels: dict[tuple[int, str], _Channel] = {}
        self._waiting: dict[tuple[int, str], _Channel] = {}
        self._aborted: dict[int, BaseException] = {}
        #: Number of queued callback (non-blocking) waiters: the dispatcher runs while > 0.
        self.callback_waiters = 0
        # ``held`` names of pool slots whose arrays this consumer still has. Finalizers do not
        # run at exit, so close() unlinks what is left (the mappings stay valid).
        self._held: set[str] = set()
        # Headers of published messages, by name (names are never reused), for finding the
        # incarnation of a producer that is gone (``_orphan_incarnation``).
        self._orphans: dict[str, tuple[int, str, int, int, int]] = {}
        self._orphans_at = 0.0
        # Producer task -> (incarnation, when it was last seen alive), see _recently_alive.
        self._alive_at: dict[tuple[str, int, int], tuple[int, float]] = {}
        # (producer task, incarnation) -> (segment, ring), attached rings, and what was
        # taken from them: (step, key) -> {(incarnation, seq): value}.
        self._rings_in: dict[tuple[str, int], tuple[Segment, Ring]] = {}
        self._stash: dict[tuple[int, str], dict[tuple[int, int], Received]] = {}
        self._rings_listed_at = 0.0
        self._ring_look_at: dict[tuple[str, int], float] = {}  # see _take_inline
        self.counters = {"received": 0, "received_bytes": 0, "dispatcher_scans": 0}

    def _producer_alive(self, task: str, incarnation: int) -> bool:
        """``pool.ProducerAlive``: one lock-free look at the producer's presence record."""
        state, record = self._ctx.peers.liveness(DeviceName.parse(task))
        return state == "alive" and record is not None and record.incarnation == incarnation

    # -- receives ---------------------------------------------------------------------

    def check_open(self, step: int) -> None:
        if self._closed:
            raise AbortedError(f"Worker {self._task} is closed")
        err = self._aborted.get(step)
        if err is not None:
            raise err

    def start(
        self, step_id: int, key: ParsedKey, done: DoneCallback, copy: bool, blocking: bool
    ) -> tuple[Item | None, _Waiter | None]:
        """Take the next value now (an item to deliver) or queue a waiter (returned)."""
        k = (step_id, key.full_key)
        with self.lock:
            self.check_open(step_id)
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
            if result is not None:
                return (done, copy, result), None
            waiter = _Waiter(done, copy, ch, blocking)
            ch.waiters.append(waiter)
            self._waiting[k] = ch
            if not blocking:
                self.callback_waiters += 1
        if not blocking:
            self._wake_dispatcher()
        return None, waiter

    def cancel(self, waiter: _Waiter) -> bool:
        """Remove a queued waiter: True if it was still queued (its ``done`` never runs)."""
        with self.lock:
            ch = waiter.channel
            if ch is None:
                return False
            try:
                ch.waiters.remove(waiter)
            except ValueError:
                return False
            self._unqueued(waiter)
            if not ch.waiters:
                self._waiting.pop((ch.step, ch.key.full_key), None)
            return True

    def _unqueued(self, waiter: _Waiter) -> None:
        waiter.channel = None
        if not waiter.blocking:
            self.callback_waiters -= 1

    def _pop_waiter(self, ch: _Channel, out: list[Item], result: Received | BaseException) -> None:
        waiter = ch.waiters.popleft()
        self._unqueued(waiter)
        out.append((waiter.done, waiter.copy, result))

    def _resolve_incarnation(self, ch: _Channel) -> bool:
        if ch.inc:
            return True
        try:
            record = self._ctx.peers.lookup(ch.key.src)
        except RendezvousError as e:  # a record that is not ours, or corrupt
            _log.warning("presence record of %s: %s", task_name(ch.key.src), e)
            return False
        if record.final and record.incarnation:
            ch.inc = record.incarnation
            return True
        # No record: the producer has not started, or it closed after sending. Its
        # messages are still there, under names computed with its incarnation.
        ch.inc = self._orphan_incarnation(ch)
        return ch.inc != 0

    def _orphan_incarnation(self, ch: _Channel) -> int:
        """The incarnation of the message a gone producer left for the channel's next receive.

        0 if there is none. Reads the headers of this namespace's published messages (each
        once; at most one directory listing per ``TICK / 2``). The newest wins if runs of
        several incarnations left one.
        """
        now = time.monotonic()
        if now - self._orphans_at >= TICK / 2:
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
            _unlink_quietly(seg)
            seg.close()
            ch.seq += 1
            return e
        ch.seq += 1
        src = task_name(ch.key.src)
        held = (
            self._names.held(src, header.producer_incarnation, header.slot)
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
        else:
            seg.name = held
            self._held.add(held)
            seg.on_release(
                return_slot,
                self._names,
                self._producer_alive,
                src,
                header.producer_incarnation,
                header.slot,
                self._held,
            )
        seg.close()
        self.counters["received"] += 1
        self.counters["received_bytes"] += header.nbytes
        return Received(arr, header.is_dead)

    def _take_inline(self, ch: _Channel) -> Received | BaseException | None:
        """The channel's next message if it came through a ring (under the lock)."""
        src = task_name(ch.key.src)
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
        self.counters["received"] += 1
        self.counters["received_bytes"] += got.value.nbytes
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
        _unlink_quietly(seg)
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
                if self._ctx.cleaned_up(header.step_id):
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
        if now - self._rings_listed_at < TICK / 2:
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

    # -- the scan (run by whoever polls the doorbell) ---------------------------------

    def scan(self) -> list[Item]:
        """Deliver every published message that has a waiter; fail waiters of dead producers."""
        with self.lock:
            if self._closed:
                return []
            try:
                return self._scan()
            except Exception:  # pragma: no cover - keep polling whatever happens
                _log.exception("shm dispatcher of %s: scan failed", self._task)
                return []

    def _scan(self) -> list[Item]:
        self.counters["dispatcher_scans"] += 1
        out: list[Item] = []
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
                self._pop_waiter(ch, out, result)
            if ch.waiters:
                failure = self._producer_failure(ch)
                if failure is not None:
                    # What the producer published before it died is visible now: deliver it.
                    while ch.waiters:
                        result = self._try_take(ch)
                        if result is None:
                            break
                        self._pop_waiter(ch, out, result)
                    while ch.waiters:
                        self._pop_waiter(ch, out, failure)
            if not ch.waiters:
                self._waiting.pop((ch.step, ch.key.full_key), None)
        return out

    def _recently_alive(self, ch: _Channel) -> bool:
        """Whether the channel's producer was seen alive, with a fitting incarnation, less than
        a tick ago (then ``seen_alive`` is set without a look at its record: a fresh key per
        step must not cost a stat and a flock each)."""
        seen = self._alive_at.get(ch.key.src.task_key())
        if seen is None or time.monotonic() - seen[1] > TICK:
            return False
        inc = seen[0]
        if ch.key.src_incarnation not in (0, inc) or ch.inc not in (0, inc):
            return False
        ch.seen_alive = True
        return True

    def _producer_failure(self, ch: _Channel) -> BaseException | None:
        """Why the channel's producer can no longer send, or None while it may."""
        src = task_name(ch.key.src)
        try:
            state, record = self._ctx.peers.liveness(ch.key.src)
        except RendezvousError as e:
            return UnavailableError(
                f"producer {src} of key {ch.key.full_key!r} cannot be trusted: {e}"
            )
        if state == "alive" and record is not None:
            if ch.key.src_incarnation and record.incarnation != ch.key.src_incarnation:
                return AbortedError(
                    "RecvTensor expects a different device incarnation: "
                    f"{ch.key.src_incarnation:016x} vs. {record.incarnation:016x}. "
                    f'Your worker job ("{src}") was probably restarted (now pid {record.pid}); '
                    f"key {ch.key.full_key!r}"
                )
            if not ch.key.src_incarnation and ch.inc and record.incarnation != ch.inc:
                # Restarted producer and a key that does not pin an incarnation: follow the
                # new run from its first message.
                ch.inc, ch.seq = record.incarnation, 0
                return None
            ch.seen_alive = True
            self._alive_at[ch.key.src.task_key()] = (record.incarnation, time.monotonic())
            return None
        if ch.seen_alive:
            how = "exited" if state == "absent" else "died"
            pid = f" (pid {record.pid})" if record is not None and record.pid else ""
            return UnavailableError(
                f"producer {src}{pid} {how} while key {ch.key.full_key!r} was awaited "
                f"in step {ch.step}"
            )
        return None

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> list[Item]:
        with self.lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            items: list[Item] = []
            for k, ch in list(self._waiting.items()):
                if ch.step != step_id:
                    continue
                while ch.waiters:
                    self._pop_waiter(ch, items, error)
                del self._waiting[k]
        return items

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; free the unreceived messages addressed to this worker in it."""
        with self.lock:
            for k in [k for k in self._channels if k[0] == step_id]:
                del self._channels[k]
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
        own = self._ctx.task.task_key()
        for entry in entries:
            if not entry.startswith(marker) or parse_name(entry) is None:
                continue
            path = Names.path(entry)
            header = peek_header(path)
            if header is None or (step_id is not None and header.step_id != step_id):
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
            error = AbortedError(f"Worker {self._task} closed")
            for ch in self._waiting.values():
                while ch.waiters:
                    self._pop_waiter(ch, items, error)
            self._waiting.clear()
        return items

    def release(self) -> None:
        """Unlink the held names, unmap the rings (after ``close``)."""
        self._unlink_held()
        with self.lock:
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

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, int]:
        with self.lock:
            out = dict(self.counters)
            out["pending_keys"] = len(self._waiting)
            out["pending_receives"] = sum(len(ch.waiters) for ch in self._waiting.values())
            out["channels"] = len(self._channels)
            out["rings_in"] = len(self._rings_in)
            out["held"] = len(self._held)
        return out


def _unlink_quietly(seg: Segment) -> None:
    try:
        seg.unlink()
    except RendezvousError as e:
        _log.warning("%s", e)
