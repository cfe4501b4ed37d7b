"""Listing and collecting shmrdv's objects in /dev/shm (``python -m shmrdv ls`` / ``gc``).

Everything shmrdv leaves in /dev/shm is named ``shmrdv_<namespace id>_<kind>...``
(``naming``), so the directory itself is the registry: no daemon, no index file to get out of date. A
namespace is *alive* while any of its workers holds the flock on its presence record
(``presence``); the kernel drops that lock when the worker dies, SIGKILL included. Segments
and semaphores of a dead namespace are garbage: nobody else can use or remove them (POSIX
semaphores and ``posix_ipc`` segments survive their creators, research/pitfalls.md §1, §4).

Only our own uid's files are listed or removed; symlinks are never followed; entries that
vanish while we look (a live worker consuming a message) are skipped. The directory is
world-writable, so the scan is built to cost little per junk entry another user plants:
a name is parsed first (pure), then ``lstat``-ed from the directory entry, and only a
regular file of ours with mode 0600-or-less is ever opened (``files.open_checked``,
which never blocks); the listing holds no lock.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable

from .._cluster import NAMESPACE_ID_HEX, describe_bad_token, namespace_id
from .._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from .files import is_ours, open_checked, peek_header
from .naming import KINDS, PREFIX, SHM_DIR, ObjectName, check_namespace, parse_name
from .presence import probe

__all__ = [
    "ObjectInfo",
    "collect",
    "list_objects",
    "namespace_alive",
    "namespace_ids",
    "records_alive",
    "records_prefix",
    "unlink_if_same",
    "unlink_if_unused",
]

_log = logging.getLogger("shmrdv.shm.registry")

# The kind letter of presence records, to find a namespace's records by prefix.
_PRESENCE_CODE = next(code for code, kind in KINDS.items() if kind == "presence")
_SEGMENT_KINDS = frozenset({"temp", "message", "pool", "held", "returned"})
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One shmrdv object in /dev/shm, as ``list_objects`` saw it.

    ``size`` is the memory it holds (allocated blocks, not the file's nominal length).
    ``owner_pid`` is the worker's pid (presence record, or the doorbell's worker) or the
    producer's pid (segment header); ``alive`` says whether that record's lock is held
    (presence records) or whether any worker of the namespace is alive (everything else).
    ``step_id`` and ``key`` come from a segment's header, ``task`` from a presence record.
    Fields are None when unknown (an unwritten temp segment, a corrupt record).
    """

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


@dataclasses.dataclass
class _Entry:
    parsed: ObjectName
    path: str
    ino: tuple[int, int]
    size: int
    mtime: float
    owner_pid: int | None = None
    alive: bool | None = None  # presence records only, until _infos() fills in the rest
    step_id: int | None = None
    key: str | None = None
    task: str | None = None


def namespace_ids(namespace: str) -> frozenset[str]:
    """The namespace ids ``namespace`` may mean: an id (16 hex characters), a token, or both.

    Raises ``InvalidArgumentError`` when it is neither.
    """
    ids: set[str] = set()
    if len(namespace) == NAMESPACE_ID_HEX and all(c in "0123456789abcdef" for c in namespace):
        ids.add(namespace)
    try:
        check_namespace(namespace)
    except InvalidArgumentError:
        if not ids:
            raise InvalidArgumentError(
                f"namespace ({describe_bad_token(namespace)}) is neither a namespace id "
                f"({NAMESPACE_ID_HEX} hex characters, as `shmrdv ls` shows) nor a namespace token"
            ) from None
    else:
        ids.add(namespace_id(namespace))
    return frozenset(ids)


def _scan(shm_dir: str, namespace: str | None, kinds: Iterable[str] | None = None) -> list[_Entry]:
    """Our files in ``shm_dir`` that shmrdv named (stat only, contents not read).

    ``namespace`` is a token or an id (``namespace_ids``). Costs one string parse per
    entry and one ``lstat`` per shmrdv-shaped name of a wanted namespace; files of other
    users, of other modes or types are skipped without being opened.
    """
    wanted = None if kinds is None else frozenset(kinds)
    ids = None if namespace is None else namespace_ids(namespace)
    out: list[_Entry] = []
    try:
        it = os.scandir(shm_dir)
    except FileNotFoundError:
        return out
    with it:
        for dirent in it:
            parsed = parse_name(dirent.name)
            if parsed is None or (ids is not None and parsed.namespace not in ids):
                continue
            if wanted is not None and parsed.kind not in wanted:
                continue
            try:
                st = dirent.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not is_ours(st):
                continue
            out.append(
                _Entry(
                    parsed=parsed,
                    path=os.path.join(shm_dir, dirent.name),
                    ino=(st.st_dev, st.st_ino),
                    size=st.st_blocks * 512,
                    mtime=st.st_mtime,
                )
            )
    return out


