"""What dead workers left in /dev/shm, and who collects it: the one stale-resource cleaner.

A worker killed by SIGKILL, SIGTERM or the OOM killer leaves its record, doorbell, pool
slots, rings and unreceived messages in /dev/shm. Names say their namespace id
(``naming``), so the directory is the registry: read one way (``DirScan``, a bounded
number of entries at a time), collected by one set of rules. Only a regular file of ours
is opened (``_ours``: one ``lstat``); a namespace is alive while one of its presence records
is locked (``namespace_alive``, asked again just before its files go); a file goes only if
it is still the one listed and unused (``unlink_if_unused``). They serve ``shmrdv ls`` /
``gc`` and ``pytest_plugin``'s leak check, a Worker's start and close (``at_start``,
``at_close``) and a consumer done with a dead producer run (``after_producer``).

Messages and rings of a dead namespace wait for a late consumer until ``GRACE_S`` after the
newest value in them was sent (as its producer wrote: tmpfs keeps no mtime for writes
through a mapping), unless they were the closing worker's. A start, close or collection
reads at most ``SYNC_ENTRIES`` entries and works about ``SYNC_SECONDS`` itself; the rest is
left to one background thread per process. ``SHMRDV_AUTO_GC=0`` turns the sweeps off.

Thread model (docs/threads.md): any thread may call in; one lock guards the background
thread's work, counters and handle; no job or directory read runs under it.
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
from .files import is_ours, open_checked, peek_header
from .header import created_ns
from .naming import KINDS, PREFIX, SEM_PREFIX, SHM_DIR, SLOT_BITS, Names, ObjectName, parse_name
from .presence import claim, look
from .ring import DATA_OFFSET, Ring, describe

__all__ = [
    "ENV_VAR",
    "GRACE_S",
    "ObjectInfo",
    "after_producer",
    "at_close",
    "at_start",
    "collect",
    "collect_producer",
    "entries_read",
    "idle",
    "list_objects",
    "object_names",
    "sightings",
    "sweep",
    "unlink_if_unused",
]

_log = logging.getLogger("shmrdv.shm.reaper")

ENV_VAR = "SHMRDV_AUTO_GC"
#: A sweep removes at most this many objects, spends about this long when called directly,
#: and looks at this many dead namespaces at most (another user's names cost none).
MAX_OBJECTS, MAX_SECONDS, MAX_NAMESPACES = 4096, 0.25, 16
#: Seconds a dead namespace's values wait for a consumer after the newest was sent (a
#: producer may send and close before its consumer starts). Read per sweep.
GRACE_S = 30.0
#: A Worker's start or close reads this many directory entries, works this long, at most.
SYNC_ENTRIES, SYNC_SECONDS = 16384, 0.02
# The background thread starts this long after it is asked, reads this many entries or runs
# the jobs this long at a time, each followed by a pause at least this long and as long.
_FIRST_PAUSE, _SLICE_ENTRIES, _RUN_SECONDS, _SLICE_PAUSE = 0.05, 4096, 0.02, 0.005
# Names between two looks at the clock; objects a sweep of a dead namespace tries to remove
# even when out of time; the most of a ring read (one is ~1 MiB).
_CLOCK_EVERY, _AT_LEAST, _RING_MAX_BYTES = 256, 64, 16 << 20
# What a late consumer may still take; what a dead producer run leaves that is nobody
# else's, and its pool slots; what has a segment header.
_FOR_A_CONSUMER = frozenset({"message", "ring"})
_PRODUCER_KINDS = frozenset({"pool", "returned", "temp"})
_SLOT_KINDS = frozenset({"pool", "returned"})
_SEGMENT_KINDS = frozenset({"temp", "message", "pool", "held", "returned"})
_KIND_AT = len(PREFIX) + NAMESPACE_ID_HEX + 1  # ``shmrdv_<id>_<kind letter>``
_CODES = {kind: code for code, kind in KINDS.items()}
_SEM_NAMES = SEM_PREFIX + PREFIX
# ``sightings`` looks at this many records at most, of this size at most.
_MAX_RECORDS, _MAX_RECORD_BYTES = 256, 4096
_ORDER = operator.attrgetter("namespace", "kind", "name")  # of what ls and gc show

Groups = dict[str, list[str]]  # a listing: namespace id -> the names of that namespace
#: ``job(groups, deadline)``: work until ``deadline`` (``time.monotonic``); True once done;
#: called again with the same groups, it goes on where it stopped.
Job = Callable[[Groups, float], bool]


class DirScan:
    """The shmrdv-looking names of ``shm_dir`` by namespace id, a bounded share at a time."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir, self.done = shm_dir, False
        self.groups: Groups = defaultdict(list)
        self._it: Iterator[os.DirEntry[str]] | None = None

    def read(self, max_entries: float = math.inf, deadline: float = math.inf) -> int:
        """Read up to ``max_entries`` more entries, fewer if ``deadline`` passes first; how
        many were read (``done`` tells whether that was the last)."""
        groups, plain, sem = self.groups, len(PREFIX), len(SEM_PREFIX) + len(PREFIX)
        n = 0
        try:
            if self._it is None and not self.done:
                self._it = os.scandir(self.shm_dir)
            while n < max_entries:  # a slice at a time, then a look at the clock
                size = int(min(_CLOCK_EVERY, max_entries - n))
                names = [entry.name for entry in itertools.islice(self._it or (), size)]
                if not names:
                    break
                n += len(names)
                for name in names:
                    if name.startswith(PREFIX):
                        groups[name[plain : plain + NAMESPACE_ID_HEX]].append(name)
                    elif name.startswith(_SEM_NAMES):
                        groups[name[sem : sem + NAMESPACE_ID_HEX]].append(name)
                if time.monotonic() > deadline:
                    return n
            else:
                return n
        except OSError as e:  # no directory (any more): what was read stands
            _log.debug("listing %s: %s", self.shm_dir, e)
        self.done = True
        self.close()
        return n

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None:
            it.close()  # type: ignore[attr-defined]  # os.scandir's iterator


