"""A consumer's rings and names: what the drain does not see, found; what a ring cannot
keep, moved out (``spill``). Names are the truth. A ring (``InRing``) is attached once per
producer run. Messages with no record are found by a ``Listing``: other users can plant
any number of names under the job's prefix, so it is rate-limited, skipped while the
directory is unchanged, and a name new to it costs one ``lstat``, at most
``_NEW_PER_LISTING`` per listing, and never another.

Thread model (docs/threads.md): under the consumer's lock, except ``free_unreceived``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._cluster import canonical_task
from .._errors import InternalError, RendezvousError
from .._keys import parse_key
from .._transport import TransportContext
from .files import Segment, inode, is_ours, move_noreplace, peek_header
from .header import Header, is_notice, unpack_identity
from .naming import SHM_DIR, Names, parse_name
from .pool import ProducerAlive, RunWatch, give_back
from .ring import RINGS_SUPPORTED, Ring

if TYPE_CHECKING:
    from .._rendezvous import Received
    from .consumer import Channel, Consumer, Source

__all__ = ["UNKNOWN_SLOT", "Held", "InRing", "Listing", "Notice", "Recovery"]

_log = logging.getLogger("shmrdv.shm")

# Names a listing found unusable are remembered, up to this many, and skipped without a
# system call afterwards: a flood of planted names costs one ``lstat`` each, once.
_REFUSED_MAX = 1 << 17
# Names new to the consumer looked at per listing; seconds between listings, and between
# looks for a producer's ring that is not there yet.
_NEW_PER_LISTING = 32768
_LIST_EVERY, _RING_LOOK_S = 0.1, 0.02
_FILL_MAX = 1 << 16  # a gap in a channel's sequence numbers: names looked at, at most
UNKNOWN_SLOT = -2  # a notice of a message found by name: a pool slot or not, its header says
# A listing is trusted to be complete only if the directory's mtime was at least this
# old when it was taken: the kernel stamps changes with a coarse clock.
_TRUST_NS = 20_000_000
_INF = float("inf")


class Listing:
    """The names under ``prefix`` in ``directory``, listed again only when its mtime changed,
    at most every ``min_interval`` s (a quarter of that rate while nothing is new), without
    the ``refuse``d names. Not thread-safe."""

    def __init__(self, prefix: str, min_interval: float, directory: str = SHM_DIR) -> None:
        self._prefix, self._dir, self._interval = prefix, directory, min_interval
        self._gap = min_interval  # the current least time between two listdirs
        self._at = -4 * min_interval  # monotonic time of the last listdir
        self._mtime = -1  # the directory's mtime at that listing, if trusted, else -1
        #: The names of the last listing (prefix matched, refused ones left out), and its
        #: number: a user compares it to skip names it has seen.
        self.names: list[str] = []
        self.generation = self.listings = 0
        self._refused: set[str] = set()

    def refresh(self) -> bool:
        """Make ``names`` current if allowed: whether they are (False: a listing is due but
        rate-limited, or failed)."""
        try:
            mtime = os.stat(self._dir).st_mtime_ns
        except OSError:
            return False
        if mtime == self._mtime:
            return True
        now = time.monotonic()
        if now - self._at < self._gap:
            return False
        self._at = now
        try:
            entries = os.listdir(self._dir)
        except OSError:
            return False
        self.listings += 1
        self._mtime = mtime if time.time_ns() - mtime >= _TRUST_NS else -1
        refused = self._refused
        if len(refused) > _REFUSED_MAX // 2:
            refused.intersection_update(entries)  # forget the names that are gone
        fresh = set(entries)
        fresh -= refused  # in C: a flood of refused names costs no Python per name
        names = [e for e in fresh if e.startswith(self._prefix)]
        if set(names) <= set(self.names):  # nothing new: the directory churns for nothing
            self._gap = min(2 * self._gap, 4 * self._interval)
        else:
            self._gap = self._interval
        self.names = names
        self.generation += 1
        return True

    def refuse(self, name: str) -> None:
        """Leave the unusable ``name`` out of every later listing (up to a bound)."""
        if len(self._refused) < _REFUSED_MAX:
            self._refused.add(name)

    def refused(self, name: str) -> bool:
        return name in self._refused

    def incomplete(self) -> None:
        """Names were left unexamined: list again when next allowed."""
        self._mtime = -1


class Notice:
    """A queued message that is the segment of its name (``array``: as its record said)."""

    __slots__ = ("array", "inc", "seq", "slot")

    def __init__(self, seq: int, inc: int, slot: int, array: tuple[Any, ...] | None = None) -> None:
        self.seq, self.inc, self.slot, self.array = seq, inc, slot, array


class Held:
    """A queued value a ring record brought: the record stays in ring ``r`` (the task's
    durable copy) until the value is taken or freed."""

    __slots__ = ("pos", "r", "value")

    def __init__(self, value: Received | Notice | BaseException, r: InRing, pos: int) -> None:
        self.value, self.r, self.pos = value, r, pos


@dataclass(eq=False, slots=True)
class InRing:
    """A producer run's ring for this consumer, attached."""

    segment: Segment
    ring: Ring
    src: Source
    inc: int
    fd: int = field(init=False)  # the segment's, kept for ``intact``
    size: int = field(init=False)
    watch: RunWatch = field(default_factory=RunWatch)  # live while attached
    lost: int = 0  # records its producer could not append
    lost_seen: int = 0  # of those, recovered
    moved: int = 0  # records this process moved out of it (``Recovery.spill``)
    # The segments records moved out to, by the record's position, until taken ("" for a
    # notice: its message is one already).
    spilled: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fd, self.size = self.segment.fd, self.segment.size

    def intact(self) -> bool:
        """Whether its file still holds it (one ``lseek``): a process that kept a descriptor
        may have truncated it, and a lost page is a SIGBUS."""
        try:
            return self.fd >= 0 and os.lseek(self.fd, 0, os.SEEK_END) >= self.size
        except OSError:
            return False

    def taken(self, pos: int) -> None:
        """The value of its record at ``pos`` is taken or freed: mark it in the ring, or
        remove the segment the record moved out to."""
        if self.spilled:
            path = self.spilled.pop(pos, None)
            if path is not None:
                if path:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                return
        if self.intact():
            self.ring.taken(pos)

    def release(self) -> None:
        self.watch.live = False
        self.fd = -1
        self.ring.release()
        self.segment.close()


