"""What dead workers left in /dev/shm, and who collects it: the one stale-resource cleaner.

Names carry their namespace id, so the directory is the registry. A namespace is dead
while none of its presence records is locked (asked again just before its files go); a
file goes only if it is still the inode listed and nobody has it open or mapped
(``unlink_if_unused``). A dead namespace's values wait ``GRACE_S`` after the newest was
sent, by the time its producer recorded (tmpfs keeps no mtime for writes through a
mapping). ``SHMRDV_AUTO_GC=0`` turns the sweeps off.

Thread model (docs/threads.md): any thread; a start or close works ``SYNC_SECONDS`` at
most itself and leaves the rest to one background thread per process.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import itertools
import json
import logging
import math
import operator
import os
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

from .._cluster import NAMESPACE_ID_HEX, namespace_ids
from .._errors import InternalError, InvalidArgumentError, RendezvousError
from .._keys import DeviceName, parse_key
from .._transport import Sighting
from .files import lstat_ours, open_checked, peek_header
from .header import created_ns
from .naming import CODES, PREFIX, SEM_PREFIX, SHM_DIR, SLOT_BITS, Names, ObjectName, parse_name
from .presence import claim, look
from .ring import DATA_OFFSET, Ring, describe

__all__ = ["ENV_VAR", "GRACE_S", "ObjectInfo", "after_producer", "at_close", "at_start"]
__all__ += ["collect", "collect_producer", "entries_read", "idle", "list_objects"]
__all__ += ["object_names", "sightings", "unlink_if_unused"]

_log = logging.getLogger("shmrdv.shm.reaper")

ENV_VAR = "SHMRDV_AUTO_GC"
# Seconds a dead namespace's values wait for a consumer after the newest was sent (a
# producer may send and close before its consumer starts). Read per sweep.
GRACE_S = 30.0
# A Worker's start or close reads this many directory entries, works this long, at most.
SYNC_ENTRIES, SYNC_SECONDS = 16384, 0.02
# The background thread starts this long after it is asked, then works in runs this long,
# each followed by a pause as long as the run (this long at least).
_FIRST_PAUSE, _RUN_SECONDS, _PAUSE = 0.05, 0.02, 0.005
# Names between two looks at the clock; objects a sweep of a namespace tries to remove even
# when out of time; the most of a ring read (one is ~1 MiB); the most records ``sightings``
# reads, and their size.
_CLOCK_EVERY, _AT_LEAST, _RING_MAX_BYTES = 256, 64, 16 << 20
_MAX_RECORDS, _MAX_RECORD_BYTES = 256, 4096
_FOR_A_CONSUMER = frozenset({"message", "ring"})  # what a late consumer may still take
_PRODUCER_KINDS = frozenset({"pool", "returned", "temp"})  # a dead run's, nobody else's
_SLOT_KINDS = frozenset({"pool", "returned"})
_SEGMENT_KINDS = frozenset({"temp", "message", "pool", "held", "returned"})  # with a header
_KIND_AT = len(PREFIX) + NAMESPACE_ID_HEX + 1  # ``shmrdv_<id>_<kind letter>``
_SEM_NAMES = SEM_PREFIX + PREFIX
_ORDER = operator.attrgetter("namespace", "kind", "name")  # of what ls and gc show

Groups = dict[str, list[str]]  # a listing: namespace id -> the names of that namespace


class _Pace:
    """How long a job works: ``go()`` is False past ``deadline``; in the background (with
    ``stop``) it pauses after each run as long as it ran, and is False once ``stop`` is set."""

    def __init__(self, seconds: float, stop: threading.Event | None = None) -> None:
        self.deadline = time.monotonic() + seconds
        self.entries = 0  # directory entries read
        self._stop = stop

    def go(self) -> bool:
        now = time.monotonic()
        if now <= self.deadline:
            return True
        if self._stop is None:
            return False
        self._stop.wait(max(_PAUSE, _RUN_SECONDS + now - self.deadline))
        self.deadline = time.monotonic() + _RUN_SECONDS
        return not self._stop.is_set()


#: ``job(groups, pace)``: work on a listing while ``pace`` lets it; True once done.
Job = Callable[[Groups, _Pace], bool]


def _listing(shm_dir: str, pace: _Pace | None = None, max_entries: float = math.inf) -> Groups:
    """The shmrdv-looking names of ``shm_dir`` by namespace id; ``_STOPPED`` if ``pace`` or
    ``max_entries`` stopped it first."""
    groups: Groups = defaultdict(list)
    plain, sem, n = len(PREFIX), len(_SEM_NAMES), 0
    try:
        with os.scandir(shm_dir) as entries:
            for entry in entries:
                if pace and n % _CLOCK_EVERY == 0 and n and (n >= max_entries or not pace.go()):
                    return _STOPPED
                n += 1
                name = entry.name
                if name.startswith(PREFIX):
                    groups[name[plain : plain + NAMESPACE_ID_HEX]].append(name)
                elif name.startswith(_SEM_NAMES):
                    groups[name[sem : sem + NAMESPACE_ID_HEX]].append(name)
    except OSError as e:  # no directory (any more): what was read stands
        _log.debug("listing %s: %s", shm_dir, e)
    finally:
        if pace is not None:
            pace.entries += n
    return groups


_STOPPED: Groups = {}  # what ``_listing`` returns when it stopped before the end


@dataclasses.dataclass(frozen=True)
class _Entry(ObjectName):
    """A file of ours as listed, and its ``lstat`` (a record and its doorbell share ``rest``)."""

    path: str
    st: os.stat_result

    @property
    def ino(self) -> tuple[int, int]:
        return self.st.st_dev, self.st.st_ino


def _ours(shm_dir: str, name: str) -> _Entry | None:
    """``name`` if shmrdv made it and it is ours, by one ``lstat``."""
    parsed = parse_name(name)
    path = os.path.join(shm_dir, name)
    if parsed is None or (st := lstat_ours(path)) is None:
        return None
    return _Entry(name, parsed.kind, parsed.namespace, parsed.rest, path, st)


def _records(shm_dir: str, group: Iterable[str]) -> Iterator[_Entry]:
    for name in group:
        if name.startswith(CODES["presence"], _KIND_AT) and (e := _ours(shm_dir, name)):
            yield e


def namespace_alive(group: Iterable[str], shm_dir: str) -> bool:
    """Whether a presence record among ``group`` is locked (or cannot be looked at for want
    of descriptors: nothing goes on a guess)."""
    for e in _records(shm_dir, group):
        try:
            if look(e.path)[0] == "alive":
                return True
        except InternalError:  # changed owner or mode since: not ours
            continue
        except RendezvousError:  # out of descriptors
            return True
    return False


def unlink_if_unused(path: str, ino: tuple[int, int], *, mapped_ok: bool = False) -> bool:
    """Unlink ``path`` if it is still the file ``ino``, ours, and nobody has it open or mapped
    (only then is a write lease granted; ``mapped_ok`` skips that). Whether it went;
    ``OSError`` if the unlink fails. Never blocks."""
    try:
        fd, st = open_checked(path, os.O_RDONLY, "shmrdv object")
    except FileNotFoundError:
        return False
    except RendezvousError as e:  # not ours, leased, no descriptors: leave it
        _log.debug("leaving %s: %s", path, e)
        return False
    try:
        if (st.st_dev, st.st_ino) != ino:
            return False  # replaced since the listing (a new worker's file): not ours to take
        if not mapped_ok:
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: leases are off here
                    _log.debug("leaving %s: in use, or cannot tell (%s)", path, e)
                    return False
            else:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != ino:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def _unlink(e: _Entry, *, mapped_ok: bool = False) -> int:
    try:
        return int(unlink_if_unused(e.path, e.ino, mapped_ok=mapped_ok))
    except OSError as err:
        _log.warning("cannot remove %s: %s", e.path, err)
        return 0


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One shmrdv object as ``list_objects`` saw it (None: unknown). ``alive``: a record's
    lock is held, or for other kinds a worker of the namespace lives."""

    kind: str
    namespace: str  # the namespace id (public), never the token
    name: str
    path: str
    size: int
    owner_pid: int | None
    alive: bool | None
    age_s: float
    step_id: int | None = None
    key: str | None = None
    task: str | None = None


