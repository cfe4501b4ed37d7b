"""The receiving half of the same-host transport: the coordinator of its parts.

Each (step, key) is a channel with the next sequence number it expects (``book.py``). A
receive takes that message (``take.py``) from the channel's stash, where the rings put what
arrived (``inbox.py``), or opens it by its name (``named.py``) when its producer has no
ring (not x86-64, or it could not make one); else it queues a waiter. The scan, run by whoever
polls the doorbell (``dispatcher.py``), drains the rings (a value for a channel's oldest
waiter goes to it as it is drained) and serves the channels they brought something else
for; once per tick it also checks the producers that have waiters
(``liveness.py``) and looks for messages a ring cannot show (``recovery.py``: a full ring
lost records, a producer gone). A lost doorbell post costs at most one tick (``TICK``),
never a message. ``cleanup_step`` frees what nobody received (``orphans.py``); the ring
of a producer run that is over is drained a last time and unmapped, and what that run
left goes (``reaper.after_producer``, after the lock).

Thread model (docs/threads.md): every public method takes ``lock`` itself (callers never
hold it); none blocks on a peer or calls a ``done`` callback under it: they return what to
deliver (``delivery.py``), which the caller delivers outside the lock, except
``start_recv``, which delivers a value that is there itself, once the lock is released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .._errors import closed_error
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback, Received, invoke_done
from .._transport import TransportContext
from . import reaper
from .book import Book, Channel, InRing, Notice, Source, Stashed, Waiter
from .delivery import Item, deliver_one
from .inbox import Inbox
from .liveness import Liveness
from .named import NamedMessages
from .naming import Names
from .orphans import Orphans
from .recovery import Recovery
from .take import Taker

__all__ = ["TICK", "Consumer"]

_log = logging.getLogger("shmrdv.shm")

# Liveness and fallback period while receives are pending: bounds the cost of a lost
# doorbell post and the time to notice a dead producer (the issue asks for < 1 s).
TICK = 0.2
# Above this many waiting channels of a ringless producer, one listdir of /dev/shm is
# cheaper than one open() attempt per channel.
_LISTDIR_ABOVE = 64
_INF = float("inf")


def _already_done() -> bool:
    """The canceller of a receive delivered at once: nothing left to cancel."""
    return False


class Consumer:
    """The receiving half of one worker's shared-memory transport (see the module docstring)."""

    def __init__(
        self, ctx: TransportContext, names: Names, on_callback_waiter: Callable[[], None]
    ) -> None:
        self._task = ctx.task_name
        self._wake_dispatcher = on_callback_waiter
        self.lock = threading.Lock()
        self._closed = False
        self._aborted: dict[int, BaseException] = {}
        #: Whether ``check_open`` may raise (closed, or a step aborted): a look at this
        #: flag spares the call on the hot path.
        self.refusing = False
        self._book = book = Book()
        self._waiters = book.waiters
        self._live = Liveness(ctx, TICK)
        self._named = NamedMessages(names, book, self._live.producer_alive, ctx.incarnation)
        self._inbox = Inbox(ctx, names, book, self._free_named, TICK)
        self._recovery = Recovery(ctx, names, book, self._inbox, TICK)
        self._orphans = Orphans(ctx, names, self._recovery.listing, self._live.producer_alive)
        #: ``Taker.take``: the channel's next message, if it is there.
        self._take = Taker(book, self._inbox, self._recovery, self._named).take
        #: A lock-free look at the rings' heads (what the dispatcher's spin calls).
        self.arrived = self._inbox.arrived
        #: A lock-free size check of the rings (before a spin reads their heads).
        self.rings_intact = self._inbox.intact
        #: Number of queued callback (non-blocking) waiters: the dispatcher runs while > 0.
        self.callback_waiters = 0
        self._tick_at = 0.0
        self._sweep_at = 0.0
        self._scans = 0
        self._names = names
        # (producer task, incarnation) of runs that are over and whose ring this consumer
        # drained and unmapped: what they left goes, outside the lock (``scan``).
        self._over: list[tuple[str, int]] = []

    def _free_named(self, src: str, step: int, key: str, inc: int, seq: int, slot: int) -> None:
        self._orphans.free_named(src, step, key, inc, seq, slot)

    # -- receives ---------------------------------------------------------------------

    def check_open(self, step: int) -> None:
        if self._closed:
            raise closed_error(self._task)
        if self._aborted:
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
        """``Transport.start_recv``: take the next value now, or queue a waiter (the
        canceller removes it). A value that is there is delivered here, after the lock
        (``deliver_one``; a blocking receive's ``done`` is its slot's, which never raises,
        and is called directly)."""
        book = self._book
        got: Stashed | None = None
        result: Received | BaseException | None = None
        waiter = None
        first = False
        lock = self.lock
        lock.acquire()
        try:
            if self._closed or self._aborted:
                self.check_open(step_id)
            full = key.full_key
            chans = book.channels.get(step_id)
            known = chans.get(full) if chans is not None else None
            if known is None:
                ch = book.channel(step_id, full, book.source(key), key.src_incarnation)
            elif type(known) is InRing:
                # An idle channel (``book.py``): its message 0 is taken here if it is a
                # value for this receive, with no ``Channel`` made (the ring stays in its
                # place: the channel now expects message 1); else it gets its channel.
                pinned = key.src_incarnation
                if known.src.broken is None and (not pinned or pinned == known.inc):
                    firsts = book.first[step_id]
                    got = firsts.pop(full, None)
                    if type(got) is Notice:  # opened by its name (``_first_look``)
                        firsts[full] = got
                        got = None
                    if got is not None:
                        result = book.taken(got)
                        if known.where or known.spilled:
                            known.done(step_id, full, 0)
                ch = None
                if result is None:
                    ch = book.promote(step_id, full, known)
            else:
                ch = known  # type: ignore[assignment]  # not an InRing: a Channel
            if ch is not None:
                if ch.pk is None:
                    ch.pk = key
                    if key.src_incarnation:
                        ch.inc = key.src_incarnation
                src = ch.src
                # ``src.waiting`` holds exactly the channels with waiters (a dict: no call).
                waiting = ch in src.waiting
                if ch.nready and not waiting and src.broken is None and ch.inc:
                    # The fast path: a ring brought this very message already (no ring to
                    # look for, nothing to drain first: what follows it stays in its ring).
                    # Written out here: the hot path of a receive whose value is there.
                    stash = book.stash.get(step_id)
                    got = stash.pop((ch.key, ch.inc, ch.seq), None) if stash is not None else None
                    if type(got) is Notice:  # opened by its name, with a lookup (``_first_look``)
                        stash[(ch.key, ch.inc, ch.seq)] = got  # type: ignore[index]  # not None
                        got = None
                    if got is not None:
                        if not stash:
                            del book.stash[step_id]
                        ch.nready -= 1
                        book.done(ch, ch.seq)
                        ch.seq += 1
                        result = book.taken(got)
                if result is None:
                    if not waiting:
                        # Whether ``_first_look`` would find nothing: no ring to look for,
                        # this producer's ring attached and nothing lost (``lost_records``
                        # written out), nothing stashed, the producer seen alive.
                        quiet = (
                            ch.seen_alive
                            and not ch.nready
                            and src.look_at == _INF
                            and src.broken is None
                            and (ch.inc or src.inc) in src.ring_incs
                        )
                        if quiet:
                            for r in src.rings:
                                if r.lost != r.lost_seen:
                                    quiet = False
                                    break
                        if not quiet:
                            result = self._first_look(ch, src)
                    if result is None:
                        waiter = Waiter(done, copy, ch, blocking)
                        if self._waiters.wait(ch, waiter):
                            src.waiting[ch] = None
                        if ch.seen_alive:
                            src.was_alive = True
                        else:
                            src.unseen.append(ch)
                        if not blocking:
                            self.callback_waiters += 1
                            first = self.callback_waiters == 1
                        self._named.ahead(ch)  # idle time: what its next message needs
        finally:
            lock.release()
        if waiter is not None:
            if first:
                self._wake_dispatcher()  # it sleeps while no callback receive is pending
            return lambda: self.cancel(waiter)
        del got
        if type(result) is Received and not copy:
            if blocking:
                done(None, result)
            else:
                invoke_done(done, None, result)
        else:
            deliver_one(done, copy, result)  # type: ignore[arg-type]  # not None here
        return _already_done

    def _first_look(self, ch: Channel, src: Source) -> Received | BaseException | None:
        """What a receive that would be its channel's first waiter finds before it waits."""
        inbox = self._inbox
        look_at = src.look_at  # (infinite once its ring is attached: no clock read then)
        if look_at != _INF and look_at <= time.monotonic():
            inbox.look_for_ring(src)
        if ch.inc and ch.inc not in src.ring_incs and ch.inc not in src.tried:
            inbox.look_for_old_ring(src, ch.inc)
        # Rings are drained by whoever polls (``scan``), right after checking their size
        # (reading a truncated ring's words would be a SIGBUS); a take that would skip a
        # sequence number drains them first (``Taker.take``).
        result = self._take(ch, (ch.inc or src.inc) not in src.ring_incs)  # (``_probe``)
        if result is None and src.broken is not None:
            result, src.broken = src.broken, None
        if result is None and not ch.seen_alive:
            # Note now whether the producer is alive (so that its death is noticed even
            # before the first tick), or fail a stale incarnation.
            result = self._live.failure(ch, self._live.state(src))
        return result

    def cancel(self, waiter: Waiter) -> bool:
        """Remove a queued waiter: True if it was still queued (its ``done`` never runs)."""
        with self.lock:
            ch = waiter.channel
            if not self._waiters.cancel(ch, waiter):
                return False
            self._unqueued(waiter)
            if ch not in self._waiters:
                self._unwait(ch)
            return True

    @staticmethod
    def _probe(ch: Channel) -> bool:
        """Whether the channel's messages must be looked for by name: no ring of that
        producer incarnation is attached (a ringless producer, or not known yet)."""
        return (ch.inc or ch.src.inc) not in ch.src.ring_incs

    def _unqueued(self, waiter: Waiter) -> None:
        if not waiter.blocking:
            self.callback_waiters -= 1

    @staticmethod
    def _unwait(ch: Channel) -> None:
        ch.src.waiting.pop(ch, None)

    def _serve(self, ch: Channel, out: list[Item], probe: bool) -> None:
        """Hand the channel's waiters what is there for them."""
        has = self._waiters.has
        waiters = self._waiters
        while has(ch):
            result = self._take(ch, probe)
            if result is None:
                return
            waiter = waiters.put(ch, result)  # the oldest waiter (there is one)
            assert waiter is not None
            if not waiter.blocking:  # ``_unqueued`` written out (once per delivery)
                self.callback_waiters -= 1
            out.append((waiter.done, waiter.copy, result))
        ch.src.waiting.pop(ch, None)  # ``_unwait``

    def _fail(self, ch: Channel, out: list[Item], failure: BaseException) -> None:
        waiters = self._waiters
        while ch in waiters:
            waiter = waiters.put(ch, failure)
            assert waiter is not None
            self._unqueued(waiter)
            out.append((waiter.done, waiter.copy, failure))
        self._unwait(ch)

    def _fail_all(
        self, where: Callable[[Channel], bool] | None, error: BaseException
    ) -> list[Item]:
        items: list[Item] = []
        chans = list(self._waiters) if where is None else [c for c in self._waiters if where(c)]
        for waiter in self._waiters.abort(where):
            self._unqueued(waiter)
            items.append((waiter.done, waiter.copy, error))
        for ch in chans:
            self._unwait(ch)
        return items

    # -- the scan (run by whoever polls the doorbell) ---------------------------------

    def scan(self, check: bool = True, posted: bool = True) -> list[Item]:
        """Drain the rings, serve the channels they brought something for; per doorbell
        post, look for the messages of producers without a ring (by name); once per tick,
        check the producers that have waiters (liveness, ringless ones by name).

        ``check=False``: the rings' sizes were checked a moment ago (before a spin on
        their heads); they are not checked again. ``posted=False``: no post was taken (a
        spin saw a ring's head move), so no look by name.
        """
        out: list[Item] = []
        with self.lock:
            if self._closed:
                return out
            self._scans += 1
            try:
                # One function with its lock: the poll of every blocked receive runs it.
                # A value that is the next message of a channel with waiters goes to its
                # oldest waiter as it is drained (``out``), not through the stash.
                inbox = self._inbox
                inbox.drain_all(check, out)
                if inbox.handed_callbacks:
                    self.callback_waiters -= inbox.handed_callbacks
                    inbox.handed_callbacks = 0
                if self._book.touched:  # (``_serve_touched`` looks too: a call spared)
                    self._serve_touched(out)
                if inbox.failed:
                    self._serve_failed(out)
                if posted and self._waiters.size():
                    self._probe_ringless(out)
                now = time.monotonic()
                if now >= self._sweep_at:  # (the time first: counting the maps is a call)
                    self._sweep_at = now + TICK
                    maps = self._named.maps
                    if maps:
                        maps.sweep()
                if now >= self._tick_at:
                    self._tick_at = now + TICK
                    if self._waiters.size():
                        for src in list(self._book.srcs.values()):
                            if src.waiting:
                                self._tick(src, out)
                        self._serve_touched(out)
                        self._serve_failed(out)
                    self._retire_over()
                    self._serve_touched(out)  # what the last drains of those rings brought
            except Exception:  # pragma: no cover - keep polling whatever happens
                _log.exception("shm dispatcher of %s: scan failed", self._task)
                # What was handed or served before the fault is delivered: those waiters
                # are out of the table already (a blocked receive would wait for ever).
                return out
            over = None
            if self._over:  # (a new list only when there is something to collect)
                over, self._over = self._over, []
        if over is not None:
            for task, inc in over:
                self._collect(task, inc)
        return out

    def _collect(self, task: str, inc: int) -> None:
        """Free what a producer run that is over left (``reaper.after_producer``): this
        consumer took every record of its ring and unmapped it (a bounded listing and
        unlinks, the rest in the background: never under the lock)."""
        reaper.after_producer(self._names, task, inc, self._task)

    def _retire_over(self) -> None:
        """Once per tick: the rings of producer runs that are over are drained a last time
        and unmapped, and what those runs left is collected after the lock (``_over``)."""
        inbox = self._inbox
        for src, r in list(inbox.rings):
            if r not in src.rings or not self._live.run_over(src, r.inc):
                continue
            inbox.drain(src, r)  # what it sent before it ended (its size checked first)
            if r in src.rings and not r.ring.pending():
                inbox.retire(src, r)
                self._over.append((src.task, r.inc))

    def _serve_touched(self, out: list[Item]) -> None:
        book = self._book
        has = self._waiters.has
        while book.touched:
            touched, book.touched = book.touched, []
            for ch in touched:
                if has(ch):  # (``_probe(ch)`` written out)
                    src = ch.src
                    self._serve(ch, out, (ch.inc or src.inc) not in src.ring_incs)

    def _serve_failed(self, out: list[Item]) -> None:
        """Serve by name the channels of producers whose ring failed, else fail them."""
        failed = self._inbox.failed
        while failed:
            src, error = failed.pop()
            for ch in list(src.waiting):
                self._serve(ch, out, probe=True)
                if ch in src.waiting:
                    self._fail(ch, out, error)

    def _tick(self, src: Source, out: list[Item]) -> None:
        """Once per tick for a producer with waiters: its ring, its messages by name if it
        has no ring (or lost records), its liveness."""
        inbox = self._inbox
        if not src.rings or src.look_at <= time.monotonic():
            inbox.look_for_ring(src)
        for r in list(src.rings):
            inbox.drain(src, r)  # also checks its size once per tick
        if inbox.lost_records(src):
            self._recovery.recover(src)
        if not src.inc or src.tried:
            for ch in self._recovery.find_gone(src):
                self._serve(ch, out, probe=True)
        if not src.waiting:
            return
        dead, failures = self._live.verdicts(src)
        for ch, failure in failures:
            if dead:
                # What the producer published before it died is visible now: deliver it.
                self._serve(ch, out, probe=True)
            self._fail(ch, out, failure)

    def _probe_ringless(self, out: list[Item]) -> None:
        """Per doorbell wake-up: the waiting channels of known producers without a ring
        are looked for by name (the fallback path: O(their channels), or one listing when
        they are many)."""
        for src in self._book.srcs.values():
            if not src.waiting or not src.inc or src.inc in src.ring_incs:
                continue
            chans = [c for c in src.waiting if self._probe(c)]
            if len(chans) > _LISTDIR_ABOVE:
                chans = self._recovery.published(chans)  # then open only the names there
            for ch in chans:
                self._serve(ch, out, probe=True)

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> list[Item]:
        with self.lock:
            self._aborted.setdefault(step_id, error)
            self.refusing = True
            error = self._aborted[step_id]
            return self._fail_all(lambda ch: ch.step == step_id, error)

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; free the unreceived messages addressed to this worker in it."""
        book = self._book
        with self.lock:
            self._inbox.drain_all()
            unreceived = book.forget_step(step_id)
            self._aborted.pop(step_id, None)
            self.refusing = self._closed or bool(self._aborted)
        self._orphans.free_unreceived(step_id)
        del unreceived

    def close(self) -> list[Item]:
        """Fail every waiter (returned, to deliver); the caller then calls ``release``."""
        with self.lock:
            if self._closed:
                return []
            self._closed = self.refusing = True
            return self._fail_all(None, closed_error(self._task))

    def release(self) -> None:
        """Unlink the held names, unmap the rings (after ``close``); collect what producer
        runs that are over left (slots given back to them after their close, which a live
        ``pool.RunWatch`` let go unchecked: nobody else would free those), unless their
        ring holds records not taken: those stay for this task's next process, and the run's
        leftovers with them."""
        self._named.unlink_held()
        over: list[tuple[str, int]] = []
        with self.lock:
            for src, r in self._inbox.rings:
                src.alive_at = -1.0  # a fresh look, not the tick's
                if self._live.run_over(src, r.inc) and self._inbox.all_taken(r):
                    over.append((src.task, r.inc))
            self._inbox.release()
            self._named.maps.close()
            self._book.stash.clear()
            self._book.first.clear()
        for task, inc in over:
            self._collect(task, inc)

    @property
    def pending(self) -> int:
        return len(self._waiters)

    def stats(self) -> dict[str, int]:
        with self.lock:
            book, named = self._book, self._named
            return {
                "received": book.received,
                "received_bytes": book.received_bytes,
                "dispatcher_scans": self._scans,
                "name_probes": named.probes,
                "refused_records": self._inbox.refused_records,
                "pending_keys": len(self._waiters),
                "pending_receives": self._waiters.pending_waiters,
                "channels": sum(len(c) for c in book.channels.values()),
                "rings_in": len(self._inbox.rings),
                "held": len(named.held),
                "slots_mapped": len(named.maps),
                "slot_map_hits": named.maps.hits,
                "listings": self._recovery.listing.listings,
            }
