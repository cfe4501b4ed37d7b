"""The consumer's incoming rings: records in, stashed arrivals out.

Every message a producer sends leaves a record in the ring that producer keeps for this
consumer: the tensor itself when small (inline), else a notice "message (step, key, seq)
is published as a segment". Draining a ring therefore leads each arrival straight to its
own channel's stash (``book.py``): no name is opened or probed per channel, nothing is
listed, however many receives are pending (issue 15 §1). A drain made by the scan
(``Consumer.scan``) hands a value that is the very next message of a channel with waiters
to the oldest of them at once, with no stash entry made and taken (``_take_records``).

A ring is attached once (its name unlinked at once: the memory goes when both sides have
unmapped it, whoever dies first) and checked for truncation before each drain; a ring
that fails is released and the receives waiting on its producer get the error.

Thread model (docs/threads.md): every method runs under ``Consumer.lock`` except
``arrived``, a lock-free look at the rings' heads for a spinning poller.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import InternalError, RendezvousError
from .._rendezvous import Received, received
from .._transport import TransportContext
from . import header
from .book import Book, Channel, InRing, Notice, Source, Stash, Stashed
from .delivery import Item
from .files import Segment
from .naming import Names
from .ring import RINGS_SUPPORTED, Ring

__all__ = ["Inbox"]

_log = logging.getLogger("shmrdv.shm")

# How often a consumer looks for a producer's ring that is not there yet.
_RING_LOOK_S = 0.02
_FLAG_NOTICE = header.FLAG_NOTICE
# ``np.ndarray``, without a module attribute lookup per record drained: a view of a
# record's data (then copied).
_ndarray = np.ndarray
# A file's size: ``_file_size(fd, 0, _SEEK_END)`` (a ring's, before it is read: SIGBUS).
_file_size = os.lseek
_SEEK_END = os.SEEK_END

#: ``(producer task, step, key, incarnation, seq, slot)``: free a late notice's segment.
FreeNamed = Callable[[str, int, str, int, int, int], None]


class Inbox:
    """The rings this consumer drains (see the module docstring)."""

    def __init__(
        self,
        ctx: TransportContext,
        names: Names,
        book: Book,
        free_named: FreeNamed,
        retry_s: float,
    ) -> None:
        self._ctx = ctx
        self._names = names
        self._task = ctx.task_name
        self._book = book
        self._free_named = free_named
        self._retry_s = retry_s
        self._headers = header.Reader()
        # What every drain uses, looked up once (the book's tables are never rebound).
        self._drain_state = (
            self._headers.read,
            book,
            book.channels,
            book.stash,
            book.first,
        )
        self._cleaned_up = ctx.cleaned_up
        #: Every attached ring, with its producer.
        self.rings: list[tuple[Source, InRing]] = []
        #: Producers whose ring failed while they had waiters, with the error.
        self.failed: list[tuple[Source, InternalError]] = []
        self.refused_records = 0
        #: Callback (not blocking) waiters handed a value by a drain (``_take_records``),
        #: not yet subtracted from ``Consumer.callback_waiters`` (its caller's job).
        self.handed_callbacks = 0

    # -- attaching ------------------------------------------------------------------

    def look_for_ring(self, src: Source) -> None:
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
            self.attach(self._names.ring(src.task, src.inc, self._task), (src.task, src.inc))
        except RendezvousError as e:
            _log.warning("%s", e)
            src.look_at = now + self._retry_s

    def look_for_old_ring(self, src: Source, inc: int) -> None:
        """A key pinned to an incarnation that is not (or not yet) the live one: attach that
        run's ring if it left one with messages (once per incarnation)."""
        src.tried.add(inc)
        if not RINGS_SUPPORTED:
            return
        try:
            self.attach(self._names.ring(src.task, inc, self._task), (src.task, inc))
        except RendezvousError as e:
            _log.warning("%s", e)

    def attach(self, name: str, expect: tuple[str, int] | None) -> bool:
        """Map a producer's ring for this consumer and unlink its name (the mapping stays:
        the memory goes when both sides have unmapped it, whoever dies first).

        False: no such name. Raises ``InternalError`` for a ring that is not ours or not
        for this consumer (or not from ``expect``, (producer task, incarnation)).
        """
        try:
            seg = Segment.attach(self._names, name, keep_fd=True)
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
        seg.unlink_quietly()
        src = self._book.source_named(owner[0])
        if not src.inc:
            src.inc = owner[1]
        r = InRing(seg, ring, src, owner[1])
        src.rings.append(r)
        src.ring_incs.add(owner[1])
        self.rings.append((src, r))
        self.drain(src, r)
        return True

    # -- draining -------------------------------------------------------------------

    def arrived(self) -> bool:
        """Whether a ring holds records not yet drained: a look at shared memory, without
        the lock and without a system call (what a spinning poller checks between turns,
        right after a ``scan`` checked the rings' sizes)."""
        try:
            for _, r in self.rings:
                if r.ring.pending():
                    return True
        except ValueError:  # a ring failed and released meanwhile: let the scan see to it
            return True
        return False

    def intact(self) -> bool:
        """Whether every attached ring's file still holds it (one ``lseek`` each): lock-free
        like ``arrived``, which a spinning poller may then call (reading a truncated ring's
        words would be a SIGBUS). False also for a ring released meanwhile: the caller
        scans, which fails what is wrong under the lock."""
        try:
            for _, r in self.rings:
                if _file_size(r.fd, 0, _SEEK_END) < r.size:  # one ``lseek`` (``InRing.fd``)
                    return False
        except OSError:
            return False
        return True

    def drain_all(self, check: bool = True, hand: list[Item] | None = None) -> None:
        """``drain`` every ring. With ``hand``, a live value that is the very next message
        of a channel with waiters goes to the oldest waiter at once (appended to ``hand``,
        to deliver after the lock), not through the stash (``_take_records``)."""
        if check:
            for src, r in list(self.rings):
                self.drain(src, r, hand=hand)
            return
        # ``drain`` without its size check written out: every poll of a spinning receiver
        # that found a record comes here (the check was made a moment before the spin).
        for src, r in self.rings:  # (rebound, never changed, by a ring's release)
            try:
                self._take_records(r, hand)
            except RendezvousError as e:
                _log.warning("ring from %s: %s", src.task, e)

    def drain(
        self, src: Source, r: InRing, check: bool = True, hand: list[Item] | None = None
    ) -> None:
        """Take every record waiting in one ring to its channel's stash.

        First its size, one ``lseek`` (unless ``check`` is False: the caller checked it a
        moment ago): a process that kept a descriptor of the ring may have truncated it, and
        reading a lost page would kill this process (SIGBUS). Such a ring is failed:
        unmapped, and the receives waiting on its producer get the ``InternalError``
        (``failed``).
        """
        if check:
            try:
                intact = _file_size(r.fd, 0, _SEEK_END) >= r.size  # one ``lseek``
            except OSError:
                intact = False
            if not intact:
                try:
                    r.segment.check_size(r.size)  # says what is wrong
                except InternalError as e:
                    self._fail_ring(src, r, e)
                    return
                except ValueError as e:  # the mapping was closed
                    self._fail_ring(src, r, InternalError(f"ring unmapped: {e}"))
                    return
        try:
            self._take_records(r, hand)
        except RendezvousError as e:
            _log.warning("ring from %s: %s", src.task, e)

    @staticmethod
    def lost_records(src: Source) -> bool:
        """Whether a ring of ``src`` lost records not recovered yet (``recovery.py``), as of
        the last drain: the ring's words are read only right after a size check."""
        # A loop, not ``any()`` over a generator: this runs once per waiting receive.
        for r in src.rings:  # noqa: SIM110
            if r.lost != r.lost_seen:
                return True
        return False

    def _fail_ring(self, src: Source, r: InRing, e: InternalError) -> None:
        error = InternalError(f"the ring from producer {src.task} is unusable: {e}")
        _log.warning("%s", error)
        self.rings = [(s, x) for s, x in self.rings if x is not r]
        src.rings.remove(r)
        src.ring_incs.discard(r.inc)
        src.look_at = float("inf")  # its name is gone; a restarted producer makes a new one
        r.watch.live = False
        r.fd = -1
        r.ring.release()
        r.segment.close()
        # A producer that saw the truncation itself went on by name: the waiting receives
        # look for their message by name first (``Consumer``), and fail only if it is not
        # there; the next receive of this producer hears of it once (``broken``).
        if src.waiting:
            self.failed.append((src, error))
        else:
            src.broken = error

    def _take_records(self, r: InRing, hand: list[Item] | None = None) -> None:
        """Each record of ring ``r`` to its channel's stash, its channel touched if it has
        waiters; with ``hand``, a live value that is its channel's very next message while
        nothing of that channel is stashed goes to the channel's oldest waiter at once
        (``hand``, and ``handed_callbacks`` counts those that were callback waiters): the
        same waiter, value and order as the stash and ``Consumer._serve`` would give, with
        no stash entry made and taken (the receive of a polling receiver). Raises
        ``InternalError`` for a corrupted ring, once the records before the fault are taken.

        A ring record is the producer's bytes: its header gets ``unpack``'s checks (through
        ``HeaderCache``) and the shared element-count rule (``shape_problem``); a live
        record of a header seen before gets them here, from ``HeaderCache.live``: one
        ``struct`` read, one lookup, one compare and two bounds (no call). A record
        refused for what it says of its array still names its key: its receiver gets the
        ``InternalError``, and what follows in the ring is delivered as usual.

        The hot loop of the receive side, hence one function: what does not change from
        one record to the next (the step's channels and stash, whether the step was
        cleaned up) is looked up once per run of records of one step; per record there is
        the header check and one array copied out of the ring, stashed bare (``Stashed``:
        nothing the garbage collector tracks is kept per pending record). Message 0 of a
        key new to the step makes no ``Channel``: it waits in ``Book.first``, its channel
        idle (the ring in its place), until something needs the channel (``book.py``).
        """
        ring = r.ring
        try:
            spans: list[tuple[int, int]] | None = ring.spans()
        finally:
            r.lost = ring.lost  # (``spans`` reads it first)
        if not spans:
            return
        read, book, channels, stashes, firsts = self._drain_state
        src, inc, buf = r.src, r.inc, r.buf
        waiters = book.waiters
        has_waiters = waiters.has  # (``ch in waiters`` without a Python call)
        touched = book.touched  # (rebound as it is served)
        last_step: int | None = None
        dropped = False
        chans: dict[str, Channel | InRing]
        first: dict[str, Stashed] | None = None
        stash: Stash | None = None
        value: Stashed
        ch: Channel
        while spans:  # batch by batch (``Ring.spans``)
            at = -1
            try:
                for at, end in spans:  # each record is ``buf[at:end]``
                    try:
                        flags, dtype, shape, offset, nbytes, step, seq, _, _, slot, _, key = read(
                            buf, at, end
                        )
                    except RendezvousError as e:
                        refused = self._refused(src, buf[at:end], e)
                        if refused is None:
                            continue
                        step, seq, key, value = refused
                        notice = False
                    else:
                        notice = flags & _FLAG_NOTICE != 0
                        if notice:
                            value = Notice(slot, (dtype, shape, offset, nbytes, bool(flags & 1)))
                        elif nbytes:
                            arr: Any = _ndarray(shape, dtype, buf, at + offset).copy()
                            value = received(arr, True) if flags & 1 else arr
                        else:
                            value = received(np.empty(shape, dtype), bool(flags & 1))
                    if step != last_step:
                        last_step, stash, first = step, None, None
                        dropped = self._cleaned_up(step)
                        if not dropped:
                            got = channels.get(step)
                            chans = channels[step] = {} if got is None else got
                    if dropped:
                        if notice:  # a late send of a step this worker already cleaned up: free it
                            self._free_named(src.task, step, key, inc, seq, slot)
                        continue
                    known = chans.get(key)
                    if known is None:
                        if not seq:  # message 0 of a new key: its channel stays idle
                            chans[key] = r
                            if first is None:
                                first = firsts.get(step)
                                if first is None:
                                    first = firsts[step] = {}
                            first[key] = value
                            continue
                        ch = chans[key] = Channel(step, key, src, inc)
                    elif type(known) is InRing:  # another record of an idle channel's key
                        ch = book.promote(step, key, known)
                    else:
                        ch = known  # type: ignore[assignment]  # not an InRing: a Channel
                    if ch.inc == inc and seq <= ch.seq:
                        if seq < ch.seq:
                            continue  # already taken by its name
                        if (
                            hand is not None
                            and not ch.nready
                            and ch in ch.src.waiting  # it has waiters
                            and (type(value) is _ndarray or type(value) is Received)
                        ):
                            # Its next message, nothing of it stashed, a value (not a
                            # notice, not an error): to its oldest waiter, counted as a
                            # take from the stash counts it (``Book.taken``).
                            value = book.taken(value)
                            ch.seq += 1
                            waiter = waiters.put(ch, value)
                            assert waiter is not None  # (it has waiters)
                            if not waiter.blocking:
                                self.handed_callbacks += 1
                            if not has_waiters(ch):
                                ch.src.waiting.pop(ch, None)
                            hand.append((waiter.done, waiter.copy, value))
                            continue
                    if stash is None:
                        stash = stashes.get(step)
                        if stash is None:
                            stash = stashes[step] = {}
                    stash[(key, inc, seq)] = value
                    ch.nready += 1
                    if ch in ch.src.waiting:  # it has waiters
                        touched.append(ch)
            except BaseException:
                ring.consume(at)  # what came before it is taken; it is found again
                raise
            spans = ring.spans() if ring.consume() else None

    def _refused(
        self, src: Source, payload: memoryview, e: RendezvousError
    ) -> tuple[int, int, str, InternalError] | None:
        """(step, seq, key, the error for its receiver) of a record refused with ``e``, or
        None when the record does not even say whose it is."""
        self.refused_records += 1
        who = header.unpack_identity(payload)
        _log.warning("refusing a record of the ring from %s: %s", src.task, e)
        if who is None:
            return None
        step, seq, key = who
        return (
            step,
            seq,
            key,
            InternalError(
                f"refusing message {seq} of key {key!r} (step {step}) from producer {src.task}: {e}"
            ),
        )

    def retire(self, src: Source, r: InRing) -> None:
        """Unmap the ring of a producer run that is over, once drained (nothing more can
        come through it); that run is then looked for by name only, its ring never again."""
        self.rings = [(s, x) for s, x in self.rings if x is not r]
        src.rings.remove(r)
        src.ring_incs.discard(r.inc)
        src.tried.add(r.inc)
        if src.inc == r.inc:
            src.look_at = float("inf")  # a restarted producer is looked for again (liveness)
        r.watch.live = False  # before what the run left is collected (``pool.RunWatch``)
        r.fd = -1
        r.ring.release()
        r.segment.close()

    # -- lifetime -------------------------------------------------------------------

    def release(self) -> None:
        """Unmap every ring (after the consumer is closed)."""
        for src, r in self.rings:
            r.watch.live = False
            r.fd = -1
            r.ring.release()
            r.segment.close()
            src.rings.clear()
            src.ring_incs.clear()
        self.rings.clear()
