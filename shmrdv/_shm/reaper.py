"""What dead workers left in /dev/shm, collected without anyone running ``gc`` (issue 20 §1).

A worker killed by SIGKILL, SIGTERM or the OOM killer runs no cleanup: its presence
record, doorbell, pool slots, rings and unreceived messages stay in /dev/shm, and a
service that restarts workers fills it. Python's ``resource_tracker`` and iceoryx2 clean
up after dead processes; so does shmrdv, in two places:

* ``sweep()`` runs when a Worker starts (after its presence record is published) and when
  it closes (after its record is gone). It collects from the namespaces of this user in
  which no worker is alive, by ``gc``'s rule and with its checks (``registry``): a
  namespace is dead only while none of its presence records is locked, checked again just
  before its objects go; only regular files of ours are removed, never through a symlink,
  only if still the file listed, and only if no process has it open or mapped
  (``registry.unlink_if_unused``). Records, doorbells, pool slots and half-written
  segments go at once. Messages and rings may be for a consumer that has not started yet
  (a producer may send and close first): they wait until ``GRACE_S`` after the newest value
  still waiting in the namespace was sent (the time its producer wrote in its header, not
  a file time: tmpfs does not update mtime for writes through a mapping), unless they are
  addressed to the worker whose close runs the sweep (its own, which it will never take).
  ``SHMRDV_AUTO_GC=0`` turns sweeps off (to look at what a crashed job left, with
  ``shmrdv ls``).
* ``collect_producer()`` is for a consumer that has taken everything a dead producer run
  sent it: it frees what is left of that run and that nobody will take any more (its free
  and returned pool slots, half-written segments, its ring to that consumer, and, while
  its record stays dead, its doorbell and record). Unreceived messages to other consumers
  are theirs and stay.

A Worker's start and close and a consumer's collection never wait for a flooded
directory: ``at_start``, ``at_close`` and ``after_producer`` read a bounded number of
entries and work a bounded time, and leave the rest to the process's background sweeps
(``sweeper.py``). ``sweep``, ``collect_producer`` and ``collect_earlier_runs`` called
directly do their whole work (within their own bounds) in the caller.

A live worker's objects are never touched: it holds its presence lock (so its namespace is
alive), and it has its own files open or mapped (so none of them is unused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import struct
import time

from .._errors import InternalError, InvalidArgumentError, RendezvousError
from .._keys import DeviceName, parse_key
from . import sweeper
from .files import is_ours, open_checked, peek_header
from .header import created_ns
from .naming import SEM_PREFIX, SHM_DIR, SLOT_BITS, Names, ObjectName, parse_name
from .presence import PresenceInfo, probe, read_record
from .registry import records_alive, unlink_if_same, unlink_if_unused
from .ring import DATA_OFFSET, Ring, describe

__all__ = [
    "ENV_VAR",
    "GRACE_S",
    "MAX_NAMESPACES",
    "MAX_OBJECTS",
    "MAX_SECONDS",
    "Swept",
    "after_producer",
    "at_close",
    "at_start",
    "collect_earlier_runs",
    "collect_producer",
    "enabled",
    "sweep",
]

_log = logging.getLogger("shmrdv.shm.reaper")

#: ``SHMRDV_AUTO_GC=0`` turns the sweeps at Worker start and close off.
ENV_VAR = "SHMRDV_AUTO_GC"
#: One sweep removes at most this many objects...
MAX_OBJECTS = 4096
#: ...spends at most about this long (a Worker's start and close wait for it)...
MAX_SECONDS = 0.25
#: ...and looks at most at this many dead namespaces (each costs one more listing).
MAX_NAMESPACES = 16
#: Messages and rings of a dead namespace wait this long (seconds since the newest value
#: still waiting in it was sent) for a consumer that has not started yet: a producer may
#: send and close before its consumer starts (tests/test_shm_ring.py). Read at each sweep.
GRACE_S = 30.0
# A ring is ~1 MiB (``ring.ring_size``); anything much larger is not read whole.
_RING_MAX_BYTES = 16 << 20
# What a consumer that starts later may still take.
_FOR_A_CONSUMER = frozenset({"message", "ring"})
# Objects a sweep of a dead namespace tries to remove even when out of time.
_AT_LEAST = 64
# Names looked at between two looks at the clock.
_CLOCK_EVERY = 256
# Kinds a dead producer run may leave that belong to nobody else (messages and held slots
# are their consumers').
_PRODUCER_KINDS = frozenset({"pool", "returned", "temp"})
_SLOT_KINDS = frozenset({"pool", "returned"})


def enabled() -> bool:
    """Whether sweeps run (``SHMRDV_AUTO_GC`` is not ``0``)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def at_start(names: Names, task: str, incarnation: int) -> bool:
    """What a worker's start collects, once its presence record is published: what dead
    namespaces left (``sweep``), then what earlier runs of its task left
    (``collect_earlier_runs``); bounded here, the rest in the background (``sweeper``).
    Returns whether sweeps run for this worker (``enabled``: pass it to ``at_close``).
    Logs a failure, never raises it (a worker starts whatever was left behind)."""
    if not enabled():
        return False
    sweeper.use()
    try:
        sweeper.run([_Sweep(SHM_DIR), _EarlierRuns(names, task, incarnation, SHM_DIR)])
    except Exception:  # pragma: no cover - nothing it expects is raised
        _log.exception("sweep of /dev/shm at the start of %s", task)
    return True