def _describe(entries: list[_Entry], alive: bool) -> dict[str, ObjectInfo]:
    """What ``ls`` shows of one namespace's ``entries`` (``alive``: the namespace's), by path."""
    now, out, workers = time.time(), {}, {}
    for e in sorted(entries, key=lambda e: e.kind != "presence"):  # records before doorbells
        size, age = e.st.st_blocks * 512, max(now - e.st.st_mtime, 0.0)
        info = ObjectInfo(e.kind, e.namespace, e.entry, e.path, size, None, alive, age)
        if e.kind == "presence":
            try:
                state, said = look(e.path)
            except RendezvousError as err:  # changed owner or mode since the listing
                _log.debug("%s", err)
                state, said = "absent", None
            live = None if state == "absent" else state == "alive"
            pid, task = (said.pid, said.task) if said is not None else (None, None)
            info = workers[e.rest] = dataclasses.replace(info, owner_pid=pid, alive=live, task=task)
        elif e.kind == "bell" and (worker := workers.get(e.rest)) is not None:
            info = dataclasses.replace(info, owner_pid=worker.owner_pid, task=worker.task)
        elif e.kind in _SEGMENT_KINDS and (h := peek_header(e.path)) is not None:
            info = dataclasses.replace(info, owner_pid=h.producer_pid, step_id=h.step_id, key=h.key)
        out[e.path] = info
    return out


