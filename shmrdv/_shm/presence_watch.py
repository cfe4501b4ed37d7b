"""Whether a worker lives: its presence record's lock, looked at by ``probe`` (tools) and
``PeerWatch`` (peers, with a cached descriptor); ``presence.py`` tells the whole story.

Thread model (``docs/threads.md``): no thread of its own. A ``PeerWatch`` only *tries*
its lock (it may be asked inside the garbage collector).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING

from .._errors import InternalError
from .._rendezvous import Closing
from .presence_record import (
    PeerState,
    PresenceInfo,
    boot_id,
    check_ours,
    open_record,
    read_bytes,
    read_record_stat,
)

if TYPE_CHECKING:
    from .naming import Names

__all__ = ["PeerWatch", "lock_held", "probe", "record_state"]

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
