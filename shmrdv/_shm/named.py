"""Taking a published message by its name: the segment named by (step, key, incarnation, seq).

The array handed out for a segment is a view over the mapped segment (zero copy),
writable and the consumer's alone; the segment's name is unlinked (or, for a pool slot,
renamed to ``held``) at once, so the memory goes back when the array is garbage-collected
— or when the consumer dies, since nothing names it any more (a held slot: its producer
takes it back once it sees that consumer run gone, ``pool.py``; else ``gc``).
A pool slot's mapping is kept from one message to the next (``SlotMaps``); a slot that the
producer's ring announced and that is mapped already is taken without opening its name
(one rename to ``held`` and one ``fstat``), and its array gives it back through the slot's
control block (``pool.return_slot``).

The names a kept slot's next message needs (its message name, and the slot's ``held`` and
``returned`` names for its next lend: the producer bumps a slot's ticket by one generation
per lend, ``naming.SLOT_BITS``) are keyed digests, a few µs each and more once the caches
are cold: a 16 MiB message leaves them so. ``ahead`` computes them while a receive of the
channel waits (idle time), so that the take and the give-back of the message that wakes
it only look them up; a prediction that does not come true is dropped.

Thread model (docs/threads.md): ``take`` runs under ``Consumer.lock``; ``unlink_held``
after the consumer is closed; the ``held`` set is also changed by the finalizers of lent
arrays (``pool.return_slot``), in whichever thread collects them.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

import numpy.typing as npt

from .._errors import InternalError, RendezvousError
from .._rendezvous import Received
from .._values import shape_problem
from . import header as layout_header
from .book import Book, Channel, Notice, NoticeArray
from .files import Segment, move_noreplace
from .naming import MAX_TICKET, SLOT_BITS, Names
from .pool import CONTROL, ProducerAlive, RunWatch, hold, return_slot
from .slotmaps import SlotIdent, SlotMaps

__all__ = ["NamedMessages"]


class _Unsure:
    """``_take_kept`` could not tell: take the message through the checked open instead."""


_UNSURE = _Unsure()

# ``ahead``: at most this many names computed ahead (past it, they are dropped), and of
# keys whose last lend is remembered.
_AHEAD_MAX = 64
_KEYS_MAX = 1024
# (producer task, its incarnation, ticket): a lend of one slot of one producer run.
_LendId = tuple[str, int, int]
# A key's last lend, and what its array was: (task, incarnation, ticket, dtype, shape,
# data offset, bytes).
_LastLend = tuple[str, int, int, Any, tuple[int, ...], int, int]

_log = logging.getLogger("shmrdv.shm")


class NamedMessages:
    """Opens a channel's next message by name (see the module docstring)."""

    def __init__(
        self, names: Names, book: Book, producer_alive: ProducerAlive, incarnation: int = 0
    ) -> None:
        self._names = names
        self._inc = incarnation  # this consumer's run: noted in the slots it holds
        self._book = book
        self._producer_alive = producer_alive
        self.maps = SlotMaps(names)
        # ``held`` names of pool slots whose arrays this consumer still has. Finalizers do not
        # run at exit, so close() unlinks what is left (the mappings stay valid).
        self.held: set[str] = set()
        self.probes = 0
        # ``ahead``: message names by (step, key, producer incarnation, seq); a lend's
        # ``held`` name and ``returned`` path by ``_LendId``; a key's last lend.
        self._ahead: dict[tuple[int, str, int, int], str] = {}
        self._slot_names: dict[_LendId, tuple[str, str]] = {}
        self._last_lend: dict[str, _LastLend] = {}

    def ahead(self, ch: Channel) -> None:
        """While a receive of ``ch`` waits: compute the names its next message will need if,
        like the last one of its key, it comes in a kept pool slot (the same slot, lent
        again under its next ticket), and make its array (``Segment.prepare_lend``). Idle
        time (under ``Consumer.lock``); a no-op for keys that came inline. Never raises.
        """
        last = self._last_lend.get(ch.key)
        if last is None:
            return
        task, inc, ticket, *_ = last
        seq = ch.seq
        if inc != ch.inc or task != ch.src.task:
            return
        names = self._names
        ahead, slots = self._ahead, self._slot_names
        if ahead and ahead.pop((ch.step, ch.key, inc, seq - 1), None) is not None:
            # The last message's name, computed ahead, was not used: it did not come by
            # name (inline, in its producer's ring). Stop looking ahead for this key until
            # one does again.
            del self._last_lend[ch.key]
            return
        if len(ahead) >= _AHEAD_MAX or len(slots) >= _AHEAD_MAX:
            ahead.clear()
            slots.clear()
        nxt = (task, inc, ticket + (1 << SLOT_BITS))
        try:
            at = (ch.step, ch.key, inc, seq)
            if at not in ahead:
                ahead[at] = names.message(*at)
            if nxt[2] <= MAX_TICKET and nxt not in slots:
                slots[nxt] = (names.held(*nxt), Names.path(names.returned(*nxt)))
        except (RendezvousError, ValueError, TypeError):
            pass  # out of range, or closed: done when needed (and refused there if so)

    def _held_names(self, task: str, inc: int, ticket: int) -> tuple[str, str | None]:
        """The ``held`` name of lend ``ticket`` of ``task``'s run ``inc``, and its ``returned``
        path if ``ahead`` computed it (else None: ``give_back`` computes it)."""
        lend = (task, inc, ticket)
        if self._slot_names:
            found = self._slot_names.pop(lend, None)
            if found is not None:
                return found
        return self._names.held(task, inc, ticket), None

    def take(self, ch: Channel, notice: Notice | None = None) -> Received | BaseException | None:
        """Open the channel's next message by its name, if it is published (under the lock).

        ``notice``: what its producer's ring said of it, if anything; a pool slot mapped
        already is then taken without an open (``_take_kept``).

        None: not published (yet). An exception: that message cannot be used (a file
        another user planted under its name, a corrupt header) and is skipped, or the
        process is out of descriptors (the message stays for the next receive).
        """
        if not ch.inc:
            return None  # the name cannot be computed yet
        self.probes += 1
        name = self._ahead.pop((ch.step, ch.key, ch.inc, ch.seq), None) if self._ahead else None
        if name is None:
            name = self._names.message(ch.step, ch.key, ch.inc, ch.seq)
        maps = self.maps
        if notice is not None and notice.slot >= 0 and notice.array is not None:
            found = maps.find(ch.src.task, ch.inc, notice.slot)
            if found is not None:
                got = self._take_kept(ch, name, notice.slot, notice.array, found[0], found[1])
                if not isinstance(got, _Unsure):
                    return got
        try:
            seg, ident, kept = maps.open(name)
        except FileNotFoundError:
            return None
        except InternalError as e:
            ch.seq += 1  # refused (not ours) or unreadable: never read it, never wait for it
            return e
        except RendezvousError as e:
            return e  # out of descriptors: the message stays where it is
        # Taken now: a stashed notice of it is stale.
        self._book.drop_stashed(ch)
        try:
            header = layout_header.unpack(seg.buf, seg.size)
            if header.key != ch.key or header.seq != ch.seq or header.step_id != ch.step:
                raise InternalError(
                    f"segment {name} holds key {header.key!r} step {header.step_id} "
                    f"seq {header.seq}, expected {ch.key!r} step {ch.step} seq {ch.seq}"
                )
            problem = shape_problem(header.shape, header.dtype.itemsize)
            if problem is not None:
                raise InternalError(f"segment {name} from {ch.src.task}: {problem}")
            # The data's end within the file's size (its fstat of a moment ago, in the
            # checked open) is ``unpack``'s check; ``lend`` / ``ndarray`` check it again.
        except RendezvousError as e:
            seg.unlink_quietly()
            if kept:
                maps.forget(ident)
            else:
                seg.close()
            ch.seq += 1
            return e
        ch.seq += 1
        held: str | None = None
        ret: str | None = None
        if header.slot >= 0:
            held, ret = self._held_names(ch.src.task, header.producer_incarnation, header.slot)
        if held is not None:
            try:
                # From here on the name says "a consumer holds it"; the memory goes back when
                # the array is collected (``pool.return_slot``).
                move_noreplace(seg.path, Names.path(held))
            except OSError as e:
                _log.warning("cannot mark %s as held (%s); it will not return to its pool", name, e)
                held = None
            else:
                mem = seg.buf
                if (
                    self._inc
                    and isinstance(mem, mmap.mmap)
                    and header.data_offset + header.nbytes <= seg.size - CONTROL
                ):
                    hold(mem, self._inc)  # the checked open's fstat saw the file whole
        if held is None:
            seg.unlink_quietly()
            arr = seg.view(header.dtype, header.shape, header.data_offset, header.nbytes)
            if kept:
                maps.forget(ident)
            else:
                seg.close()
        else:
            seg.name = held
            inc = header.producer_incarnation
            arr = self._lend(
                ch,
                seg,
                inc,
                header.slot,
                held,
                ret,
                header.dtype,
                header.shape,
                header.data_offset,
                header.nbytes,
                checked=False,
            )
            maps.keep(seg, ident, ch.src.task, inc, header.slot)
        self._book.count(header.nbytes)
        return Received(arr, header.is_dead)

    def _take_kept(
        self,
        ch: Channel,
        name: str,
        ticket: int,
        array: NoticeArray,
        seg: Segment,
        ident: SlotIdent,
    ) -> Received | BaseException | _Unsure | None:
        """Take the message ``name`` that the producer's ring announced in slot ``ticket``
        (with ``array``, what the ring record said of its array), whose file ``seg`` maps
        already (``SlotMaps.find``): rename it to ``held`` (the name says "a consumer holds
        it" from here on) and check that the file still holds the data (one ``fstat``). The
        header in the file is the record's twin, written by the same producer; the ring
        record was checked when drained. ``_UNSURE`` when a name is in the way: the checked
        open decides then."""
        held, ret = self._held_names(ch.src.task, ch.inc, ticket)
        dtype, shape, offset, nbytes, dead = array
        try:
            # A shrunk file: reading (or noting ourselves in) it would be a SIGBUS.
            seg.check_size(seg.size)
        except RendezvousError:
            return _UNSURE  # the checked open refuses it, and says why
        try:
            move_noreplace(Names.path(name), Names.path(held))
        except FileNotFoundError:
            return None
        except OSError:
            return _UNSURE
        mem = seg.buf
        if self._inc and isinstance(mem, mmap.mmap) and offset + nbytes <= seg.size - CONTROL:
            hold(mem, self._inc)  # after the rename: only the run that took it says so
        self._book.drop_stashed(ch)
        seg.name = held
        ch.seq += 1
        if offset + nbytes > seg.size:
            e = InternalError(
                f"pool slot {name} of {seg.size} bytes cannot hold {nbytes} bytes at {offset}"
            )
            seg.unlink_quietly()
            self.maps.forget(ident)
            return e
        arr = self._lend(
            ch, seg, ch.inc, ticket, held, ret, dtype, shape, offset, nbytes, checked=True
        )
        self.maps.keep(seg, ident, ch.src.task, ch.inc, ticket)
        self._book.count(nbytes)
        return Received(arr, dead)

    def _lend(
        self,
        ch: Channel,
        seg: Segment,
        inc: int,
        ticket: int,
        held: str,
        ret: str | None,
        dtype: Any,
        shape: tuple[int, ...],
        offset: int,
        nbytes: int,
        checked: bool,
    ) -> npt.NDArray[Any]:
        """The array of a message in pool slot ``ticket`` of producer run ``inc``, now named
        ``held`` (``ret``: its ``returned`` path, if known): its own per message, over the
        mapping kept for the slot's next one; its collection gives the slot back (through
        the slot's control block when the file has one and the producer run is watched,
        ``pool.return_slot``)."""
        self.held.add(held)
        last = self._last_lend
        if len(last) >= _KEYS_MAX and ch.key not in last:
            last.clear()
        last[ch.key] = (ch.src.task, inc, ticket, dtype, shape, offset, nbytes)
        mem = seg.buf
        ctl: mmap.mmap | None = None
        watch: RunWatch | None = None
        if isinstance(mem, mmap.mmap) and offset + nbytes <= seg.size - CONTROL:
            ctl = mem
            for r in ch.src.rings:
                if r.inc == inc:
                    watch = r.watch
                    break
        return seg.lend(
            dtype,
            shape,
            offset,
            nbytes,
            return_slot,
            self._names,
            self._producer_alive,
            ch.src.task,
            inc,
            ticket,
            held,
            self.held,
            ctl,
            watch,
            ret,
            checked=checked,
        )

    def unlink_held(self) -> None:
        """Unlink the ``held`` names of arrays this consumer still has (their mappings stay).

        Without this they would outlive the process: the finalizers that give them back do
        not run at exit. Their producers see the slots gone and forget them (``pool``).
        """
        while True:
            try:
                held = list(self.held)  # a finalizer may discard meanwhile
                break
            except RuntimeError:  # pragma: no cover - changed size during the copy
                continue
        for name in held:
            self.held.discard(name)
            try:
                os.unlink(Names.path(name))
            except FileNotFoundError:
                pass
            except OSError as e:
                _log.warning("cannot unlink held pool slot %s: %s", name, e)