def _listing(shm_dir: str) -> Groups:
    (scan := DirScan(shm_dir)).read()
    return scan.groups


@dataclasses.dataclass(frozen=True)
class _Entry(ObjectName):
    """A file of ours as listed: its name (a record and its doorbell share ``rest``) and stat."""

    path: str
    st: os.stat_result

    @property
    def ino(self) -> tuple[int, int]:
        return self.st.st_dev, self.st.st_ino


def _ours(shm_dir: str, name: str) -> _Entry | None:
    """``name`` if shmrdv made it and it is a regular file of ours (``is_ours``, by one
    ``lstat``: another user's file, a symlink, a FIFO is never opened)."""
    parsed = parse_name(name)
    if parsed is None:
        return None
    path = os.path.join(shm_dir, name)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not is_ours(st):
        return None
    return _Entry(name, parsed.kind, parsed.namespace, parsed.rest, path, st)


def _records(shm_dir: str, group: Iterable[str]) -> Iterator[_Entry]:
    """The presence records of ours among ``group`` (another name costs a string test)."""
    for name in group:
        if name.startswith(_CODES["presence"], _KIND_AT) and (e := _ours(shm_dir, name)):
            yield e


def namespace_alive(group: Iterable[str], shm_dir: str) -> bool:
    """Whether a worker of the namespace whose names are ``group`` lives: one of its presence
    records of ours is locked (``presence.look``; one we cannot look at for want of
    descriptors counts: nothing is collected on a guess)."""
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
    """Unlink ``path`` if it is still the file ``ino`` (as listed), ours, and no process has it
    open or mapped (a write lease, ``F_SETLEASE``, is granted only then; dropped at once): a
    file a live process uses, or a starting worker's record, never goes. ``mapped_ok`` (a
    dead run's slots and ring, which a consumer may keep mapped) skips that. Whether it
    went; ``OSError`` when the unlink fails. Never blocks."""
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
    """One shmrdv object, as ``list_objects`` saw it: ``size`` the memory it holds; ``owner_pid``
    the worker's (record, doorbell) or producer's (segment header); ``alive`` whether that
    record's lock is held (records) or a worker of the namespace lives; ``step_id``, ``key``
    and ``task`` from a header or record. None when unknown (unwritten, corrupt)."""

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
    """What ``ls`` shows of one namespace's ``entries``, by path; ``alive``: the namespace's."""
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
    """The listing, of ``namespace`` only if given (a token or an id, ``namespace_ids``)."""
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
    """The names of the shmrdv objects of ours (one ``lstat`` each): what the leak check
    compares before and after a test."""
    return {name for group in _listing(shm_dir).values() for name in group if _ours(shm_dir, name)}


