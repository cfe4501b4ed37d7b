"""The segments a consumer maps: a message taken from its segment, pool slots held, kept
mapped and given back (the consumer's half of the slot protocol of ``pool.py``).

A one-off segment is mapped and unlinked. A pool slot is renamed ``held`` while its array
lives, then ``returned`` to its producer (``give_back``); its mapping is kept from one
message to the next (``SlotMaps``, found by inode): no page faults per message after
warm-up.

Thread model (docs/threads.md): ``SlotMaps`` runs under the consumer's lock;
``return_slot`` runs in whichever thread collects an array, possibly inside the garbage
collector: it takes no lock.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .._errors import InternalError, RendezvousError
from .._rendezvous import Received, received
from .._values import shape_problem
from .files import Segment, move_noreplace, open_checked
from .header import FLAG_DEAD, Reader
from .naming import SLOT_BITS, Names
from .pool import CONTROL, HOLDER_AT, WORD, ProducerAlive

__all__ = ["RunWatch", "SlotMaps", "give_back"]

_log = logging.getLogger("shmrdv.shm.mappings")

#: At most this many kept mappings (file descriptors) per consumer: the pool's own default.
KEEP_MAX = 256
# A kept mapping that lent nothing for this long is checked for its slot's existence, at
# most ``_SWEEP_MAX`` of them per sweep (a few stats each).
_IDLE_S = 2.0
_SWEEP_MAX = 8
# A ticket's slot index (naming.SLOT_BITS).
_INDEX = (1 << SLOT_BITS) - 1

#: A slot file's identity across renames: (st_dev, st_ino).
_Ident = tuple[int, int]


class RunWatch:
    """A consumer's word about one producer run, read by ``give_back`` without a lock: while
    ``live``, the consumer has that run's ring attached and will collect what the run leaves
    (``reaper.after_producer``). It is cleared before that collection lists anything and
    read after the rename: a rename that does not see it cleared came before the listing."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True


def give_back(
    names: Names,
    alive: ProducerAlive,
    producer_task: str,
    incarnation: int,
    slot: int,
    path: str,
    mem: mmap.mmap | None = None,
    watch: RunWatch | None = None,
    held: set[str] | None = None,
) -> None:
    """Rename the pool slot at ``path`` to its ``returned`` name, then store its next ticket
    in its control block (``mem``, after an ``fstat``: a truncated page is a SIGBUS). Takes
    no lock: it may run inside the garbage collector.

    A producer run that is over takes nothing back: the file is unlinked. Its ``close``
    unlinks its doorbell, then its ``returned`` names; we rename, then look for the doorbell
    and its live record: seeing both, our rename came first. Skipped while ``watch`` is live
    (the consumer collects what the run leaves)."""
    if held is not None:
        held.discard(os.path.basename(path))
    ret = names.path(names.returned(producer_task, incarnation, slot))
    try:
        move_noreplace(path, ret)
    except FileNotFoundError:
        return
    except OSError as e:
        _log.warning("cannot give pool slot %s back (%s); unlinking it", path, e)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    if mem is not None:
        try:
            end = len(mem)
            if end >= CONTROL and mem.size() >= end:
                WORD.pack_into(mem, end - CONTROL, slot + (1 << SLOT_BITS))
        except (OSError, ValueError):
            pass  # its producer finds it under its name (``SlotPool._take_back``)
    if watch is not None and watch.live:
        return
    try:
        taken_back = os.path.lexists(names.bell_path(producer_task)) and alive(
            producer_task, incarnation
        )
    except Exception:  # a corrupt or foreign record: treat as gone
        taken_back = False
    if not taken_back:
        with contextlib.suppress(OSError):
            os.unlink(ret)


@dataclass(eq=False)
class _Kept:
    segment: Segment
    size: int
    task: str  # the producer's task, incarnation and slot index: the slot's names
    incarnation: int
    slot: int  # the ticket of its last lend
    used_at: float