def _read_presence(entry: _Entry) -> None:
    try:
        state, info = probe(entry.path)
    except InternalError as e:  # changed owner or mode since the scan
        _log.debug("skipping %s: %s", entry.path, e)
        return
    if state == "absent":
        return
    entry.alive = state == "alive"
    if info is not None:
        entry.owner_pid = info.pid
        entry.task = info.task


def _read_header(entry: _Entry) -> None:
    """Fill in what the segment header says; leave None for an unwritten or corrupt one."""
    header = peek_header(entry.path)
    if header is None:
        return
    entry.owner_pid = header.producer_pid
    entry.step_id = header.step_id
    entry.key = header.key


def _inspect(shm_dir: str, namespace: str | None) -> tuple[list[_Entry], dict[str, bool]]:
    """Scan, read every record and header, and say which namespaces are alive."""
    entries = _scan(shm_dir, namespace)
    workers: dict[tuple[str, str], _Entry] = {}
    alive: dict[str, bool] = {}
    for entry in entries:
        ns = entry.parsed.namespace
        alive.setdefault(ns, False)
        if entry.parsed.kind == "presence":
            _read_presence(entry)
            alive[ns] = alive[ns] or bool(entry.alive)
            workers[ns, entry.parsed.rest] = entry
        elif entry.parsed.kind in _SEGMENT_KINDS:
            _read_header(entry)
    for entry in entries:
        if entry.parsed.kind == "presence":
            continue
        if entry.parsed.kind == "bell":
            # A bell is named by the same task hash as its worker's presence record.
            worker = workers.get((entry.parsed.namespace, entry.parsed.rest))
            if worker is not None:
                entry.owner_pid = worker.owner_pid
                entry.task = worker.task
        entry.alive = alive[entry.parsed.namespace]
    return entries, alive


def _info(entry: _Entry, now: float) -> ObjectInfo:
    return ObjectInfo(
        kind=entry.parsed.kind,
        namespace=entry.parsed.namespace,
        name=entry.parsed.entry,
        path=entry.path,
        size=entry.size,
        owner_pid=entry.owner_pid,
        alive=entry.alive,
        age_s=max(now - entry.mtime, 0.0),
        step_id=entry.step_id,
        key=entry.key,
        task=entry.task,
    )


def list_objects(namespace: str | None = None, shm_dir: str = SHM_DIR) -> list[ObjectInfo]:
    """Every shmrdv object of ours in ``shm_dir`` (of ``namespace`` only, if given: a token
    or a namespace id; ``InvalidArgumentError`` if it is neither).

    Sorted by namespace, kind and name. Reads presence records (their locks) and segment
    headers; never blocks, never follows symlinks, skips other users' files and entries that
    vanish meanwhile.
    """
    entries, _ = _inspect(shm_dir, namespace)
    now = time.time()
    infos = [_info(e, now) for e in entries]
    infos.sort(key=lambda i: (i.namespace, i.kind, i.name))
    return infos


def records_prefix(namespace_id: str) -> str:
    """What the names of the presence records of namespace ``namespace_id`` start with."""
    return f"{PREFIX}{namespace_id}_{_PRESENCE_CODE}"


def namespace_alive(namespace_id: str, shm_dir: str = SHM_DIR) -> bool:
    """Whether a worker of the namespace ``namespace_id`` holds its presence lock right now
    (one ``listdir``, then ``records_alive``)."""
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return False
    return records_alive(namespace_id, entries, shm_dir)


def records_alive(namespace_id: str, entries: Iterable[str], shm_dir: str = SHM_DIR) -> bool:
    """Whether one of the directory ``entries`` is a presence record of ``namespace_id`` of
    ours that is locked. Other names cost a string test each; another user's record one
    ``lstat``, and is never opened nor counted."""
    prefix = records_prefix(namespace_id)
    for entry in entries:
        if not entry.startswith(prefix) or parse_name(entry) is None:
            continue
        path = os.path.join(shm_dir, entry)
        try:
            if not is_ours(os.stat(path, follow_symlinks=False)):
                continue
            state, _ = probe(path)
        except (FileNotFoundError, InternalError):
            continue
        if state == "alive":
            return True
    return False