def at_close(names: Names, task: str, sweeping: bool) -> None:
    """What a worker's close collects, once its presence record is gone: ``sweep()`` with
    what was sent to it, if its job ends with it; bounded here, the rest in the background
    while another Worker of this process lives. ``sweeping``: what ``at_start`` returned.
    Logs a failure, never raises it."""
    if not sweeping:
        return
    try:
        if enabled():
            sweeper.run([_Sweep(SHM_DIR, closing=(names, task))])
    except Exception:  # pragma: no cover - nothing it expects is raised
        _log.exception("sweep of /dev/shm at the close of %s", task)
    finally:
        sweeper.done_using()


def after_producer(names: Names, producer_task: str, incarnation: int, consumer_task: str) -> None:
    """``collect_producer`` for a consumer done with a producer run that is over: bounded
    here (a receiving thread may run it), the rest in the background. Never raises."""
    try:
        sweeper.run([_Producer(names, producer_task, incarnation, consumer_task, SHM_DIR)])
    except Exception:  # pragma: no cover - nothing it expects is raised
        _log.exception("collecting what producer %s (%016x) left", producer_task, incarnation)


@dataclasses.dataclass(frozen=True)
class Swept:
    """What one ``sweep`` did: objects removed, the dead namespaces (ids) it collected from,
    and whether it got through everything (False: a bound stopped it, or values wait for a
    consumer: a later sweep goes on)."""

    removed: int
    namespaces: tuple[str, ...]
    complete: bool