class SlotMaps:
    """The kept mappings of one consumer (see the module docstring)."""

    def __init__(self, names: Names, incarnation: int, alive: ProducerAlive) -> None:
        self._names = names
        self._inc = incarnation  # the consumer run: noted in the slots it holds
        self._alive = alive
        self._reader = Reader()
        #: ``held`` names of slots whose arrays this consumer still has (their callbacks
        #: discard theirs); whoever closes the consumer unlinks what is left.
        self.held: set[str] = set()
        self._kept: OrderedDict[_Ident, _Kept] = OrderedDict()  # least recently used first
        # (producer task, incarnation, slot index) -> the kept mapping of that slot
        self._by_slot: dict[tuple[str, int, int], _Ident] = {}
        self.probes = self.hits = 0

    def __len__(self) -> int:
        return len(self._kept)

    def _used(self, ident: _Ident, kept: _Kept) -> Segment:
        kept.used_at = time.monotonic()
        self._kept.move_to_end(ident)
        self.hits += 1
        return kept.segment

    def _find(self, task: str, incarnation: int, ticket: int) -> tuple[Segment, _Ident] | None:
        """The kept mapping of the slot of ``ticket`` of ``task``'s run ``incarnation``."""
        ident = self._by_slot.get((task, incarnation, ticket & _INDEX))
        if ident is None:
            return None
        kept = self._kept.get(ident)
        if kept is None or kept.segment.closed:
            return None
        return self._used(ident, kept), ident

    def _open(self, name: str) -> tuple[Segment, _Ident, bool]:
        """Open segment ``name`` (``open_checked``): the segment, its identity, whether it is
        a kept mapping. Raises what ``Segment.attach`` raises."""
        fd, st = open_checked(self._names.path(name), os.O_RDWR, "segment")
        ident = (st.st_dev, st.st_ino)
        kept = self._kept.get(ident)
        if kept is not None:
            if kept.size == st.st_size and not kept.segment.closed:
                os.close(fd)
                kept.segment.name = name
                return self._used(ident, kept), ident, True
            self._drop(ident)  # resized: not the mapping to use any more
        return Segment.map_fd(self._names, name, fd, st), ident, False

    def take(
        self,
        task: str,
        step: int,
        key: str,
        inc: int,
        seq: int,
        slot: int = -1,
        array: tuple[Any, ...] | None = None,
        watch: RunWatch | None = None,
    ) -> Received | BaseException | None:
        """Message ``seq`` of (step, key) of ``task``'s run ``inc``, from the segment of its
        name: None if there is none (yet), the error for a file not ours or not this
        message. The array is a writable view, the consumer's alone (the name unlinked, or a
        slot's renamed ``held``). A slot a notice names that is mapped already needs no open."""
        self.probes += 1
        names = self._names
        name = names.message(step, key, inc, seq)
        path = Names.path(name)
        found = self._find(task, inc, slot) if slot >= 0 and array is not None else None
        held = ""
        if found is not None and array is not None:
            seg, ident = found
            dtype, shape, offset, nbytes, dead = array
            held = names.held(task, inc, slot)
            try:
                seg.check_size(seg.size)  # a shrunk file would be a SIGBUS
                move_noreplace(path, Names.path(held))
            except FileNotFoundError:
                return None
            except (RendezvousError, OSError):
                found = None  # the checked open below decides, and says why
        if found is None:
            try:
                seg, ident, is_kept = self._open(name)
            except FileNotFoundError:
                return None
            except RendezvousError as e:
                return e  # not ours, unreadable, or out of descriptors: never read
            try:
                flags, dtype, shape, offset, nbytes, got_step, got_seq, _, _, slot, _, got = (
                    self._reader.read(seg.buf, 0, seg.size, record=False)
                )
                if got != key or got_seq != seq or got_step != step:
                    raise InternalError(
                        f"segment {name} holds key {got!r} step {got_step} seq {got_seq}, "
                        f"expected {key!r} step {step} seq {seq}"
                    )
                problem = shape_problem(shape, dtype.itemsize)
                if problem is not None:
                    raise InternalError(f"segment {name} from {task}: {problem}")
            except RendezvousError as e:
                seg.unlink_quietly()
                self._let_go(seg, ident, is_kept)
                return e
            dead = bool(flags & FLAG_DEAD)
            held = names.held(task, inc, slot) if slot >= 0 else ""
            if held:
                try:
                    move_noreplace(path, Names.path(held))
                except OSError as e:
                    _log.warning(
                        "cannot mark %s held (%s); it will not return to its pool", name, e
                    )
                    held = ""
            if not held:
                seg.unlink_quietly()
                arr = seg.view(dtype, shape, offset, nbytes)
                self._let_go(seg, ident, is_kept)
                return received(arr, dead)
        # A pool slot named ``held`` now, its size checked a moment ago: this run noted in
        # its control block, then an array of its own over the kept mapping.
        seg.name = held
        if offset + nbytes > seg.size:
            seg.unlink_quietly()
            self._drop(ident)
            return InternalError(
                f"pool slot {name} of {seg.size} bytes cannot hold {nbytes} bytes at {offset}"
            )
        mem = seg.buf
        ctl = mem if isinstance(mem, mmap.mmap) and offset + nbytes <= seg.size - CONTROL else None
        if ctl is not None and self._inc:
            WORD.pack_into(ctl, len(ctl) - CONTROL + HOLDER_AT, self._inc)
        self.held.add(held)
        arr = seg.lend(
            dtype, shape, offset, nbytes, give_back, names, self._alive, task, inc, slot,
            Names.path(held), ctl, watch, self.held, checked=True,
        )  # fmt: skip
        self._keep(seg, ident, task, inc, slot)
        return received(arr, dead)

    def _let_go(self, seg: Segment, ident: _Ident, kept: bool) -> None:
        if kept:
            self._drop(ident)
        else:
            seg.close()

    def unlink_held(self) -> None:
        """Unlink the ``held`` names of arrays still alive (their mappings stay: the
        callbacks that give them back do not run at exit)."""
        held = self.held
        while held:
            with contextlib.suppress(KeyError, OSError):  # (a callback may discard meanwhile)
                os.unlink(Names.path(held.pop()))

    def _keep(self, seg: Segment, ident: _Ident, task: str, incarnation: int, slot: int) -> None:
        """Keep ``seg`` (a pool slot of ``task``'s ``incarnation`` lent under ticket ``slot``)
        mapped for its next message; for a kept one, note the ticket of this lend."""
        kept = self._kept.get(ident)
        if kept is not None:
            kept.slot = slot
            return
        if len(self._kept) >= KEEP_MAX:
            idle = next((i for i, k in self._kept.items() if not k.segment.lent), None)
            if idle is None:
                seg.close()  # every kept mapping lends an array: this one is not kept
                return
            self._drop(idle)
        self._kept[ident] = _Kept(seg, seg.size, task, incarnation, slot, time.monotonic())
        self._by_slot[(task, incarnation, slot & _INDEX)] = ident

    def _drop(self, ident: _Ident) -> None:
        kept = self._kept.pop(ident, None)
        if kept is None:
            return
        at = (kept.task, kept.incarnation, kept.slot & _INDEX)
        if self._by_slot.get(at) == ident:
            del self._by_slot[at]
        kept.segment.close()  # unmapped now, or when its last lent array is collected

    def sweep(self) -> None:
        """Drop idle mappings whose slot is gone (a few ``stat`` calls; once per tick)."""
        now = time.monotonic()
        names, looked = self._names, 0
        for ident, kept in list(self._kept.items()):
            if looked >= _SWEEP_MAX:
                return
            if now - kept.used_at < _IDLE_S or kept.segment.lent:
                continue
            looked += 1
            kept.used_at = now
            task, inc, ticket = kept.task, kept.incarnation, kept.slot
            for name in (  # is one of the slot's names still this file?
                # Taken back, the slot is free under its next ticket (naming.SLOT_BITS).
                names.pool(task, inc, ticket + (1 << SLOT_BITS)),
                names.returned(task, inc, ticket),
                names.held(task, inc, ticket),
            ):
                with contextlib.suppress(OSError):
                    st = os.stat(names.path(name), follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == ident:
                        break
            else:
                self._drop(ident)

    def close(self) -> None:
        """Drop every kept mapping (arrays still lent keep theirs until collected)."""
        while self._kept:
            self._drop(next(iter(self._kept)))