def unlink_if_same(path: str, ino: tuple[int, int]) -> bool:
    """``unlink_if_unused`` without asking whether a process has the file open: for the pool
    slots of a run known dead, which a consumer may still keep mapped for reuse (its kept
    mapping goes once the slot's names are gone, ``slotmaps.py``; the memory with it)."""
    return unlink_if_unused(path, ino, mapped_ok=True)


def unlink_if_unused(path: str, ino: tuple[int, int], *, mapped_ok: bool = False) -> bool:
    """Unlink ``path`` if it is still the file ``ino`` (``(st_dev, st_ino)``, as listed), is
    ours, and no process has it open or mapped; whether it was removed.

    "Unused" is asked of the kernel: a write lease (``F_SETLEASE``) is granted only while no
    other open file description of the file exists, mappings included. So a file a live
    process is still writing, holding (a received array) or waiting on (a doorbell) is never
    removed, whatever its namespace looks like; a worker that is starting (its presence
    record still under a temporary name, locked and open) is safe from a sweep that thought
    its namespace dead. The lease is dropped before the unlink: nobody ever waits on it.
    Where leases are off (``fs.leases-enable=0``), only the other checks are made, and so
    with ``mapped_ok`` (``unlink_if_same``). Never follows a symlink, never blocks (``files.open_checked``). Raises ``OSError``
    when the unlink itself fails (e.g. permissions).
    """
    try:
        fd, st = open_checked(path, os.O_RDONLY, "shmrdv object")
    except FileNotFoundError:
        return False
    except (InternalError, ResourceExhaustedError) as e:  # not ours, leased, no fds: leave it
        _log.debug("leaving %s: %s", path, e)
        return False
    try:
        if (st.st_dev, st.st_ino) != ino:
            return False  # replaced since the listing (a new worker's file): not ours to take
        try:
            if not mapped_ok:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EBUSY):
                _log.debug("leaving %s: a process still has it open", path)
                return False
            if e.errno != errno.EINVAL:  # EINVAL: leases are off here
                _log.debug("leaving %s: cannot tell whether it is in use (%s)", path, e)
                return False
        else:
            if not mapped_ok:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != ino:
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def collect(
    namespace: str | None = None, dry_run: bool = False, shm_dir: str = SHM_DIR
) -> list[ObjectInfo]:
    """Remove every object of the namespaces where no worker is alive; return what went.

    A namespace is collected only if none of its presence records is locked, checked again
    just before its objects are removed; within it, a file is removed only if it is still
    the one listed (a worker starting meanwhile is left alone). Objects of live namespaces
    and of other users are never touched. ``dry_run`` removes nothing and returns what would
    go. ``namespace`` is a token or a namespace id. Raises ``InternalError`` if an object
    cannot be removed (e.g. permissions), ``InvalidArgumentError`` for a ``namespace`` that
    is neither a token nor an id. Does not block.
    """
    entries, alive = _inspect(shm_dir, namespace)
    now = time.time()
    by_namespace: dict[str, list[_Entry]] = defaultdict(list)
    for entry in entries:
        by_namespace[entry.parsed.namespace].append(entry)
    removed: list[ObjectInfo] = []
    for ns in sorted(by_namespace):
        if alive.get(ns):
            continue
        group = by_namespace[ns]
        if dry_run:
            removed.extend(_info(e, now) for e in group)
            continue
        if namespace_alive(ns, shm_dir):
            _log.info("namespace id %s came alive while collecting; left alone", ns)
            continue
        # Presence records last: while one is there, tools still see whose the rest was.
        group.sort(key=lambda e: e.parsed.kind == "presence")
        count = len(removed)
        for entry in group:
            try:
                gone = unlink_if_unused(entry.path, entry.ino)
            except OSError as e:
                raise InternalError(f"cannot remove {entry.path}: {e}") from e
            if gone:
                removed.append(_info(entry, now))
        _log.info("collected %d object(s) of dead namespace id %s", len(removed) - count, ns)
    removed.sort(key=lambda i: (i.namespace, i.kind, i.name))
    return removed
