"""Presence records: a worker's liveness, as a JSON file in /dev/shm locked with ``flock``.

A worker publishes ``shmrdv_<ns>_w<taskhash>`` (its task, pid, boot id, incarnation, start
time, address) and holds ``fcntl.flock(LOCK_EX)`` on it for as long as it lives. A peer is
alive exactly when that lock is held: the kernel drops it when the last descriptor of the
open file description goes away, that is when the owner dies, however it dies (SIGKILL
included). A SIGSTOPped or busy process keeps its lock, so it is not declared dead, which
no heartbeat with a deadline can promise (research/pitfalls.md §1: the only cleanup after a
SIGKILL is what the kernel does).

``flock`` locks belong to the open file description, so:

* a second ``open`` of the same file, even in the same process, gets its own description and
  its own lock: ``PeerWatch`` can observe a ``Presence`` owned by its own process;
* a ``fork`` shares the description with the child, which would keep a dead parent's lock
  alive. An ``os.register_at_fork`` hook closes the inherited descriptors in every forked
  child (``subprocess`` children never see them: ``os.open`` descriptors are close-on-exec).

The record is written completely into a temporary name and only then linked (or renamed)
onto its final name, so a reader never sees a half-written record.

This module owns what a record says (``PresenceInfo``), a worker's own record
(``Presence``), whether a record's owner lives (``probe`` for tools, ``PeerWatch`` for
peers, with a cached descriptor) and where a task has records in any namespace of this
user (``sightings``, for a diagnosis only).

Thread model (``docs/threads.md``): no thread of its own. A ``PeerWatch`` only *tries*
its lock (it may be asked inside the garbage collector); ``Presence`` is owned by its
Worker's board.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from .._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from .._rendezvous import Closing

if TYPE_CHECKING:
    from .naming import Names
import functools
import json
from typing import TYPE_CHECKING, Any, Literal

from .files import open_checked, refuse_foreign

if TYPE_CHECKING:
    from .naming import Names
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .naming import Names
import stat

from .._errors import RendezvousError
from .._transport import Sighting
from .files import is_ours
from .naming import SHM_DIR, parse_name

__all__ = [
    "MAX_RECORD_BYTES",
    "PeerState",
    "PeerWatch",
    "Presence",
    "PresenceInfo",
    "boot_id",
    "check_ours",
    "describe_owner",
    "lock_held",
    "open_record",
    "probe",
    "read_bytes",
    "read_presence",
    "read_record",
    "read_record_stat",
    "record_state",
    "sightings",
]


PeerState = Literal["absent", "alive", "dead"]

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# A record is a few hundred bytes; anything much larger was not written by us.
MAX_RECORD_BYTES = 64 * 1024


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``), read once and cached.

    Raises ``InternalError`` if the file cannot be read (not Linux, or no /proc).
    """
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError as e:
        raise InternalError(f"cannot read the boot id from {_BOOT_ID_PATH}: {e}") from e