def collect(
    namespace: str | None = None, dry_run: bool = False, shm_dir: str = SHM_DIR
) -> list[ObjectInfo]:
    """Remove what the namespaces where no worker is alive left (of ``namespace`` only, if
    given); what went (``dry_run``: would go). The sweeps' rules without their bounds or
    a wait for consumers; ``InternalError`` if an object cannot be removed. Never blocks."""
    (job := _Sweep(shm_dir, by_hand=True, dry_run=dry_run))(_of(namespace, shm_dir), math.inf)
    return sorted(job.gone, key=_ORDER)


def sightings(task: str, namespace: str, *, shm_dir: str = SHM_DIR) -> list[Sighting]:
    """The presence records of ours naming ``task``, in any namespace (for a diagnosis;
    ``namespace``: the caller's id). Bounded; never raises for what it finds; never blocks."""
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


@dataclasses.dataclass(frozen=True)
class Swept:
    """What ``sweep`` did: objects removed, dead namespaces collected from, whether complete."""

    removed: int
    namespaces: tuple[str, ...]
    complete: bool


class _Sweep:
    """What the dead namespaces of a listing left (a ``Job``); ``collect``'s ``by_hand``: no
    bounds, no value waits for a consumer, what went is kept (``gone``), failures raise."""

    def __init__(
        self,
        shm_dir: str,
        closing: tuple[Names, str] | None = None,
        *,
        bounds: tuple[float, float] = (MAX_OBJECTS, MAX_NAMESPACES),
        by_hand: bool = False,
        dry_run: bool = False,
    ) -> None:
        self._dir, self._closing, self._by_hand, self._dry_run = shm_dir, closing, by_hand, dry_run
        self._max = (math.inf, math.inf) if by_hand else bounds
        self._done: set[str] = set()  # namespaces done with
        # Where a bound stopped: how far a namespace's names were listed, its files not removed.
        self._stopped: dict[str, tuple[int, list[_Entry]]] = {}
        self.removed, self.waiting = 0, False  # values were kept for a consumer
        self.collected: list[str] = []
        self.gone: list[ObjectInfo] = []  # by hand: what went (or would go)

    def __call__(self, groups: Groups, deadline: float) -> bool:
        start = time.monotonic()
        # Listing may take half the time; removing gets the rest, and always a few objects.
        listing_until = start + max(deadline - start, 0.0) / 2
        removed = looked = 0
        for ns, group in groups.items():
            if ns in self._done:
                continue
            if removed >= self._max[0] or looked >= self._max[1] or time.monotonic() > deadline:
                return False
            at, listed = self._stopped.pop(ns, (0, []))
            if at == 0 and namespace_alive(group, self._dir):
                self._done.add(ns)
                continue
            if at < len(group):
                at, listed = self._list(group, at, listed, listing_until)
                if at < len(group):
                    self._stopped[ns] = (at, listed)
                    return False  # out of time while listing: on from there next run
                if not listed:
                    self._done.add(ns)
                    continue  # nothing of ours (another user's names): costs no namespace
            # Again, now that the files are listed: a restarted task's record is seen; a new
            # task's worker has its files open or mapped, which ``unlink_if_unused`` leaves.
            if namespace_alive(group, self._dir):
                self._done.add(ns)
                continue
            looked += 1
            count, left = self._collect(ns, listed, deadline, self._max[0] - removed)
            removed += count
            if left:
                self._stopped[ns] = (len(group), left)  # the rest next run
                return False
            self._done.add(ns)
        return True

    def _list(
        self, group: list[str], at: int, listed: list[_Entry], until: float
    ) -> tuple[int, list[_Entry]]:
        """Our files among ``group`` from ``at`` on (into ``listed``), until ``until``."""
        for i in range(at, len(group)):
            if i - at >= _CLOCK_EVERY and i % _CLOCK_EVERY == 0 and time.monotonic() > until:
                return i, listed
            if (e := _ours(self._dir, group[i])) is not None:
                listed.append(e)
        return len(group), listed

    def _collect(
        self, ns: str, listed: list[_Entry], deadline: float, room: float
    ) -> tuple[int, list[_Entry]]:
        """Remove what may go of ``listed``, up to ``room``: how many went, what was left."""
        theirs: set[str] = set()
        keep, said = False, {}
        if self._by_hand:
            said = _describe(listed, False)
            if self._dry_run:
                self.gone += said.values()
                return 0, []
        else:
            closing = self._closing
            me = _task(closing[1]) if closing and closing[0].namespace_id == ns else None
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
                if unlink_if_unused(e.path, e.ino):
                    count += 1
                    self.gone += [said[e.path]] if said else []
            except OSError as err:
                if self._by_hand:
                    raise InternalError(f"cannot remove {e.path}: {err}") from err
                _log.warning("cannot remove %s of dead namespace %s: %s", e.path, ns, err)
        self._add(ns, count)
        return count, []

    def _add(self, ns: str, count: int) -> None:
        if count:
            self.removed += count
            if ns not in self.collected:
                self.collected.append(ns)
            _log.info("collected %d object(s) left by the dead workers of namespace %s", count, ns)


