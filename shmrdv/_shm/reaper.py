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
  (a producer may send and close first): they wait ``GRACE_S`` after their last write or
  rename, unless they are addressed to the worker whose close runs the sweep (its own,
  which it will never take). A sweep is bounded in time, objects and namespaces: what it
  leaves, the next one takes. ``SHMRDV_AUTO_GC=0`` turns sweeps off (to look at what a
  crashed job left, with ``shmrdv ls``).
* ``collect_producer()`` is for a consumer that has taken everything a dead producer run
  sent it: it frees what is left of that run and that nobody will take any more (its free
  and returned pool slots, half-written segments, its ring to that consumer, and, while
  its record stays dead, its doorbell and record). Unreceived messages to other consumers
  are theirs and stay.

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
from collections import defaultdict

from .._cluster import NAMESPACE_ID_HEX
from .._errors import InternalError, InvalidArgumentError, RendezvousError
from .._keys import DeviceName, parse_key
from .files import is_ours, open_checked, peek_header
from .naming import PREFIX, SEM_PREFIX, SHM_DIR, SLOT_BITS, Names, ObjectName, parse_name
from .presence import probe, read_record
from .registry import namespace_alive, records_alive, unlink_if_same, unlink_if_unused
from .ring import Ring

__all__ = [
    "ENV_VAR",
    "GRACE_S",
    "MAX_NAMESPACES",
    "MAX_OBJECTS",
    "MAX_SECONDS",
    "Swept",
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
#: Messages and rings of a dead namespace wait this long (seconds since they were last
#: written or renamed) for a consumer that has not started yet: a producer may send and
#: close before its consumer starts (tests/test_shm_ring.py).
GRACE_S = 30.0
# A ring is ~1 MiB (``ring.ring_size``); anything much larger is not read whole.
_RING_MAX_BYTES = 16 << 20
# What a consumer that starts later may still take.
_FOR_A_CONSUMER = frozenset({"message", "ring"})
# Objects a sweep of a dead namespace tries to remove even when out of time.
_AT_LEAST = 64
# What names of semaphores (doorbells) start with.
_SEM_NAMES = SEM_PREFIX + PREFIX
# Directory entries looked at between two looks at the clock.
_CLOCK_EVERY = 256
# Kinds a dead producer run may leave that belong to nobody else (messages and held slots
# are their consumers').
_PRODUCER_KINDS = frozenset({"pool", "returned", "temp"})
_SLOT_KINDS = frozenset({"pool", "returned"})


def enabled() -> bool:
    """Whether sweeps run (``SHMRDV_AUTO_GC`` is not ``0``)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def at_start(names: Names, task: str, incarnation: int) -> None:
    """What a worker's start collects, once its presence record is published: ``sweep()``,
    then what earlier runs of its task left (``collect_earlier_runs``). Logs a failure,
    never raises it (a worker starts whatever was left behind)."""
    if not enabled():
        return
    try:
        sweep()
        collect_earlier_runs(names, task, incarnation)
    except Exception:  # pragma: no cover - nothing it expects is raised
        _log.exception("sweep of /dev/shm at the start of %s", task)


def at_close(names: Names, task: str) -> None:
    """What a worker's close collects, once its presence record is gone: ``sweep()`` with
    what was sent to it, if its job ends with it. Logs a failure, never raises it."""
    if not enabled():
        return
    try:
        sweep(closing=(names, task))
    except Exception:  # pragma: no cover - nothing it expects is raised
        _log.exception("sweep of /dev/shm at the close of %s", task)


@dataclasses.dataclass(frozen=True)
class Swept:
    """What one ``sweep`` did: objects removed, the dead namespaces (ids) it collected from,
    and whether it got through everything (False: a bound stopped it; the next sweep goes on)."""

    removed: int
    namespaces: tuple[str, ...]
    complete: bool


def _group(shm_dir: str, deadline: float) -> dict[str, list[str]] | None:
    """The shmrdv-looking names in ``shm_dir`` by namespace id (string slicing only: names
    are parsed later, and only in namespaces that turn out dead); None if the deadline passed
    first (a flood of names: try next time)."""
    groups: dict[str, list[str]] = defaultdict(list)
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return {}
    plain, sem = len(PREFIX), len(SEM_PREFIX) + len(PREFIX)
    id_len = NAMESPACE_ID_HEX
    for i, entry in enumerate(entries):
        if i % _CLOCK_EVERY == 0 and time.monotonic() > deadline:
            return None
        if entry.startswith(PREFIX):
            groups[entry[plain : plain + id_len]].append(entry)
        elif entry.startswith(_SEM_NAMES):
            groups[entry[sem : sem + id_len]].append(entry)
    return groups


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
    those wait for a consumer that has not started yet, up to ``GRACE_S`` after they were
    last written or renamed, unless they are addressed to the closing worker (it will never
    take them: they were its own). Never raises for what it finds (an object it cannot
    remove is left and logged); never blocks.
    """
    start = time.monotonic()
    deadline = start + max_seconds
    # Listing and looking may take half the time; removing gets the rest, and always a few
    # objects: a sweep of a crowded directory still makes progress.
    looking_until = start + max_seconds / 2
    groups = _group(shm_dir, looking_until)
    if groups is None:
        _log.debug("sweep of %s stopped: listing it took more than %.2f s", shm_dir, max_seconds)
        return Swept(0, (), False)
    removed = 0
    collected: list[str] = []
    complete = True
    looked = 0
    for ns, group in groups.items():
        if removed >= max_objects or time.monotonic() > deadline or looked >= max_namespaces:
            complete = False
            break
        if records_alive(ns, group, shm_dir):
            continue
        listed: list[_Listed] = []
        for i, entry in enumerate(group):
            if len(listed) >= max_objects - removed or (
                i % _CLOCK_EVERY == 0 and time.monotonic() > looking_until
            ):
                complete = False  # the rest next time
                break
            parsed = parse_name(entry)
            if parsed is None:
                continue
            path = os.path.join(shm_dir, entry)
            seen = _stat_listed(parsed, path)  # another user's name: one lstat, never an open
            if seen is not None:
                listed.append(seen)
        if not listed:
            continue  # nothing of ours (another user's names): costs no namespace of the bound
        looked += 1
        # Again, now that the files are listed: a worker that published since is seen, and
        # everything it makes from now on is not in the list.
        if namespace_alive(ns, shm_dir):
            continue
        mine = closing if closing is not None and closing[0].namespace_id == ns else None
        theirs = set() if mine is None else _addressed_to(mine[1], listed)
        waiting = time.time() - GRACE_S
        listed.sort(key=lambda e: e.kind == "presence")  # records last: `ls` shows whose
        count = tried = 0
        for e in listed:
            if tried >= _AT_LEAST and time.monotonic() > deadline:
                complete = False
                break
            if e.kind in _FOR_A_CONSUMER and e.path not in theirs and e.changed > waiting:
                complete = False  # may be for a consumer about to start: a later sweep
                continue
            tried += 1
            try:
                count += unlink_if_unused(e.path, e.ino)
            except OSError as err:
                _log.warning("cannot remove %s of dead namespace %s: %s", e.path, ns, err)
        if count:
            removed += count
            collected.append(ns)
            _log.info("collected %d object(s) left by the dead workers of namespace %s", count, ns)
    return Swept(removed, tuple(collected), complete)


@dataclasses.dataclass(frozen=True)
class _Listed:
    kind: str
    path: str
    ino: tuple[int, int]
    changed: float  # last write or rename (max of mtime and ctime)


def _stat_listed(parsed: ObjectName, path: str) -> _Listed | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not is_ours(st):
        return None
    return _Listed(parsed.kind, path, (st.st_dev, st.st_ino), max(st.st_mtime, st.st_ctime))


def _addressed_to(task: str, listed: list[_Listed]) -> set[str]:
    """The paths among ``listed`` of messages and rings addressed to ``task``: a message by
    the key in its header, a ring by the description its producer wrote into it."""
    try:
        me = DeviceName.parse(task).task_key()
    except InvalidArgumentError:
        return set()
    out: set[str] = set()
    for e in listed:
        if e.kind == "message":
            header = peek_header(e.path)
            dst = None if header is None else _task_of_key(header.key)
        elif e.kind == "ring":
            dst = _ring_consumer(e.path)
        else:
            continue
        if dst is not None and dst == me:
            out.add(e.path)
    return out


def _task_of_key(key: str) -> tuple[str, int, int] | None:
    try:
        return parse_key(key).dst.task_key()
    except InvalidArgumentError:
        return None


def _ring_consumer(path: str) -> tuple[str, int, int] | None:
    """The consumer task a ring was made for (its description, ``Ring.meta``), or None.
    The ring is read with ``pread`` into a private buffer, never mapped: a truncation by
    another process costs nothing, and no mapping of ours keeps the file in use."""
    try:
        fd, st = open_checked(path, os.O_RDONLY, "ring", max_size=_RING_MAX_BYTES)
    except (OSError, RendezvousError):
        return None
    try:
        data = bytearray(os.pread(fd, st.st_size, 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        ring = Ring(memoryview(data))
        try:
            meta = json.loads(ring.meta())
        finally:
            ring.release()
        return DeviceName.parse(str(meta["consumer"])).task_key()
    except (RendezvousError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return None  # not a ring of ours (a corrupt or truncated file): not addressed to us


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

    For a consumer (``consumer_task``) that has taken everything that run sent it, once it
    has unmapped that run's ring: removes the run's free and ``returned`` pool slots and its
    half-written segments (told by the incarnation in their header, and for slots by their
    name), its ring to ``consumer_task``, and, if its presence record is still that run's and
    dead, its doorbell and then the record (under the record's lock, so a successor that
    publishes meanwhile waits a moment and its doorbell is never taken). Messages not
    received and ``held`` slots belong to their consumers and stay. Does nothing while the
    run is alive. Every removal is ``registry.unlink_if_unused``: nothing open or mapped by
    any process goes. Never blocks; never raises for what it finds.
    """
    record = os.path.join(shm_dir, names.presence(producer_task))
    try:
        state, info = probe(record)
    except InternalError as e:
        _log.debug("not collecting %s: %s", producer_task, e)
        return 0
    if state == "alive" and (info is None or info.incarnation == incarnation):
        return 0  # that run lives (or a corrupt record hides which run): nothing is left over
    removed = _collect_slots(names, producer_task, shm_dir, max_objects, run=incarnation)
    ring = os.path.join(shm_dir, names.ring(producer_task, incarnation, consumer_task))
    ino = _stat_ours(ring)
    if ino is not None:
        removed += _unlink(ring, ino)
    if state == "dead" and info is not None and info.incarnation == incarnation:
        removed += _remove_dead_worker(names, producer_task, incarnation, record, shm_dir)
    if removed:
        _log.info(
            "collected %d object(s) left by dead producer %s (incarnation %016x)",
            removed,
            producer_task,
            incarnation,
        )
    return removed


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
    went. Never blocks; never raises for what it finds."""
    removed = _collect_slots(names, task, shm_dir, max_objects, but=incarnation)
    if removed:
        _log.info("collected %d pool slot(s) of earlier runs of %s", removed, task)
    return removed


def _collect_slots(
    names: Names,
    task: str,
    shm_dir: str,
    max_objects: int,
    *,
    run: int | None = None,
    but: int | None = None,
) -> int:
    """Unused pool slots (free, ``returned``) of ``task``'s run ``run`` (or of every run but
    ``but``), and, for ``run``, its half-written segments: told by the producer incarnation
    in their header, and a slot by its name too (only that task and run make it)."""
    deadline = time.monotonic() + MAX_SECONDS
    try:
        entries = [e for e in os.listdir(shm_dir) if e.startswith(names.prefix)]
    except OSError:
        return 0
    kinds = _PRODUCER_KINDS if run is not None else _SLOT_KINDS
    removed = 0
    for entry in entries:
        if removed >= max_objects or time.monotonic() > deadline:
            break
        parsed = parse_name(entry)
        if parsed is None or parsed.kind not in kinds:
            continue
        path = os.path.join(shm_dir, entry)
        header = peek_header(path)
        if header is None:
            continue
        inc = header.producer_incarnation
        if (run is not None and inc != run) or (but is not None and inc == but) or not inc:
            continue
        if parsed.kind in _SLOT_KINDS and not _is_slot_of(
            names, parsed.kind, task, inc, header.slot, entry
        ):
            continue  # another producer's slot, or a name that is no slot of that run
        ino = _stat_ours(path)
        if ino is not None:
            # A slot of a dead run may still be kept mapped by a consumer for reuse: its
            # names go anyway (the mapping follows, slotmaps.py). A temp must be unused.
            removed += _unlink(path, ino, mapped_ok=parsed.kind in _SLOT_KINDS)
    return removed


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