@dataclasses.dataclass(frozen=True)
class PresenceInfo:
    """What a presence record says about a worker."""

    task: str  # canonical task name, e.g. /job:worker/replica:0/task:1
    pid: int
    boot_id: str
    incarnation: int  # uint64
    started: float  # time.time() at publish
    namespace: str  # the namespace id (public); never the token
    address: str | None = None  # the worker's gRPC address, if it serves one
    # The transports the worker accepts, in its order of preference (TensorPipe's
    # "brochure"): a peer that sees this record picks the first it has too.
    transports: tuple[str, ...] = ("shm", "grpc")

    def to_json(self) -> bytes:
        """The record's bytes."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> PresenceInfo:
        """Parse a record; ``InternalError`` naming ``where`` if it is not a valid one."""
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise InternalError(f"presence record {where} is corrupt: {e}") from e
        if not isinstance(obj, dict):
            raise InternalError(f"presence record {where} is corrupt: not a JSON object")
        fields: dict[str, tuple[type, ...]] = {
            "task": (str,),
            "pid": (int,),
            "boot_id": (str,),
            "incarnation": (int,),
            "started": (int, float),
            "namespace": (str,),
            "address": (str, type(None)),
        }
        values: dict[str, Any] = {}
        for name, types in fields.items():
            value = obj.get(name)
            if name not in obj or isinstance(value, bool) or not isinstance(value, types):
                raise InternalError(
                    f"presence record {where} is corrupt: field {name!r} is missing or has the "
                    f"wrong type ({value!r})"
                )
            values[name] = value
        values["started"] = float(values["started"])
        transports = obj.get("transports", ["shm", "grpc"])
        if not isinstance(transports, list) or not all(isinstance(t, str) for t in transports):
            raise InternalError(
                f"presence record {where} is corrupt: field 'transports' is {transports!r}"
            )
        values["transports"] = tuple(transports)
        return cls(**values)


def check_ours(st: os.stat_result, where: str, what: str = "presence record") -> None:
    """Refuse a file another user planted under our name (pitfalls.md §7: fstat on attach)."""
    refuse_foreign(st, where, what)


def read_bytes(fd: int, where: str) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, MAX_RECORD_BYTES + 1 - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        if offset > MAX_RECORD_BYTES:
            raise InternalError(f"presence record {where} is larger than {MAX_RECORD_BYTES} bytes")
    return b"".join(chunks)


def read_record_stat(fd: int, where: str) -> tuple[PresenceInfo, os.stat_result]:
    st = os.fstat(fd)
    check_ours(st, where)
    return PresenceInfo.from_json(read_bytes(fd, where), where), st


def open_record(path: str) -> int | None:
    """Open a record for reading; None if it does not exist (``files.open_checked``:
    never blocks; a symlink, a foreign or leased file is an ``InternalError``)."""
    try:
        fd, _ = open_checked(path, os.O_RDONLY, "presence record", max_size=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    return fd


def read_record(fd: int, where: str) -> PresenceInfo:
    """What the record open at ``fd`` says (for one who holds its lock, ``reaper``). Raises
    ``InternalError`` naming ``where`` if it is not ours or is corrupt. Does not block."""
    return read_record_stat(fd, where)[0]


def read_presence(names: Names, task: str) -> PresenceInfo | None:
    """Read ``task``'s presence record, whether its owner is alive or not.

    Returns None if there is none. Raises ``InternalError`` if the record is not ours (another
    owner uid, group/other permission bits, not a regular file, a symlink) or is corrupt.
    Does not block.
    """
    path = names.path(names.presence(task))
    fd = open_record(path)
    if fd is None:
        return None
    try:
        info, _ = read_record_stat(fd, path)
        return info
    finally:
        os.close(fd)


def describe_owner(fd: int, where: str) -> str:
    try:
        info = PresenceInfo.from_json(read_bytes(fd, where), where)
    except (InternalError, OSError):
        return "an unknown process"
    if info.pid == os.getpid() and info.boot_id == boot_id():
        return f"this process itself (pid {info.pid}, incarnation {info.incarnation:#x})"
    return f"pid {info.pid} (incarnation {info.incarnation:#x})"


_log = logging.getLogger("shmrdv.shm.presence")


def lock_held(fd: int) -> bool:
    """Whether some other open file description holds a lock on ``fd``'s file.

    Takes and at once drops a shared lock: it fails only while an exclusive lock is held.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def probe(path: str) -> tuple[PeerState, PresenceInfo | None]:
    """The state of the record file at ``path`` and what it says, for tools (``registry``).

    ``("absent", None)`` if there is no file. The state comes from the lock alone (plus the
    boot id when the content is readable), so a corrupt record still reads ``"alive"`` or
    ``"dead"``, with ``None`` for its content. Raises ``InternalError`` if the file is not
    ours (owner, mode, symlink). Does not block.
    """
    fd = open_record(path)
    if fd is None:
        return "absent", None
    try:
        check_ours(os.fstat(fd), path)
        try:
            info: PresenceInfo | None = PresenceInfo.from_json(read_bytes(fd, path), path)
        except InternalError as e:
            _log.debug("%s", e)
            info = None
        return record_state(fd, info), info
    finally:
        os.close(fd)


def record_state(fd: int, info: PresenceInfo | None) -> PeerState:
    """The liveness check proper: a record's owner is alive exactly while it holds the lock.

    A record from another boot is ``"dead"`` whatever its lock says. One ``flock`` test.
    """
    if info is not None and info.boot_id != boot_id():
        return "dead"
    return "alive" if lock_held(fd) else "dead"


