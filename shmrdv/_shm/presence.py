"""Presence records: whether a worker lives, as a JSON file in /dev/shm locked with ``flock``.

A worker holds ``flock(LOCK_EX)`` on its record while it lives: the kernel drops the lock
however the owner dies, and a stopped or busy process keeps it, which no heartbeat with a
deadline can promise (research/pitfalls.md §1). As iceoryx2 cuts its ``monitoring``:
``Presence`` (the token), ``Monitor`` / ``look`` (the monitor), ``claim`` (the cleaner: the
one way a dead record is replaced or removed). Every open is ``files.open_checked``.

Thread model (docs/threads.md): no thread of its own. A ``Monitor`` may be asked inside the
garbage collector (a pool slot given back), so it only *tries* locks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._errors import InternalError, InvalidArgumentError
from .._rendezvous import Closing
from .._transport import PeerRecord, PeerState, TaskState
from .files import inode, open_checked, os_error

if TYPE_CHECKING:
    from .naming import Names

__all__ = ["Claim", "Monitor", "Presence", "PresenceInfo", "boot_id", "claim", "look"]

_log = logging.getLogger("shmrdv.shm.presence")

# A record is a few hundred bytes; anything much larger was not written by us.
MAX_RECORD_BYTES = 64 * 1024


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This kernel's boot id, read once. ``InternalError`` if it cannot be read (no /proc)."""
    path = "/proc/sys/kernel/random/boot_id"
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError as e:
        raise InternalError(f"cannot read the boot id from {path}: {e}") from e


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
        transports = obj.get("transports", ["shm", "grpc"])
        if not isinstance(transports, list) or not all(isinstance(t, str) for t in transports):
            raise InternalError(
                f"presence record {where} is corrupt: field 'transports' is {transports!r}"
            )
        values["started"] = float(values["started"])
        return cls(**values, transports=tuple(transports))


def _open(path: str, strict: bool) -> tuple[int, os.stat_result, PresenceInfo | None] | None:
    """The record at ``path`` opened, its ``fstat`` and what it says; None if there is none.
    A corrupt record raises if ``strict``, else says None (its lock still tells)."""
    try:
        fd, st = open_checked(path, os.O_RDONLY, "presence record", max_size=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    try:
        return fd, st, PresenceInfo.from_json(os.pread(fd, MAX_RECORD_BYTES, 0), path)
    except InternalError as e:
        if strict:
            os.close(fd)
            raise
        _log.debug("%s", e)
        return fd, st, None
    except BaseException:  # a failed read: the descriptor is not the caller's
        os.close(fd)
        raise


def _state(fd: int, info: PresenceInfo | None) -> PeerState:
    """Alive exactly while the owner holds the lock (only then does a shared lock fail); a
    record from another boot is dead."""
    if info is not None and info.boot_id != boot_id():
        return "dead"
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return "alive"
    fcntl.flock(fd, fcntl.LOCK_UN)
    return "dead"


def look(path: str, *, strict: bool = False) -> tuple[PeerState, PresenceInfo | None]:
    """The state of the record at ``path`` and what it says (``("absent", None)``: none; a
    corrupt one says None unless ``strict``). Raises ``InternalError`` if the file is not
    ours or, if ``strict``, corrupt. Does not block."""
    opened = _open(path, strict)
    if opened is None:
        return "absent", None
    fd, _, info = opened
    try:
        return _state(fd, info), info
    finally:
        os.close(fd)


def _task_state(task: str, state: PeerState, info: PresenceInfo | None) -> TaskState:
    if info is None or info.boot_id != boot_id():
        return TaskState(state)
    record = PeerRecord(task, True, info.transports, info.address, True, info.incarnation, info.pid)
    return TaskState(state, record)


class _Seen:
    __slots__ = ("fd", "info", "ino", "path")

    def __init__(self, path: str) -> None:
        self.path, self.fd = path, -1
        self.ino: tuple[int, int] | None = None
        self.info: PresenceInfo | None = None


def _close_all(seen: dict[str, _Seen], lock: threading.Lock) -> None:
    with lock:
        for s in seen.values():
            fd, s.fd, s.ino = s.fd, -1, None
            if fd >= 0:
                os.close(fd)


class Monitor(Closing):
    """The liveness of one namespace's tasks on this host: a descriptor per task, re-opened
    when its record is replaced. Its lock is only tried (the garbage collector may interrupt
    its holder): if taken, a look opens a descriptor of its own."""

    def __init__(self, names: Names) -> None:
        self._names = names
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._seen, self._lock)

    def state(self, task: str) -> TaskState:
        """``task``'s state and record: a ``stat`` and a ``flock`` test while the record is
        unchanged. Raises ``InternalError`` if it is not ours or corrupt. Never blocks."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    return _task_state(task, *self._look(task))
            finally:
                self._lock.release()
        return _task_state(task, *look(self._path(task), strict=True))

    def _path(self, task: str) -> str:
        return self._names.path(self._names.presence(task))

    def _look(self, task: str) -> tuple[PeerState, PresenceInfo | None]:
        seen = self._seen.get(task)
        if seen is None:
            seen = self._seen[task] = _Seen(self._path(task))
        ino = inode(seen.path)
        if ino is None:
            return "absent", None
        if seen.ino != ino:
            if seen.fd >= 0:
                os.close(seen.fd)
            seen.fd, seen.ino, seen.info = -1, None, None
            opened = _open(seen.path, True)
            if opened is None:
                return "absent", None
            fd, fst, info = opened
            # The inode opened: if the name moved on since the stat, the next look re-opens.
            seen.fd, seen.ino, seen.info = fd, (fst.st_dev, fst.st_ino), info
        return _state(seen.fd, seen.info), seen.info

    def close(self) -> None:
        """Close every cached descriptor (after a look running meanwhile). Idempotent."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"watching {len(self._seen)}"
        return f"<Monitor {self._names.namespace_id} {state}>"