def _of(namespace: str | None, shm_dir: str) -> Groups:
    ids = None if namespace is None else namespace_ids(namespace)
    return {ns: names for ns, names in _listing(shm_dir).items() if ids is None or ns in ids}


def list_objects(namespace: str | None = None, shm_dir: str = SHM_DIR) -> list[ObjectInfo]:
    """Every shmrdv object of ours (of ``namespace`` only, if given), sorted by namespace,
    kind and name. Never blocks."""
    out: list[ObjectInfo] = []
    for group in _of(namespace, shm_dir).values():
        entries = [e for name in group if (e := _ours(shm_dir, name)) is not None]
        out += _describe(entries, namespace_alive(group, shm_dir)).values()
    return sorted(out, key=_ORDER)


def object_names(shm_dir: str = SHM_DIR) -> set[str]:
    """The names of this user's shmrdv objects (one ``lstat`` each), for the leak check:
    another user's are neither a leak nor ours to remove."""
    return {name for group in _listing(shm_dir).values() for name in group if _ours(shm_dir, name)}


def collect(
    namespace: str | None = None, dry_run: bool = False, shm_dir: str = SHM_DIR
) -> list[ObjectInfo]:
    """Remove what namespaces where no worker lives left (of ``namespace`` only, if given):
    the sweeps' rules without their bounds or grace. What went (``dry_run``: would go);
    ``InternalError`` if an object cannot be removed. Never blocks."""
    job = _Sweep(shm_dir, by_hand=True, dry_run=dry_run)
    job(_of(namespace, shm_dir), _Pace(math.inf))
    return sorted(job.gone, key=_ORDER)


def sightings(task: str, namespace: str, *, shm_dir: str = SHM_DIR) -> list[Sighting]:
    """Our presence records naming ``task``, in any namespace (``namespace``: the caller's
    id), for a diagnosis. Bounded; never raises for what it finds; never blocks."""
    out: list[Sighting] = []
    records = (e for g in _listing(shm_dir).values() for e in _records(shm_dir, g))
    small = (e for e in records if e.st.st_size <= _MAX_RECORD_BYTES)
    for e in itertools.islice(small, _MAX_RECORDS):
        try:
            state, info = look(e.path)
        except RendezvousError:
            continue  # changed owner or mode since the listing, or out of descriptors
        if info is not None and info.task == task:
            out.append(Sighting(e.namespace, info.pid, state == "alive", e.namespace == namespace))
    return out