class PeerWatch(Closing):
    """The observer side: is another worker's presence record there, and is it locked?

    ``state()`` costs one ``stat`` and one ``flock`` while the record is unchanged (one
    descriptor is cached per inode), so it may be called several times a second.

    Never blocks and never waits for a lock, so that it may run anywhere, a
    garbage-collector finalizer included (a lock waited for there could be held by the
    interrupted thread itself): the cached descriptor is used under a lock taken only if
    it is free; a caller that finds it taken looks through a descriptor of its own, opened
    and closed within the call. A watch thus holds at most one descriptor of its own.
    """

    def __init__(self, names: Names, task: str) -> None:
        self._task = task
        self._path = names.path(names.presence(task))
        self._lock = threading.Lock()
        self._ino: tuple[int, int] | None = None
        self._info: PresenceInfo | None = None
        self._closed = False
        # The finalizer closes the cached descriptor when the watch is dropped unclosed.
        self._fd_box: list[int] = []
        self._finalizer = weakref.finalize(self, _close_all, self._fd_box)

    @property
    def task(self) -> str:
        return self._task

    @property
    def path(self) -> str:
        return self._path

    @property
    def closed(self) -> bool:
        return self._closed

    def _cached(self) -> tuple[int, PresenceInfo] | None:
        """The record at the path now through the cached descriptor (re-opened when its
        inode changed), or None. Under ``_lock``.

        Raises ``InternalError`` if the record is not ours or is corrupt.
        """
        try:
            st = os.stat(self._path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        box = self._fd_box
        if box and self._ino == (st.st_dev, st.st_ino):
            assert self._info is not None
            return box[0], self._info
        _close_all(box)
        self._ino = self._info = None
        fd = open_record(self._path)
        if fd is None:
            return None
        try:
            info, fst = read_record_stat(fd, self._path)
        except BaseException:
            os.close(fd)
            raise
        box.append(fd)
        # The inode actually opened: the name may have moved on since the stat above, in which
        # case the next call sees a mismatch and reopens.
        self._ino = (fst.st_dev, fst.st_ino)
        self._info = info
        return fd, info

    def look(self) -> tuple[PeerState, PresenceInfo | None]:
        """``state()`` and ``info()`` of one and the same record, in one look.

        Raises ``InternalError`` if the record is not ours or is corrupt, or the watch is
        closed. Does not block.
        """
        if self._closed:
            raise InternalError(f"PeerWatch for {self._task} is closed")
        if self._lock.acquire(blocking=False):
            try:
                if self._closed:
                    raise InternalError(f"PeerWatch for {self._task} is closed")
                seen = self._cached()
                if seen is None:
                    return "absent", None
                return record_state(seen[0], seen[1]), seen[1]
            finally:
                self._lock.release()
        # Contended (another thread, or the garbage collector inside this one): look
        # through a descriptor of our own.
        fd = open_record(self._path)
        if fd is None:
            return "absent", None
        try:
            info, _ = read_record_stat(fd, self._path)
            return record_state(fd, info), info
        finally:
            os.close(fd)

    def info(self) -> PresenceInfo | None:
        """The current record (re-read when it was replaced, e.g. by a restarted peer), or None.

        Raises ``InternalError`` if the record is not ours or is corrupt. Does not block.
        """
        return self.look()[1]

    def state(self) -> PeerState:
        """``"absent"`` (no record), ``"alive"`` (its lock is held) or ``"dead"`` (lock free).

        A record from another boot is ``"dead"``. Raises ``InternalError`` if the record is not
        ours or is corrupt. Does not block.
        """
        return self.look()[0]

    def open_fds(self) -> int:
        """How many descriptors the watch holds (at most one)."""
        return len(self._fd_box)

    def close(self) -> None:
        """Close the cached descriptor. Idempotent. (A look running meanwhile in another
        thread finishes first: close waits for it, which takes microseconds.)"""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ino = self._info = None
            self._finalizer()

    def __repr__(self) -> str:
        return f"<PeerWatch {self._task} {'closed' if self._closed else 'open'}>"


def _close_all(fds: list[int]) -> None:
    """Close every descriptor in ``fds`` (each popped first: closed exactly once)."""
    while True:
        try:
            fd = fds.pop()
        except IndexError:
            return
        with contextlib.suppress(OSError):
            os.close(fd)


# How often publish() looks again when it finds a record whose lock is held: another
# publisher may hold it for a few microseconds while it replaces a stale record.
_PUBLISH_ATTEMPTS = 5
_PUBLISH_RETRY_S = 0.01


# Every open Presence of this process, so a forked child can drop the inherited locks.
_live: weakref.WeakSet[Presence] = weakref.WeakSet()
_live_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # The child shares each presence fd's open file description with its parent; keeping it
    # would keep the parent "alive" after its death for as long as the child lives.
    # Closing our copy drops no lock the parent relies on: the lock belongs to the
    # description, which the parent still holds open. The lock is re-created: the parent's
    # may have been held by the forking thread.
    global _live_lock
    _live_lock = threading.Lock()
    for presence in list(_live):
        presence._forget_after_fork()
    _live.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_fd(fd: int, path: str, ino: tuple[int, int]) -> None:
    """Unlink ``path`` if it is still our record, then close ``fd`` (which drops the lock).

    Unlinking first: a peer that sees the lock free and the record still there concludes
    "dead", which is right a moment later anyway.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        pass
    except OSError as e:
        _log.warning("cannot stat presence record %s at close: %s", path, e)
    else:
        if (st.st_dev, st.st_ino) == ino:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    os.close(fd)


class Presence(Closing):
    """The owner side: this process's presence record for one task, locked while open.

    Create with ``Presence.publish``. ``close()`` unlinks the record (if it is still ours)
    and drops the lock; it is idempotent, and a ``weakref.finalize`` does the same if the
    object is dropped unclosed. The kernel drops the lock if the process dies.
    """

    def __init__(self, names: Names, info: PresenceInfo, fd: int, path: str) -> None:
        """Internal: use ``Presence.publish``."""
        self._names = names
        self._info = info
        self._fd = fd
        self._path = path
        st = os.fstat(fd)
        self._ino = (st.st_dev, st.st_ino)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_fd, fd, path, self._ino)
        with _live_lock:
            _live.add(self)

    @classmethod
    def publish(cls, names: Names, info: PresenceInfo) -> Presence:
        """Write ``info`` as ``info.task``'s record and lock it; return the owner handle.

        A record left by a dead worker (its lock free) is replaced. Raises
        ``InvalidArgumentError`` if a live process holds the task's record, ``InternalError``
        if the record there is not ours or a file cannot be written. Does not block (beyond a
        few 10 ms retries while another publisher replaces a stale record).
        """
        # The record names its namespace by the public id, never the token (issue 20 §2).
        info = dataclasses.replace(info, namespace=names.namespace_id)
        final = names.path(names.presence(info.task))
        data = info.to_json()
        temp = names.path(names.temp())
        try:
            fd = os.open(
                temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
        except OSError as e:
            raise _publish_error(e, temp) from e
        try:
            os.fchmod(fd, 0o600)  # umask-proof
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, "short write", temp)
            except OSError as e:
                raise _publish_error(e, temp) from e
            # Locked before it has its final name: no reader can ever see it unlocked.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            cls._install(temp, final, info)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            os.close(fd)
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        _log.debug("published presence %s for %s (pid %d)", final, info.task, info.pid)
        return cls(names, info, fd, final)

    @staticmethod
    def _install(temp: str, final: str, info: PresenceInfo) -> None:
        """Give the locked ``temp`` the name ``final``, replacing a stale record only."""
        for attempt in range(_PUBLISH_ATTEMPTS):
            try:
                # link, not rename: it refuses an existing name, so two publishers racing
                # for a free name cannot both win (pitfalls.md §3).
                os.link(temp, final, follow_symlinks=False)
                return
            except FileExistsError:
                pass
            except OSError as e:
                raise InternalError(f"cannot publish presence record {final}: {e}") from e
            old = open_record(final)
            if old is None:
                continue  # vanished meanwhile: try the link again
            try:
                st = os.fstat(old)
                check_ours(st, final)
                try:
                    # Exclusive: every replacer takes it, so replacements of one stale record
                    # are serialised, and a live owner's lock makes it fail.
                    fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if attempt + 1 < _PUBLISH_ATTEMPTS:
                        time.sleep(_PUBLISH_RETRY_S)
                        continue
                    raise InvalidArgumentError(
                        f"task {info.task} is already running in {describe_owner(old, final)} "
                        f"(namespace id {info.namespace}, record {final}): one Worker per task "
                        "and namespace; close that one first, or start this one for another task"
                    ) from None
                try:
                    now = os.stat(final, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    continue  # someone replaced it first: look at the new one
                _log.info(
                    "replacing stale presence record %s (%s)", final, describe_owner(old, final)
                )
                os.rename(temp, final)
                return
            finally:
                os.close(old)
        raise InternalError(f"cannot publish presence record {final}: it keeps changing")

    @property
    def info(self) -> PresenceInfo:
        """What the record says."""
        return self._info

    @property
    def path(self) -> str:
        """The record's path in /dev/shm."""
        return self._path

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran (or the handle was dropped in a forked child)."""
        return self._closed

    def close(self) -> None:
        """Unlink the record if it is still ours, then drop the lock. Idempotent; never blocks."""
        if self._closed:
            return
        self._closed = True
        with _live_lock:
            _live.discard(self)
        self._finalizer()

    def _forget_after_fork(self) -> None:
        # In a forked child: close our copy of the fd only. Never unlink: the record is the
        # parent's. Detaching the finalizer stops it from unlinking at the child's exit.
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<Presence {self._info.task} pid={self._info.pid} "
            f"incarnation={self._info.incarnation:#x} {state}>"
        )


def _publish_error(e: OSError, path: str) -> Exception:
    """A full /dev/shm (no room, no inodes, the memory cgroup) is ``ResourceExhaustedError``
    (issue 13 §5), anything else ``InternalError``."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG):
        try:
            st = os.statvfs(os.path.dirname(path))
            free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
        except OSError:
            free = "unknown space free"
        return ResourceExhaustedError(
            f"cannot write presence record {path}: {e.strerror}; {os.path.dirname(path)} has "
            f"{free}. In a container, give it more (docker run --shm-size=...); remove what "
            "dead processes left behind with `python -m shmrdv gc`"
        )
    return InternalError(f"cannot create presence record {path}: {e}")


# Bounds of one look: a presence record is a few hundred bytes; a user rarely runs more
# than a few dozen workers, so 256 records cover every sane case at a bounded cost.
_MAX_RECORDS = 256
_MAX_BYTES = 4096


def sightings(task: str, namespace: str, *, shm_dir: str = SHM_DIR) -> list[Sighting]:
    """Every presence record of this user naming ``task`` (canonical), in any namespace.

    ``namespace``: the caller's, as it appears in object names (``Sighting.ours``).

    Bounded (``_MAX_RECORDS`` records, ``_MAX_BYTES`` each); skips other users' files,
    symlinks, anything not shmrdv's and records that vanish or change meanwhile. Never
    raises for what it finds; never blocks.
    """
    out: list[Sighting] = []
    looked = 0
    try:
        it = os.scandir(shm_dir)
    except OSError:
        return out
    with it:
        for dirent in it:
            # A cheap look before parse_name: only a presence record has "_w" (its kind
            # letter after the namespace id; ids and hashes are hex), and a flood of other
            # names must cost a timed-out receive next to nothing.
            if "_w" not in dirent.name:
                continue
            parsed = parse_name(dirent.name)
            if parsed is None or parsed.kind != "presence":
                continue
            try:
                st = dirent.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or not is_ours(st) or st.st_size > _MAX_BYTES:
                continue
            looked += 1
            if looked > _MAX_RECORDS:
                break
            try:
                state, info = probe(os.path.join(shm_dir, dirent.name))
            except (RendezvousError, OSError):
                continue  # changed owner or mode since the lstat, or out of descriptors
            if info is None or info.task != task:
                continue
            out.append(
                Sighting(
                    parsed.namespace, info.pid, state == "alive", parsed.namespace == namespace
                )
            )
    return out