@dataclasses.dataclass(frozen=True)
class Claim:
    """What ``claim`` found: "absent", "alive" (its lock is held) or "dead" (the exclusive lock
    is the claimer's until the ``with`` ends); ``info`` None if absent or corrupt."""

    path: str
    state: PeerState
    info: PresenceInfo | None = None
    ino: tuple[int, int] | None = None  # the inode claimed (dead only)

    def still_there(self) -> bool:
        return self.ino is not None and inode(self.path) == self.ino

    def remove(self) -> bool:
        """Unlink the claimed record if it was not replaced meanwhile; whether it went."""
        if not self.still_there():
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
            return True
        return False


@contextlib.contextmanager
def claim(path: str) -> Iterator[Claim]:
    """The record at ``path``, under its exclusive lock if nobody holds one: only a dead
    record's claimer replaces or removes it, so two never both do. ``InternalError`` if the
    record is not ours. Does not block."""
    opened = _open(path, False)
    if opened is None:
        yield Claim(path, "absent")
        return
    fd, st, info = opened
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield Claim(path, "alive", info)
            return
        yield Claim(path, "dead", info, (st.st_dev, st.st_ino))
    finally:
        os.close(fd)


# Another publisher may hold a record's lock a moment while it replaces a stale one.
_PUBLISH_ATTEMPTS, _PUBLISH_RETRY_S = 5, 0.01

# Every open Presence of this process, so that a forked child can drop the inherited locks.
_live: weakref.WeakSet[Presence] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # flock locks belong to the open file description, which a fork shares: the child's copy
    # would keep a dead parent "alive". Closing it drops no lock the parent relies on.
    # (``subprocess`` children never see the descriptors: they are close-on-exec.)
    for presence in list(_live):
        presence._forget_after_fork()
    _live.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_fd(fd: int, path: str, ino: tuple[int, int]) -> None:
    """Unlink ``path`` if it is still our record, then drop the lock (a peer seeing the lock
    free first concludes "dead", right a moment later anyway)."""
    with contextlib.suppress(OSError):  # whatever happens, the descriptor (the lock) goes
        if inode(path) == ino:
            os.unlink(path)
    os.close(fd)


def _owner(info: PresenceInfo | None) -> str:
    if info is None:
        return "an unknown process"
    if info.pid == os.getpid() and info.boot_id == boot_id():
        return f"this process itself (pid {info.pid}, incarnation {info.incarnation:#x})"
    return f"pid {info.pid} (incarnation {info.incarnation:#x})"


class Presence(Closing):
    """This process's presence record for one task, locked while open (``publish``);
    ``close()`` (or the finalizer) unlinks it if still ours and drops the lock."""

    def __init__(self, info: PresenceInfo, fd: int, path: str) -> None:
        self._info = info
        self._fd = fd
        self.path = path
        st = os.fstat(fd)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_fd, fd, path, (st.st_dev, st.st_ino))
        _live.add(self)

    @classmethod
    def publish(cls, names: Names, info: PresenceInfo) -> Presence:
        """Write ``info`` as its task's record and lock it, replacing a dead worker's. Raises
        ``InvalidArgumentError`` if a live process holds it, ``ResourceExhaustedError`` if
        /dev/shm is full, ``InternalError`` if it is not ours. Blocks a few short retries
        at most (another publisher replacing a stale record)."""
        info = dataclasses.replace(info, namespace=names.namespace_id)  # never the token
        final = names.path(names.presence(info.task))
        data = info.to_json()
        temp = names.path(names.temp())
        try:
            fd = os.open(
                temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
        except OSError as e:
            raise os_error(e, f"create presence record {temp}") from e
        try:
            os.fchmod(fd, 0o600)  # umask-proof
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write", temp)
            # Locked before it has its final name: no reader can ever see it unlocked.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            cls._install(temp, final, info)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            os.close(fd)
            if isinstance(e, OSError):
                raise os_error(e, f"create presence record {temp}") from e
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        _log.debug("published presence %s for %s (pid %d)", final, info.task, info.pid)
        return cls(info, fd, final)

    @staticmethod
    def _install(temp: str, final: str, info: PresenceInfo) -> None:
        """Give the locked ``temp`` the name ``final``, replacing a dead record only."""
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
            with claim(final) as old:
                if old.state == "alive":
                    if attempt + 1 < _PUBLISH_ATTEMPTS:
                        time.sleep(_PUBLISH_RETRY_S)
                        continue
                    raise InvalidArgumentError(
                        f"task {info.task} is already running in {_owner(old.info)} "
                        f"(namespace id {info.namespace}, record {final}): one Worker per task "
                        "and namespace; close that one first, or start this one for another task"
                    )
                if old.state == "dead" and old.still_there():
                    _log.info("replacing stale presence record %s (%s)", final, _owner(old.info))
                    os.rename(temp, final)
                    return
                # Gone or replaced meanwhile: look at the name again.
        raise InternalError(f"cannot publish presence record {final}: it keeps changing")

    def close(self) -> None:
        """Unlink the record if it is still ours, then drop the lock. Idempotent."""
        if not self._closed:
            self._closed = True
            _live.discard(self)
            self._finalizer()

    def _forget_after_fork(self) -> None:
        # In a forked child: close our copy of the descriptor, never unlink (the record is
        # the parent's), and detach the finalizer that would unlink it at the child's exit.
        if not self._closed:
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