def _task(device: object) -> tuple[str, int, int] | None:
    try:
        return DeviceName.parse(str(device)).task_key()
    except InvalidArgumentError:
        return None


def _waiting(
    listed: list[_Entry], me: tuple[str, int, int] | None, since: int
) -> tuple[set[str], bool]:
    """The messages and rings among ``listed`` addressed to the task ``me`` (by the key in a
    header, the consumer a ring names), and whether another holds a value sent after
    ``since`` (``time.time_ns()``, as its producer wrote it). Without ``me``, stops at one."""
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
    """The consumer task a ring was made for and when the newest record it has not taken was
    sent (None when unknown). Read with ``pread``, never mapped (a truncation costs nothing,
    no mapping keeps the file in use), its records only if some are not taken."""
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
        try:
            for record in ring.take():  # (a private copy: taking changes nothing)
                sent = created_ns(record)
                if sent is not None and (newest is None or sent > newest):
                    newest = sent
        finally:
            ring.release()
    except (RendezvousError, IndexError, struct.error):
        pass  # a corrupt ring: what was read before the fault
    return consumer, newest


class _Slots:
    """A ``Job``: the unused pool slots (free, ``returned``) and half-written segments of
    ``task``'s run ``run``, or the slots of its runs but ``but`` (a restarted producer takes
    back what its killed runs held); by the run in their header, a slot by its name too."""

    def __init__(self, names: Names, task: str, run: int | None, but: int | None = None) -> None:
        self._names, self._task, self._run, self._but = names, task, run, but
        self._dir, self._next, self.removed = SHM_DIR, 0, 0  # _next: where the last call stopped

    def __call__(self, groups: Groups, deadline: float) -> bool:
        names, run, but = self._names, self._run, self._but
        entries = groups.get(names.namespace_id, [])
        codes = {_CODES[kind] for kind in (_PRODUCER_KINDS if run is not None else _SLOT_KINDS)}
        before = self.removed
        while self._next < len(entries) and self.removed < MAX_OBJECTS:
            if time.monotonic() > deadline:
                return False
            name = entries[self._next]
            self._next += 1
            if name[_KIND_AT : _KIND_AT + 1] not in codes or (e := _ours(self._dir, name)) is None:
                continue
            if (header := peek_header(e.path)) is None:
                continue
            inc = header.producer_incarnation
            if (run is not None and inc != run) or (but is not None and inc == but) or not inc:
                continue
            if e.kind in _SLOT_KINDS and not _is_slot_of(names, e, self._task, inc, header.slot):
                continue  # another producer's slot, or a name that is no slot of that run
            # A slot of a dead run may still be kept mapped by a consumer for reuse: its
            # names go anyway (the mapping follows, slotmaps.py). A temp must be unused.
            self.removed += _unlink(e, mapped_ok=e.kind in _SLOT_KINDS)
        if but is not None and self.removed > before:
            _log.info("collected %d pool slot(s) of earlier runs", self.removed - before)
        return True


def _is_slot_of(names: Names, e: _Entry, task: str, inc: int, ticket: int) -> bool:
    """Whether ``e`` is a name of ``task``'s run ``inc`` for the slot whose header says
    ``ticket`` (its last lend): ``returned`` under it, ``pool`` under it or the next one."""
    if ticket < 0:
        return False
    if e.kind == "returned":
        return names.returned(task, inc, ticket) == e.entry
    nxt = ticket + (1 << SLOT_BITS)
    return e.entry in (names.pool(task, inc, ticket), names.pool(task, inc, nxt))