def _stat_ours(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if is_ours(st) else None


def sweep(
    shm_dir: str = SHM_DIR,
    *,
    closing: tuple[Names, str] | None = None,
    max_objects: int = MAX_OBJECTS,
    max_seconds: float = MAX_SECONDS,
    max_namespaces: int = MAX_NAMESPACES,
) -> Swept:
    """Collect what this user's dead namespaces left (see the module docstring), within the
    bounds; ``closing`` is ``(names, task)`` of the worker whose close runs it.

    In a namespace where no worker is alive, everything goes at once but messages and rings:
    those wait for a consumer that has not started yet, up to ``GRACE_S`` after the newest
    value still waiting in the namespace was sent, unless they are addressed to the closing
    worker (it will never take them: they were its own). Listing may take half of
    ``max_seconds``. Never raises for what it finds (an object it cannot remove is left and
    logged); never blocks.
    """
    start = time.monotonic()
    scan = sweeper.DirScan(shm_dir)
    scan.read(float("inf"), start + max_seconds / 2)
    if not scan.done:
        scan.close()
        _log.debug("sweep of %s stopped: listing it took more than %.2f s", shm_dir, max_seconds)
        return Swept(0, (), False)
    job = _Sweep(shm_dir, closing, max_objects=max_objects, max_namespaces=max_namespaces)
    done = job(scan.groups, start + max_seconds)
    return Swept(job.removed, tuple(job.collected), done and not job.waiting)


class _Sweep:
    """``sweep``'s work over one listing (a ``sweeper.Job``): each call goes on where the
    last one stopped, and is done once every namespace of the listing was looked at (what
    waits for a consumer, or is in use, is left for a later sweep)."""

    def __init__(
        self,
        shm_dir: str,
        closing: tuple[Names, str] | None = None,
        *,
        max_objects: int = MAX_OBJECTS,
        max_namespaces: int = MAX_NAMESPACES,
    ) -> None:
        self._dir = shm_dir
        self._closing = closing
        self._max_objects = max_objects
        self._max_namespaces = max_namespaces
        self._looked: set[str] = set()  # namespaces done with
        # By namespace: how far its names were looked at, and its files found so far (a
        # bound stopped the look); what a bound left to remove.
        self._looking: dict[str, tuple[int, list[_Listed]]] = {}
        self._left: dict[str, list[_Listed]] = {}
        self.removed = 0
        self.collected: list[str] = []
        self.waiting = False  # values were kept for a consumer

    def __call__(self, groups: sweeper.Groups, deadline: float) -> bool:
        """One bounded run (``deadline``: ``time.monotonic``); True once done."""
        start = time.monotonic()
        # Looking may take half the time; removing gets the rest, and always a few objects:
        # a sweep of a crowded directory still makes progress.
        looking_until = start + max(deadline - start, 0.0) / 2
        removed = looked = 0
        for ns, group in groups.items():
            if ns in self._looked:
                continue
            if (
                removed >= self._max_objects
                or looked >= self._max_namespaces
                or time.monotonic() > deadline
            ):
                return False
            listed = self._left.pop(ns, None)
            if listed is None:
                looking = self._looking.pop(ns, None)
                if looking is None:
                    if records_alive(ns, group, self._dir):
                        self._looked.add(ns)
                        continue
                    looking = (0, [])
                looking = self._list(group, looking, looking_until)
                if looking[0] < len(group):
                    self._looking[ns] = looking
                    return False  # out of time while looking: on from there next run
                listed = looking[1]
                if not listed:
                    self._looked.add(ns)
                    continue  # nothing of ours (another user's names): costs no namespace
            # Again, now that the files are listed: a worker that published since under a
            # listed record's name (a task restarted) is seen; a new task's worker has its
            # files open or mapped, which ``unlink_if_unused`` leaves.
            if records_alive(ns, group, self._dir):
                self._looked.add(ns)
                continue
            looked += 1
            count, left = self._collect(ns, listed, deadline, self._max_objects - removed)
            removed += count
            if left:
                self._left[ns] = left  # a bound stopped it: the rest next run
                return False
            self._looked.add(ns)
        return True

    def _list(
        self, group: list[str], looking: tuple[int, list[_Listed]], until: float
    ) -> tuple[int, list[_Listed]]:
        """Our files among ``group`` (one ``lstat`` each: another user's name is never
        opened), from where ``looking`` stopped (an index into ``group``, the files found
        before it) until ``until`` passes: the same, further on (at least a few names)."""
        start, listed = looking
        for i in range(start, len(group)):
            if i - start >= _CLOCK_EVERY and i % _CLOCK_EVERY == 0 and time.monotonic() > until:
                return i, listed
            entry = group[i]
            parsed = parse_name(entry)
            if parsed is None:
                continue
            seen = _stat_listed(parsed, os.path.join(self._dir, entry))
            if seen is not None:
                listed.append(seen)
        return len(group), listed

    def _collect(
        self, ns: str, listed: list[_Listed], deadline: float, room: int
    ) -> tuple[int, list[_Listed]]:
        """Remove what may go of the dead namespace ``ns``'s ``listed`` files, up to
        ``room`` of them; how many went, and what a bound left (to try next run)."""
        me = None
        closing = self._closing
        if closing is not None and closing[0].namespace_id == ns:
            me = _task_key(closing[1])
        # Values still waiting in a dead namespace wait for their consumers until GRACE_S
        # after the newest of them was sent: a time their producer wrote in them (tmpfs
        # does not update a file's mtime for writes through a mapping).
        theirs, keep = _waiting(listed, me, time.time_ns() - int(GRACE_S * 1e9))
        listed.sort(key=lambda e: e.kind == "presence")  # records last: `ls` shows whose
        count = tried = 0
        for i, e in enumerate(listed):
            if tried >= _AT_LEAST and (time.monotonic() > deadline or count >= room):
                self._add(ns, count)
                return count, listed[i:]
            if keep and e.kind in _FOR_A_CONSUMER and e.path not in theirs:
                self.waiting = True  # may be for a consumer about to start: a later sweep
                continue
            tried += 1
            try:
                count += unlink_if_unused(e.path, e.ino)
            except OSError as err:
                _log.warning("cannot remove %s of dead namespace %s: %s", e.path, ns, err)
        self._add(ns, count)
        return count, []

    def _add(self, ns: str, count: int) -> None:
        if count:
            self.removed += count
            if ns not in self.collected:
                self.collected.append(ns)
            _log.info("collected %d object(s) left by the dead workers of namespace %s", count, ns)


@dataclasses.dataclass(frozen=True)
class _Listed:
    kind: str
    path: str
    ino: tuple[int, int]


def _stat_listed(parsed: ObjectName, path: str) -> _Listed | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not is_ours(st):
        return None
    return _Listed(parsed.kind, path, (st.st_dev, st.st_ino))


def _task_key(task: str) -> tuple[str, int, int] | None:
    try:
        return DeviceName.parse(task).task_key()
    except InvalidArgumentError:
        return None


def _waiting(
    listed: list[_Listed], me: tuple[str, int, int] | None, since: int
) -> tuple[set[str], bool]:
    """What the messages and rings among ``listed`` hold for their consumers: the paths of
    those addressed to the task ``me`` (a message by the key in its header, a ring by the
    consumer its producer wrote into it), and whether a value of the others still waiting
    was sent after ``since`` (``time.time_ns()`` as its producer wrote it in the value's
    header). Without ``me``, it stops at the first such value."""
    theirs: set[str] = set()
    keep = False
    sent: int | None
    for e in listed:
        if e.kind == "message":
            header = peek_header(e.path)
            if header is None:
                continue  # no valid header: nothing a consumer could take
            dst, sent = _task_of_key(header.key), header.created_ns
        elif e.kind == "ring":
            dst, sent = _read_ring(e.path)
        else:
            continue
        if me is not None and dst == me:
            theirs.add(e.path)
        elif sent is not None and sent > since:
            keep = True
            if me is None:
                break
    return theirs, keep


def _task_of_key(key: str) -> tuple[str, int, int] | None:
    try:
        return parse_key(key).dst.task_key()
    except InvalidArgumentError:
        return None


def _read_ring(path: str) -> tuple[tuple[str, int, int] | None, int | None]:
    """The consumer task a ring was made for (its description, ``Ring.meta``) and when the
    newest record its consumer has not taken was sent (None each when unknown). The ring is
    read with ``pread`` into a private buffer, never mapped: a truncation by another
    process costs nothing, and no mapping of ours keeps the file in use. Its records are
    read only if some are not taken."""
    try:
        fd, st = open_checked(path, os.O_RDONLY, "ring", max_size=_RING_MAX_BYTES)
    except (OSError, RendezvousError):
        return None, None
    try:
        meta, pending = describe(os.pread(fd, DATA_OFFSET, 0))
        data = bytearray(os.pread(fd, st.st_size, 0)) if pending else None
    except (OSError, RendezvousError):
        return None, None  # not a ring of ours (a corrupt or truncated file)
    finally:
        os.close(fd)
    consumer: tuple[str, int, int] | None = None
    try:
        consumer = DeviceName.parse(str(json.loads(meta)["consumer"])).task_key()
    except (RendezvousError, ValueError, KeyError, TypeError):
        pass
    if data is None:
        return consumer, None
    newest: int | None = None
    try:
        ring = Ring(memoryview(data))
    except RendezvousError:
        return consumer, None
    try:
        for record in ring.take():  # (a private copy: taking changes nothing)
            sent = created_ns(record)
            if sent is not None and (newest is None or sent > newest):
                newest = sent
    except (RendezvousError, IndexError, struct.error):
        pass  # a corrupt ring: what was read before the fault
    finally:
        ring.release()
    return consumer, newest


def collect_producer(
    names: Names,
    producer_task: str,
    incarnation: int,
    consumer_task: str,
    shm_dir: str = SHM_DIR,
    *,
    max_objects: int = MAX_OBJECTS,
) -> int:
    """Free what is left of the dead run ``incarnation`` of ``producer_task``; return how
    many objects went.

    For a consumer (``consumer_task``) that has taken everything that run sent it: removes
    the run's free and ``returned`` pool slots and its half-written segments (told by the
    incarnation in their header, and for slots by their name), its ring to
    ``consumer_task`` if every record in it is taken, and, if its presence record is still that run's and
    dead, its doorbell and then the record (under the record's lock, so a successor that
    publishes meanwhile waits a moment and its doorbell is never taken). Messages not
    received and ``held`` slots belong to their consumers and stay. Does nothing while the
    run is alive. Every removal is ``registry.unlink_if_unused``: nothing open or mapped by
    any process goes. Lists ``shm_dir`` whole, here. Never blocks; never raises for what it
    finds.
    """
    job = _Producer(names, producer_task, incarnation, consumer_task, shm_dir, max_objects)
    _run_here(job, shm_dir)
    return job.removed


def collect_earlier_runs(
    names: Names,
    task: str,
    incarnation: int,
    shm_dir: str = SHM_DIR,
    *,
    max_objects: int = MAX_OBJECTS,
) -> int:
    """At the start of run ``incarnation`` of ``task`` (its presence record published and
    locked: no other run of the task lives), free the pool slots that earlier runs of the
    task left (free or ``returned``; told by their name, which only that task and run
    make). A restarted producer thus takes back what its killed predecessor held, while its
    job goes on; messages, held slots and rings stay for their consumers. Returns how many
    went. Lists ``shm_dir`` whole, here. Never blocks; never raises for what it finds."""
    job = _EarlierRuns(names, task, incarnation, shm_dir, max_objects)
    _run_here(job, shm_dir)
    return job.removed


def _run_here(job: sweeper.Job, shm_dir: str) -> None:
    """``job`` over a whole listing of ``shm_dir``, in the caller, within its own bound."""
    scan = sweeper.DirScan(shm_dir)
    scan.read(float("inf"), float("inf"))
    job(scan.groups, time.monotonic() + MAX_SECONDS)


class _Slots:
    """Unused pool slots (free, ``returned``) of ``task``'s run ``run`` (or of every run but
    ``but``), and, for ``run``, its half-written segments: told by the producer incarnation
    in their header, and a slot by its name too (only that task and run make it). A
    ``sweeper.Job``: each call goes on where the last one stopped."""

    def __init__(
        self,
        names: Names,
        task: str,
        shm_dir: str,
        max_objects: int,
        *,
        run: int | None = None,
        but: int | None = None,
    ) -> None:
        self._names, self._task, self._dir = names, task, shm_dir
        self._max_objects = max_objects
        self._run, self._but = run, but
        self._next = 0  # where in the namespace's names the last call stopped
        self.removed = 0

    def __call__(self, groups: sweeper.Groups, deadline: float) -> bool:
        names = self._names
        entries = groups.get(names.namespace_id, [])
        kinds = _PRODUCER_KINDS if self._run is not None else _SLOT_KINDS
        run, but = self._run, self._but
        while self._next < len(entries):
            if self.removed >= self._max_objects:
                return True  # the bound of this collection: the rest is for later ones
            if time.monotonic() > deadline:
                return False
            entry = entries[self._next]
            self._next += 1
            parsed = parse_name(entry)
            if parsed is None or parsed.kind not in kinds:
                continue
            path = os.path.join(self._dir, entry)
            header = peek_header(path)
            if header is None:
                continue
            inc = header.producer_incarnation
            if (run is not None and inc != run) or (but is not None and inc == but) or not inc:
                continue
            if parsed.kind in _SLOT_KINDS and not _is_slot_of(
                names, parsed.kind, self._task, inc, header.slot, entry
            ):
                continue  # another producer's slot, or a name that is no slot of that run
            ino = _stat_ours(path)
            if ino is not None:
                # A slot of a dead run may still be kept mapped by a consumer for reuse: its
                # names go anyway (the mapping follows, slotmaps.py). A temp must be unused.
                self.removed += _unlink(path, ino, mapped_ok=parsed.kind in _SLOT_KINDS)
        return True


class _EarlierRuns(_Slots):
    """``collect_earlier_runs`` as a ``sweeper.Job``."""

    def __init__(
        self,
        names: Names,
        task: str,
        incarnation: int,
        shm_dir: str,
        max_objects: int = MAX_OBJECTS,
    ) -> None:
        super().__init__(names, task, shm_dir, max_objects, but=incarnation)

    def __call__(self, groups: sweeper.Groups, deadline: float) -> bool:
        before = self.removed
        done = super().__call__(groups, deadline)
        if self.removed > before:
            _log.info(
                "collected %d pool slot(s) of earlier runs of %s", self.removed - before, self._task
            )
        return done


class _Producer(_Slots):
    """``collect_producer`` as a ``sweeper.Job``: the run's slots and half-written
    segments from the listing, then (once) its ring, doorbell and record by their names."""

    def __init__(
        self,
        names: Names,
        producer_task: str,
        incarnation: int,
        consumer_task: str,
        shm_dir: str,
        max_objects: int = MAX_OBJECTS,
    ) -> None:
        super().__init__(names, producer_task, shm_dir, max_objects, run=incarnation)
        self._inc = incarnation
        self._consumer = consumer_task
        self._state: tuple[str, PresenceInfo | None] | None = None  # its record's, at first

    def __call__(self, groups: sweeper.Groups, deadline: float) -> bool:
        names, task, inc = self._names, self._task, self._inc
        record = os.path.join(self._dir, names.presence(task))
        if self._state is None:
            try:
                state, info = probe(record)
            except InternalError as e:
                _log.debug("not collecting %s: %s", task, e)
                return True
            self._state = (state, info)
            if state == "alive" and (info is None or info.incarnation == inc):
                return True  # that run lives (or a corrupt record hides which): nothing left
        before = self.removed
        if not super().__call__(groups, deadline):
            return False
        dead, info = self._state[0] == "dead", self._state[1]
        ring = os.path.join(self._dir, names.ring(task, inc, self._consumer))
        ino = _stat_ours(ring)
        if ino is not None and _read_ring(ring)[1] is None:
            # Every record taken: the ring goes, also while its consumer still maps it.
            self.removed += _unlink(ring, ino, mapped_ok=True)
        if dead and info is not None and info.incarnation == inc:
            self.removed += _remove_dead_worker(names, task, inc, record, self._dir)
        if self.removed > before:
            _log.info(
                "collected %d object(s) left by dead producer %s (incarnation %016x)",
                self.removed - before,
                task,
                inc,
            )
        return True


def _is_slot_of(names: Names, kind: str, task: str, inc: int, ticket: int, entry: str) -> bool:
    """Whether ``entry`` is a ``pool``/``returned`` name of ``task``'s run ``inc`` for the
    slot whose header says ``ticket`` (its last lend, ``naming.SLOT_BITS``): ``returned``
    under that ticket; ``pool`` under it (never lent) or under the next one (taken back)."""
    if ticket < 0:
        return False
    if kind == "returned":
        return names.returned(task, inc, ticket) == entry
    nxt = ticket + (1 << SLOT_BITS)
    return entry in (names.pool(task, inc, ticket), names.pool(task, inc, nxt))


def _unlink(path: str, ino: tuple[int, int], *, mapped_ok: bool = False) -> int:
    try:
        return int(unlink_if_same(path, ino) if mapped_ok else unlink_if_unused(path, ino))
    except OSError as e:
        _log.warning("cannot remove %s: %s", path, e)
        return 0


def _remove_dead_worker(
    names: Names, task: str, incarnation: int, record: str, shm_dir: str
) -> int:
    """The doorbell and presence record of ``task``, if the record is still dead: under the
    record's exclusive lock, which a live owner holds and a successor's publish takes."""
    try:
        fd, st = open_checked(record, os.O_RDONLY, "presence record")
    except (OSError, InternalError):
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # alive again, or being replaced
        # Still the run we were asked about? (A successor may have replaced the record since
        # and died too.) Holding the lock, nobody else holds one: that run is dead.
        try:
            info = read_record(fd, record)
        except (OSError, InternalError):
            return 0
        if info.incarnation != incarnation:
            return 0
        removed = 0
        bell = os.path.join(shm_dir, SEM_PREFIX + names.bell(task)[1:])
        ino = _stat_ours(bell)
        if ino is not None:
            removed += _unlink(bell, ino)
        with contextlib.suppress(OSError):
            now = os.stat(record, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(record)
                removed += 1
        return removed
    finally:
        os.close(fd)