class Recovery:
    """The rings and listings of one consumer (see the module docstring)."""

    def __init__(
        self, ctx: TransportContext, names: Names, consumer: Consumer, alive: ProducerAlive
    ) -> None:
        self._ctx = ctx
        self._alive = alive
        self._names = names
        self._consumer = consumer
        self._own = ctx.task.task_key()
        self.listing = Listing(names.prefix, _LIST_EVERY)
        self._listed: dict[str, Header] = {}  # published messages a listing looked at
        self._listed_gen = self._rings_gen = -1  # the listing generations they reflect

    def _learn_run(self, src: Source) -> bool:
        """Note ``src``'s live run from its presence record; False if it cannot be trusted."""
        try:
            record = self._ctx.peers.lookup(src.dev)
        except RendezvousError as e:  # a record that is not ours, or corrupt
            _log.warning("presence record of %s: %s", src.task, e)
            return False
        if record.final and record.incarnation:
            src.inc = record.incarnation
        return True

    def _sender(self, key: str) -> str | None:
        """The producer task of ``key`` if it is addressed to this worker, else None."""
        try:
            pk = parse_key(key)
            return str(canonical_task(pk.src)) if pk.dst.task_key() == self._own else None
        except RendezvousError:
            return None

    def look_for_ring(self, src: Source, force: bool = False) -> None:
        """Attach the ring of ``src``'s current run if it is there (at most every
        ``_RING_LOOK_S``, unless ``force``)."""
        if not RINGS_SUPPORTED:
            src.look_at = _INF
            return
        now = time.monotonic()
        if src.look_at > now and not force:
            return
        src.look_at = now + _RING_LOOK_S
        if not src.inc:
            self._learn_run(src)
            if not src.inc:
                return
        if src.inc in src.ring_incs:
            src.look_at = _INF  # until the producer restarts
        elif not self.attach_run(src, src.inc):
            src.look_at = now + _LIST_EVERY * 2

    def attach_run(self, src: Source, inc: int) -> bool:
        """Attach the ring of ``src``'s run ``inc`` if it is there; False if it is refused."""
        try:
            self.attach(self._names.ring(src.task, inc, self._ctx.task_name), (src.task, inc))
        except RendezvousError as e:
            _log.warning("%s", e)
            return False
        return True

    def attach(self, name: str, expect: tuple[str, int] | None) -> bool:
        """Map a producer's ring for this consumer, once per run, to be drained from its
        oldest record not taken; False if there is none. ``InternalError`` for a ring not
        ours, not for this consumer, or not from ``expect`` (task, incarnation)."""
        try:
            seg = Segment.attach(self._names, name, keep_fd=True)
        except FileNotFoundError:
            return False
        ring: Ring | None = None
        try:
            ring = Ring(memoryview(seg.buf))
            meta = json.loads(ring.meta())
            owner = (str(meta["producer"]), int(meta["incarnation"]))
            if meta["consumer"] != self._ctx.task_name or (expect is not None and owner != expect):
                raise InternalError(f"ring {name} is {meta}, not for {self._ctx.task_name}")
            if not owner[1]:
                raise InternalError(f"ring {name} names incarnation 0")
        except (RendezvousError, ValueError, KeyError, TypeError) as e:
            if ring is not None:
                ring.release()
            seg.close()
            raise InternalError(f"refusing ring {name}: {e}") from e
        src = self._consumer.source(owner[0])
        if owner[1] in src.ring_incs or owner[1] in src.retired:
            ring.release()
            seg.close()
            return True
        if not src.inc:
            src.inc = owner[1]
        ring.attach(self._ctx.incarnation)
        self._consumer.adopt(InRing(seg, ring, src, owner[1]))
        return True

    def free(self, task: str, step: int, key: str, inc: int, seq: int, slot: int) -> None:
        """Free a message nobody will receive (never under the lock): unlink its segment, or
        give its pool slot back."""
        path = Names.path(self._names.message(step, key, inc, seq))
        if slot == UNKNOWN_SLOT:  # a message found by name: its header says
            header = peek_header(path)
            slot = header.slot if header is not None else -1
        if slot >= 0:
            give_back(self._names, self._alive, task, inc, slot, path)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def needed(self) -> bool:
        """Whether messages may have come with no ring record: a producer without a ring, or
        a ring that lost records (not those this process moved out)."""
        if not RINGS_SUPPORTED:
            return True
        for s in self._consumer.srcs.values():  # (per cleanup: loops, not generators)
            if not s.rings:
                return True
            for r in s.rings:
                if r.lost > r.moved:
                    return True
        return False

    def recover(self, src: Source) -> None:
        """Queue the messages of ``src`` whose records its full rings lost (one listing),
        after what its rings hold: they are drained after the listing, and a producer writes
        a key's earlier records before it publishes a later message by name."""
        consumer = self._consumer
        lost = [(r, r.lost) for r in src.rings if r.lost != r.lost_seen]
        if not lost or not self._list_messages():
            return
        for r, n in lost:
            consumer.drain(r)
            r.lost_seen = n
        incs = {r.inc for r in src.rings}
        for h in sorted(self._listed.values(), key=lambda h: h.seq):
            step, key, seq, inc = h.step_id, h.key, h.seq, h.producer_incarnation
            if inc not in incs or self._ctx.cleaned_up(step):
                continue
            ch = consumer.find(step, key)
            if ch is not None and (ch.inc not in (0, inc) or seq < ch.seq):
                continue
            if self._sender(key) != src.task:
                continue
            ch = consumer.channel(step, key, src, inc)
            ch.inc, ch.seq = inc, seq + 1
            consumer.queue(ch, Notice(seq, inc, h.slot))

    def find_gone(self, src: Source) -> list[Channel]:
        """The waiting channels of ``src`` whose next message a listing shows (their run is
        unknown, or pinned to an earlier one), their run set. O(messages listed)."""
        if RINGS_SUPPORTED:
            self.find_rings()
        self._list_messages()
        out = []
        for h in self._listed.values():
            ch = self._consumer.find(h.step_id, h.key)
            if ch is None or ch.src is not src or ch not in src.waiting or ch.seq != h.seq:
                continue
            if ch.inc in (0, h.producer_incarnation):
                ch.inc = h.producer_incarnation
                out.append(ch)
        return out

    def published(self, chans: list[Channel]) -> list[Channel]:
        """Those of ``chans`` whose next message a listing shows."""
        self._list_messages()
        there = {(h.step_id, h.key, h.seq, h.producer_incarnation) for h in self._listed.values()}
        return [c for c in chans if (c.step, c.key, c.seq, c.inc) in there]

    def resolve_incarnation(self, ch: Channel) -> None:
        """Find the run of the channel's producer: its presence record, else (gone, or not
        started) its ring, or the newest listed message for the channel's next receive."""
        src = ch.src
        if not src.inc and not self._learn_run(src):
            return
        if src.inc:
            ch.inc = src.inc
            return
        if RINGS_SUPPORTED:
            self.find_rings()
            if ch.inc:
                return  # a ring of it was attached and brought the channel's message
        self._list_messages()
        newest = -1
        for h in self._listed.values():
            if (h.step_id, h.seq, h.key) == (ch.step, ch.seq, ch.key) and h.created_ns > newest:
                ch.inc, newest = h.producer_incarnation, h.created_ns

    def find_rings(self) -> None:
        """Attach the rings to this worker a listing shows (of a producer that closed before
        its run was known here), each name tried once."""
        listing = self.listing
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
                if self.attach(name, None):
                    listing.refuse(name)  # attached (once per run of its producer): done with
            except InternalError as e:  # not ours, or not for this consumer: never again
                listing.refuse(name)
                _log.debug("%s", e)
            except RendezvousError as e:
                _log.debug("%s", e)

    def fill(self, ch: Channel, seq: int, r: InRing) -> None:
        """Queue messages ``ch.seq`` to ``seq - 1`` (no ring record; only the last ``r.lost``
        can be there) as notices of the names there: opened when taken, not held open."""
        for s in range(max(ch.seq, seq - min(r.lost, _FILL_MAX)), seq):
            if inode(Names.path(self._names.message(ch.step, ch.key, r.inc, s))) is not None:
                ch.seq = s + 1
                self._consumer.queue(ch, Notice(s, r.inc, UNKNOWN_SLOT))
        ch.seq = seq

    def spill(self, r: InRing, before: int) -> None:
        """Move the oldest held records of ring ``r`` read before position ``before`` out to
        their messages' names until those left take at most a quarter of it (a key nobody
        receives must not leave its producer without room; what a drain just read is about
        to be taken), each counted in the ring first: the task's next process looks for it."""
        ring, held = r.ring, r.ring.held
        while held and held[0] < before and ring.read - held[0] > ring.capacity >> 2:
            pos = held[0]
            payload = ring.record(pos)
            try:
                path = "" if is_notice(payload) else self._publish(r.inc, payload)
            except RendezvousError as e:
                _log.warning("cannot move a record of the ring from %s out: %s", r.src.task, e)
                break
            finally:
                payload.release()
            r.spilled[pos] = path
            ring.add_spilled(1)
            r.moved += 1
            r.lost += 1  # (as the next drain reads it; its value is queued here:
            r.lost_seen += 1  # not to be looked for by name)
            ring.taken(pos)

    def _publish(self, inc: int, payload: memoryview) -> str:
        """Publish ``payload`` (a checked ring record of producer run ``inc``) under its
        message's name; its path. Raises ``RendezvousError``."""
        who = unpack_identity(payload)
        if who is None:  # pragma: no cover - the drain read this header
            raise InternalError("a ring record names no message")
        step, seq, key = who
        path = Names.path(self._names.message(step, key, inc, seq))
        seg = Segment.create(self._names, len(payload))
        try:
            seg.buf[: len(payload)] = payload
            move_noreplace(seg.path, path)
        except BaseException as e:
            seg.unlink_quietly()
            seg.close()
            if isinstance(e, OSError):
                raise InternalError(f"cannot publish {path}: {e}") from e
            raise
        seg.close()
        return path

    def _list_messages(self) -> bool:
        """Bring ``_listed`` up to date with the listing; False if it may be stale."""
        listing = self.listing
        if not listing.refresh():
            return False
        if self._listed_gen == listing.generation:
            return True
        self._listed_gen = listing.generation
        marker = self._names.prefix + "m"
        present = {e for e in listing.names if e.startswith(marker)}
        self._listed = listed = {n: h for n, h in self._listed.items() if n in present}
        new = [e for e in present if e not in listed]
        if len(new) > _NEW_PER_LISTING:
            del new[_NEW_PER_LISTING:]
            listing.incomplete()
        for name in new:
            h = self._peek(name)
            if h is not None:
                listed[name] = h
        return True

    def _peek(self, name: str) -> Header | None:
        h = peek_header(Names.path(name))
        if h is None:
            self.listing.refuse(name)
        return h

    def free_unreceived(self, step_id: int) -> None:
        """Free the messages of ``step_id`` addressed to this worker that a listing shows
        (after the lock: a listdir and a few opens)."""
        try:
            entries = os.listdir(SHM_DIR)
        except OSError:
            return
        marker, listing = self._names.prefix + "m", self.listing
        for entry in entries:
            if not entry.startswith(marker) or listing.refused(entry) or parse_name(entry) is None:
                continue
            h = self._peek(entry)
            if h is None or h.step_id != step_id:
                continue
            task = self._sender(h.key)
            if task is not None:
                self.free(task, step_id, h.key, h.producer_incarnation, h.seq, h.slot)