class _Producer(_Slots):
    """``collect_producer`` as a ``Job``: the run's slots and segments, then its ring, record."""

    def __init__(self, names: Names, task: str, run: int, consumer: str, shm_dir: str) -> None:
        super().__init__(names, task, run)
        self._inc, self._consumer, self._dir = run, consumer, shm_dir
        self._record = os.path.join(shm_dir, names.presence(task))
        self._dead: bool | None = None  # its record's state at first: that run's and dead

    def __call__(self, groups: Groups, deadline: float) -> bool:
        names, task, inc = self._names, self._task, self._inc
        if self._dead is None:
            try:
                state, info = look(self._record)
            except RendezvousError as e:
                _log.debug("not collecting %s: %s", task, e)
                return True
            if state == "alive" and (info is None or info.incarnation == inc):
                return True  # that run lives (or a corrupt record hides which): nothing left
            self._dead = state == "dead" and info is not None and info.incarnation == inc
        before = self.removed
        if not super().__call__(groups, deadline):
            return False
        ring = _ours(self._dir, names.ring(task, inc, self._consumer))
        if ring is not None and _read_ring(ring.path)[1] is None:
            # Every record taken: the ring goes, also while its consumer still maps it.
            self.removed += _unlink(ring, mapped_ok=True)
        if self._dead:
            self.removed += self._remove_record()
        if self.removed > before:
            _log.info("collected %d object(s) of dead producer %s", self.removed - before, task)
        return True

    def _remove_record(self) -> int:
        """The doorbell and record, under the record's claim (``presence.claim``: a live
        owner's lock refuses it, a successor's publish waits for it) if still that run's."""
        try:
            with claim(self._record) as dead:
                if dead.state != "dead" or dead.info is None or dead.info.incarnation != self._inc:
                    return 0  # a successor replaced it since (and may have died too)
                bell = _ours(self._dir, SEM_PREFIX + self._names.bell(self._task)[1:])
                return (0 if bell is None else _unlink(bell)) + dead.remove()
        except (OSError, RendezvousError):
            return 0


def sweep(
    shm_dir: str = SHM_DIR,
    *,
    closing: tuple[Names, str] | None = None,
    max_objects: int = MAX_OBJECTS,
    max_seconds: float = MAX_SECONDS,
    max_namespaces: int = MAX_NAMESPACES,
) -> Swept:
    """Collect what this user's dead namespaces left, here, within the bounds (listing may
    take half of ``max_seconds``); ``closing`` is ``(names, task)`` of the worker whose close
    runs it. Never raises for what it finds (what cannot go is logged); never blocks."""
    start = time.monotonic()
    scan = DirScan(shm_dir)
    scan.read(math.inf, start + max_seconds / 2)
    if not scan.done:
        scan.close()
        return Swept(0, (), False)
    job = _Sweep(shm_dir, closing, bounds=(max_objects, max_namespaces))
    done = job(scan.groups, start + max_seconds)
    return Swept(job.removed, tuple(job.collected), done and not job.waiting)


def collect_producer(
    names: Names, producer: str, incarnation: int, consumer: str, shm_dir: str = SHM_DIR
) -> int:
    """Free what the dead run ``incarnation`` of ``producer`` left, for a ``consumer`` that
    took all it sent: its unused slots, half-written segments, its ring to ``consumer`` if
    all taken, and its doorbell and record if still that run's and dead (messages and held
    slots are their consumers'). Nothing while it lives. How many went. Never blocks."""
    job = _Producer(names, producer, incarnation, consumer, shm_dir)
    job(_listing(shm_dir), time.monotonic() + MAX_SECONDS)
    return job.removed