class _Sweep:
    """A job: what a listing's dead namespaces left. ``closing``: ``(names, task)`` of the
    closing worker (what was sent to it does not wait). ``by_hand``: nothing waits, ``gone``
    says what went, and a failure to remove raises."""

    def __init__(
        self,
        shm_dir: str = SHM_DIR,
        closing: tuple[Names, str] | None = None,
        *,
        by_hand: bool = False,
        dry_run: bool = False,
    ) -> None:
        self._dir, self._closing, self._by_hand, self._dry_run = shm_dir, closing, by_hand, dry_run
        self.gone: list[ObjectInfo] = []

    def __call__(self, groups: Groups, pace: _Pace) -> bool:
        for ns, group in groups.items():
            if not pace.go():
                return False
            if namespace_alive(group, self._dir):
                continue
            listed = []
            for i, name in enumerate(group, 1):
                if i % _CLOCK_EVERY == 0 and not pace.go():
                    return False
                if (e := _ours(self._dir, name)) is not None:
                    listed.append(e)
            # Asked again, now that the files are listed: a restarted task's record is seen;
            # a new task's worker has its files open or mapped (``unlink_if_unused``).
            alive = not listed or namespace_alive(group, self._dir)
            if not alive and not self._collect(ns, listed, pace):
                return False
        return True

    def _collect(self, ns: str, listed: list[_Entry], pace: _Pace) -> bool:
        theirs: set[str] = set()
        keep, said = False, {}
        if self._by_hand:
            said = _describe(listed, False)
            if self._dry_run:
                self.gone += said.values()
                return True
        else:
            closing = self._closing
            me = _task(closing[1]) if closing and closing[0].namespace_id == ns else None
            theirs, keep = _waiting(listed, me, time.time_ns() - int(GRACE_S * 1e9))
        listed.sort(key=lambda e: e.kind == "presence")  # records last: `ls` shows whose
        count = tried = 0
        done = True
        for e in listed:
            if keep and e.kind in _FOR_A_CONSUMER and e.path not in theirs:
                continue  # may be for a consumer about to start: a later sweep
            if tried >= _AT_LEAST and not pace.go():
                done = False
                break
            tried += 1
            try:
                if unlink_if_unused(e.path, e.ino):
                    count += 1
                    self.gone += [said[e.path]] if said else []
            except OSError as err:
                if self._by_hand:
                    raise InternalError(f"cannot remove {e.path}: {err}") from err
                _log.warning("cannot remove %s of dead namespace %s: %s", e.path, ns, err)
        if count:
            _log.info("collected %d object(s) left by the dead workers of namespace %s", count, ns)
        return done


def _task(device: object) -> tuple[str, int, int] | None:
    try:
        return DeviceName.parse(str(device)).task_key()
    except InvalidArgumentError:
        return None


def _waiting(
    listed: list[_Entry], me: tuple[str, int, int] | None, since: int
) -> tuple[set[str], bool]:
    """The messages and rings among ``listed`` for the task ``me``, and whether another
    holds a value sent after ``since`` (``time.time_ns()``)."""
    theirs: set[str] = set()
    keep = False
    for e in listed:
        if e.kind == "message":
            header = peek_header(e.path)
            if header is None:
                continue  # no valid header: nothing a consumer could take
            try:
                dst = parse_key(header.key).dst.task_key()
            except InvalidArgumentError:
                dst = None
            sent: int | None = header.created_ns
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


def _read_ring(path: str) -> tuple[tuple[str, int, int] | None, int | None]:
    """The consumer task of a ring and when its newest record not taken was sent (None:
    unknown), by ``pread``: a truncation costs nothing and no mapping keeps it in use."""
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
    try:
        consumer = _task(json.loads(meta)["consumer"])
    except (ValueError, KeyError, TypeError):
        consumer = None
    newest: int | None = None
    if data is None:
        return consumer, newest
    try:
        ring = Ring(memoryview(data))
        try:  # (a private copy: taking changes nothing)
            for sent in filter(None, map(created_ns, ring.take())):
                newest = max(sent, newest or 0)
        finally:
            ring.release()
    except (RendezvousError, IndexError, struct.error):
        pass  # a corrupt ring: what was read before the fault
    return consumer, newest


