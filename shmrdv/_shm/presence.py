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

This module owns a worker's own record (``Presence``) and is the one place the others
import presence from: what a record says is ``presence_record.py``, whether its owner lives
(``probe``, ``PeerWatch``) is ``presence_watch.py``.

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
from .presence_record import (
    PeerState,
    PresenceInfo,
    boot_id,
    check_ours,
    describe_owner,
    open_record,
    read_presence,
    read_record,
)
from .presence_watch import PeerWatch, probe, record_state

if TYPE_CHECKING:
    from .naming import Names

__all__ = [
    "PeerState",
    "PeerWatch",
    "Presence",
    "PresenceInfo",
    "boot_id",
    "probe",
    "read_presence",
    "read_record",
    "record_state",
]

_log = logging.getLogger("shmrdv.shm.presence")

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