class _Background:
    """The process's background sweeps: the work left (jobs, with the listing begun if
    any) and the thread that does it, while a Worker of the process uses sweeps (``use``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.read = {"sync": 0, "background": 0}
        self.pid, self.users = os.getpid(), 0
        self.thread: threading.Thread | None = None
        self.work: tuple[DirScan | None, list[Job]] | None = None
        self.stop = threading.Event()  # set while the last Worker stops the thread

    def _after_fork(self) -> None:
        """(Under the lock) a fork child has no thread of its parent's, nor its users."""
        if self.pid != os.getpid():
            self.pid, self.users, self.thread, self.work = os.getpid(), 0, None, None
            self.stop = threading.Event()

    def use(self, n: int) -> None:
        """A Worker starts (1) or ends (-1) using sweeps: the last one stops the thread."""
        with self.lock:
            self._after_fork()
            self.users += n
            thread = self.thread if self.users <= 0 else None
            if thread is not None:
                self.stop.set()
        if thread is not None:
            thread.join()
            self.stop.clear()

    def submit(self, scan: DirScan | None, jobs: list[Job]) -> None:
        """Leave ``jobs`` to the thread (to work not started yet, which lists after this)."""
        with self.lock:
            self._after_fork()
            if self.users > 0 and not self.stop.is_set():
                if self.work is not None:
                    self.work[1].extend(jobs)
                else:
                    self.work, scan = (scan, jobs), None
                    if self.thread is None:
                        self.thread = threading.Thread(
                            target=self._loop, name="shmrdv-sweeper", daemon=True
                        )
                        self.thread.start()
        if scan is not None:
            scan.close()

    def _loop(self) -> None:
        self.stop.wait(_FIRST_PAUSE)
        while True:
            with self.lock:
                work, self.work = self.work, None
                if work is None or self.stop.is_set():
                    self.thread = None
                    if work is not None and work[0] is not None:
                        work[0].close()
                    return
            try:
                self._do(work[0] or DirScan(), work[1])
            except Exception:  # pragma: no cover - jobs never raise for what they find
                _log.exception("background sweep of /dev/shm")

    def _do(self, scan: DirScan, jobs: list[Job]) -> None:
        """Read the listing, then run the jobs, a slice at a time, each followed by a pause
        at least as long: sweeps take at most half of what the process could run."""
        try:
            while not scan.done and not self.stop.is_set():
                t0 = time.monotonic()
                self.count("background", scan.read(_SLICE_ENTRIES, t0 + _RUN_SECONDS))
                self.stop.wait(max(_SLICE_PAUSE, time.monotonic() - t0))
        finally:
            scan.close()
        while jobs and scan.done and not self.stop.is_set():
            t0 = time.monotonic()
            jobs = [job for job in jobs if not job(scan.groups, t0 + _RUN_SECONDS)]
            if jobs:
                self.stop.wait(max(_SLICE_PAUSE, time.monotonic() - t0))

    def count(self, where: str, n: int) -> None:
        with self.lock:
            self.read[where] += n


_BACKGROUND = _Background()


def _run(what: str, jobs: list[Job]) -> None:
    """Run ``jobs`` over a listing of /dev/shm within ``SYNC_ENTRIES`` entries read and about
    ``SYNC_SECONDS`` spent here, the rest in the background. Logs a failure, never raises."""
    try:
        start = time.monotonic()
        scan = DirScan(SHM_DIR)
        _BACKGROUND.count("sync", scan.read(SYNC_ENTRIES, start + SYNC_SECONDS))
        if not scan.done:
            _BACKGROUND.submit(scan, jobs)
            return
        deadline = max(time.monotonic(), start + SYNC_SECONDS / 2) + SYNC_SECONDS / 2
        left = [job for job in jobs if not job(scan.groups, deadline)]
        if left:  # a bound stopped them: the background lists again (the directory changes)
            _BACKGROUND.submit(None, left)
    except Exception:  # pragma: no cover - nothing it expects is raised
        _log.exception("sweep of /dev/shm %s", what)


def at_start(names: Names, task: str, incarnation: int) -> bool:
    """A worker's start, once its record is published: what dead namespaces and earlier runs
    of its task left. Whether sweeps run for this worker (``SHMRDV_AUTO_GC``; for ``at_close``)."""
    if os.environ.get(ENV_VAR, "1").strip() == "0":
        return False
    _BACKGROUND.use(1)
    _run(f"at the start of {task}", [_Sweep(SHM_DIR), _Slots(names, task, None, incarnation)])
    return True


def at_close(names: Names, task: str, sweeping: bool) -> None:
    """A worker's close, once its record is gone (``sweeping``: what ``at_start`` returned):
    ``sweep``, with what was sent to it; the last Worker stops the background thread."""
    if sweeping:
        if os.environ.get(ENV_VAR, "1").strip() != "0":
            _run(f"at the close of {task}", [_Sweep(SHM_DIR, closing=(names, task))])
        _BACKGROUND.use(-1)


def after_producer(names: Names, producer: str, incarnation: int, consumer: str) -> None:
    """``collect_producer``, bounded here, for a consumer done with a producer run."""
    _run(f"after {producer}", [_Producer(names, producer, incarnation, consumer, SHM_DIR)])


def entries_read() -> dict[str, int]:
    """Directory entries this process's sweeps read: ``sync`` itself, ``background``."""
    with _BACKGROUND.lock:
        return dict(_BACKGROUND.read)


def idle(timeout: float) -> bool:
    """Wait up to ``timeout`` s for the background thread to be done; whether it is (tests)."""
    deadline = time.monotonic() + timeout
    while (thread := _BACKGROUND.thread) is not None and time.monotonic() < deadline:
        thread.join(max(0.0, min(deadline - time.monotonic(), 0.05)))
    return _BACKGROUND.thread is None