class _Slots:
    """A job: the unused slots and half-written segments of ``task``'s run ``run``, or the
    slots of its runs but ``but`` (what a restarted producer's killed runs held)."""

    def __init__(self, names: Names, task: str, run: int | None, but: int | None = None) -> None:
        self._names, self._task, self._run, self._but = names, task, run, but
        self.removed = 0

    def __call__(self, groups: Groups, pace: _Pace) -> bool:
        names, run, but = self._names, self._run, self._but
        codes = {CODES[kind] for kind in (_PRODUCER_KINDS if run is not None else _SLOT_KINDS)}
        before = self.removed
        for name in groups.get(names.namespace_id, []):
            if name[_KIND_AT : _KIND_AT + 1] not in codes or (e := _ours(SHM_DIR, name)) is None:
                continue
            if not pace.go():
                return False
            if (header := peek_header(e.path)) is None:
                continue
            inc = header.producer_incarnation
            if (run is not None and inc != run) or (but is not None and inc == but) or not inc:
                continue
            if e.kind in _SLOT_KINDS and not _is_slot_of(names, e, self._task, inc, header.slot):
                continue  # another producer's slot, or a name that is no slot of that run
            # A slot of a dead run may still be kept mapped by a consumer for reuse: its
            # names go anyway (the mapping follows, pool.SlotMaps). A temp must be unused.
            self.removed += _unlink(e, mapped_ok=e.kind in _SLOT_KINDS)
        if but is not None and self.removed > before:
            _log.info("collected %d pool slot(s) of earlier runs", self.removed - before)
        return True


def _is_slot_of(names: Names, e: _Entry, task: str, inc: int, ticket: int) -> bool:
    """Whether ``e`` is a name of ``task``'s run ``inc`` for the slot of ``ticket`` (its last
    lend): ``returned`` under it, ``pool`` under it or the next one."""
    if ticket < 0:
        return False
    if e.kind == "returned":
        return names.returned(task, inc, ticket) == e.entry
    nxt = ticket + (1 << SLOT_BITS)
    return e.entry in (names.pool(task, inc, ticket), names.pool(task, inc, nxt))


class _Producer(_Slots):
    def __init__(self, names: Names, task: str, run: int, consumer: str) -> None:
        super().__init__(names, task, run)
        self._inc, self._consumer = run, consumer
        self._record = os.path.join(SHM_DIR, names.presence(task))

    def __call__(self, groups: Groups, pace: _Pace) -> bool:
        names, task, inc = self._names, self._task, self._inc
        try:
            state, info = look(self._record)
        except RendezvousError as e:
            _log.debug("not collecting %s: %s", task, e)
            return True
        if state == "alive" and (info is None or info.incarnation == inc):
            return True  # that run lives (or a corrupt record hides which): nothing left
        before = self.removed
        if not super().__call__(groups, pace):
            return False
        ring = _ours(SHM_DIR, names.ring(task, inc, self._consumer))
        if ring is not None and _read_ring(ring.path)[1] is None:
            # Every record taken: the ring goes, also while its consumer still maps it.
            self.removed += _unlink(ring, mapped_ok=True)
        if state == "dead" and info is not None and info.incarnation == inc:
            self.removed += self._remove_record()
        if self.removed > before:
            _log.info("collected %d object(s) of dead producer %s", self.removed - before, task)
        return True

    def _remove_record(self) -> int:
        """The doorbell and record if still that run's, under the record's claim (a live
        owner's lock refuses it, a successor's publish waits for it)."""
        try:
            with claim(self._record) as dead:
                if dead.state != "dead" or dead.info is None or dead.info.incarnation != self._inc:
                    return 0  # a successor replaced it since (and may have died too)
                bell = _ours(SHM_DIR, SEM_PREFIX + self._names.bell(self._task)[1:])
                return (0 if bell is None else _unlink(bell)) + dead.remove()
        except (OSError, RendezvousError):
            return 0


def collect_producer(names: Names, producer: str, incarnation: int, consumer: str) -> int:
    """Free what the dead run ``incarnation`` of ``producer`` left, for a ``consumer`` that
    took all it sent: unused slots, half-written segments, its ring to ``consumer``, its
    doorbell and record if still that run's. How many went. Never blocks."""
    job = _Producer(names, producer, incarnation, consumer)
    job(_listing(SHM_DIR), _Pace(math.inf))
    return job.removed


class _Background:
    """The process's sweeper thread and its jobs; no job or listing runs under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.read = {"sync": 0, "background": 0}
        self.users = 0
        self.thread: threading.Thread | None = None
        self.jobs: list[Job] = []
        self.stop = threading.Event()  # set while the last Worker stops the thread

    def use(self, n: int) -> None:
        """A Worker starts (1) or ends (-1) using sweeps: the last one stops the thread."""
        with self.lock:
            self.users += n
            thread = self.thread if self.users <= 0 else None
            if thread is not None:
                self.stop.set()
        if thread is not None:
            thread.join()
            self.stop.clear()

    def submit(self, jobs: list[Job]) -> None:
        """Leave ``jobs`` to the thread, which lists /dev/shm afresh for them."""
        with self.lock:
            if self.users > 0 and not self.stop.is_set():
                self.jobs += jobs
                if self.thread is None:
                    self.thread = threading.Thread(
                        target=self._loop, name="shmrdv-sweeper", daemon=True
                    )
                    self.thread.start()

    def _loop(self) -> None:
        self.stop.wait(_FIRST_PAUSE)
        while True:
            with self.lock:
                jobs, self.jobs = self.jobs, []
                if not jobs or self.stop.is_set():
                    self.thread = None
                    return
            try:
                pace = _Pace(_RUN_SECONDS, self.stop)
                groups = _listing(SHM_DIR, pace)
                self.count("background", pace.entries)
                if groups is not _STOPPED:
                    for job in jobs:
                        job(groups, pace)
            except Exception:  # pragma: no cover - jobs never raise for what they find
                _log.exception("background sweep of /dev/shm")

    def count(self, where: str, n: int) -> None:
        with self.lock:
            self.read[where] += n


_BACKGROUND = _Background()


def _forked() -> None:
    # A fork child has neither its parent's thread nor its Workers (nor, maybe, a free lock).
    global _BACKGROUND
    _BACKGROUND = _Background()


os.register_at_fork(after_in_child=_forked)


def _run(what: str, jobs: list[Job]) -> None:
    """Run ``jobs`` here for about ``SYNC_SECONDS``, the rest in the background. Never raises."""
    try:
        pace = _Pace(SYNC_SECONDS)
        groups = _listing(SHM_DIR, pace, SYNC_ENTRIES)
        _BACKGROUND.count("sync", pace.entries)
        if groups is not _STOPPED:
            # The jobs get half the time at least, however long the listing took.
            pace.deadline = max(pace.deadline, time.monotonic() + SYNC_SECONDS / 2)
            jobs = [job for job in jobs if not job(groups, pace)]
        if jobs:  # the background lists again: the directory changes
            _BACKGROUND.submit(jobs)
    except Exception:  # pragma: no cover - nothing it expects is raised
        _log.exception("sweep of /dev/shm %s", what)


def _enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def at_start(names: Names, task: str, incarnation: int) -> bool:
    """A worker's start, its record published: what dead namespaces and earlier runs of its
    task left. Whether sweeps run for this worker (``SHMRDV_AUTO_GC``), for ``at_close``."""
    if not _enabled():
        return False
    _BACKGROUND.use(1)
    _run(f"at the start of {task}", [_Sweep(), _Slots(names, task, None, incarnation)])
    return True


def at_close(names: Names, task: str, sweeping: bool) -> None:
    """A worker's close, once its record is gone (``sweeping``: what ``at_start`` returned):
    a sweep, with what was sent to it; the last Worker stops the background thread."""
    if sweeping:
        if _enabled():
            _run(f"at the close of {task}", [_Sweep(closing=(names, task))])
        _BACKGROUND.use(-1)


def after_producer(names: Names, producer: str, incarnation: int, consumer: str) -> None:
    """``collect_producer``, bounded here, for a consumer done with a producer run."""
    _run(f"after {producer}", [_Producer(names, producer, incarnation, consumer)])


def entries_read() -> dict[str, int]:
    """Directory entries this process's sweeps read, ``sync`` and in the ``background``."""
    with _BACKGROUND.lock:
        return dict(_BACKGROUND.read)


def idle(timeout: float) -> bool:
    """Wait up to ``timeout`` s for the background thread to end; whether it did (tests)."""
    if (thread := _BACKGROUND.thread) is not None:
        thread.join(timeout)
    return _BACKGROUND.thread is None
