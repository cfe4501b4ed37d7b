"""A worker's doorbell: a named POSIX semaphore used as a counter of "look again" hints.

The consumer worker creates ``/shmrdv_<ns>_b<taskhash>`` and waits on it; producers post it
after publishing a message. A post is a hint, never a lock and never the data: the names in
/dev/shm are the truth, so a lost, extra or saturated post costs a wasted look at most.

Semaphores are only ever created with ``O_CREX``: ``O_CREAT`` silently opens an existing
semaphore, another user's included, whose owner could then swallow our wake-ups
(research/pitfalls.md §4, §7). Before trusting a bell it did not create, a producer checks
the owner, mode and type of its file ``/dev/shm/sem.<name>`` (``files.open_checked``:
never blocks, even on a planted file under a lease), because glibc's ``sem_open`` itself
opens without ``O_NONBLOCK``.

``posix_ipc`` releases the GIL while blocked, turns EINTR into ``SignalError`` without
retrying (Linux never restarts ``sem_timedwait``, signal(7)) and lets a ``KeyboardInterrupt``
raised by the SIGINT handler through. Its timeouts are absolute ``CLOCK_REALTIME``
deadlines, so ``wait`` recomputes the remaining time from ``time.monotonic`` on each retry.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

import posix_ipc

from .._errors import InternalError, ResourceExhaustedError
from .._rendezvous import Closing
from .files import open_checked

if TYPE_CHECKING:
    from .naming import Names

__all__ = ["Bell"]

_log = logging.getLogger("shmrdv.shm.bell")


#: glibc's semaphore file holds one ``sem_t`` (32 bytes on x86-64); anything much larger
#: under a bell's name is not a semaphore of ours.
_MAX_SEM_FILE = 4096


def _check_ours(path: str, what: str) -> os.stat_result | None:
    """``open_checked`` the semaphore's file: None if it is missing; ``InternalError`` if
    another user planted it (or holds a lease on it). Never blocks, never follows a symlink.
    """
    try:
        fd, st = open_checked(path, os.O_RDONLY, what, max_size=_MAX_SEM_FILE)
    except FileNotFoundError:
        return None
    os.close(fd)
    return st


class Bell(Closing):
    """A handle on one worker's doorbell semaphore.

    ``Bell.create`` (the consumer, once per worker) or ``Bell.open`` (a producer). ``close()``
    closes this handle only; ``unlink()`` removes the name (the consumer does both at exit).
    Thread-safe. ``close()`` wakes the waiters of this handle first, so it never unmaps the
    semaphore under a thread blocked in ``wait``.
    """

    def __init__(self, sem: posix_ipc.Semaphore, name: str, path: str, task: str) -> None:
        """Internal: use ``Bell.create`` or ``Bell.open``."""
        self._sem = sem
        self._name = name
        self._path = path
        self._task = task
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._waiters = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, sem.close)

    @classmethod
    def create(cls, names: Names, task: str, *, replace_stale: bool = False) -> Bell:
        """Create ``task``'s bell, empty, mode 0600, with ``O_CREX``.

        If the name exists and is ours (our uid, no group/other bits), it is unlinked and
        created afresh when ``replace_stale`` is true (the caller knows the previous owner is
        dead: it holds the task's presence record). Raises ``InternalError`` naming the
        semaphore when it exists otherwise (another live owner, or squatted by another user),
        ``ResourceExhaustedError`` when /dev/shm is full. Does not block.
        """
        name, path = names.bell(task), names.bell_path(task)
        for attempt in (1, 2):
            try:
                sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
            except posix_ipc.ExistentialError as e:
                st = _check_ours(path, f"doorbell semaphore of {task}")
                if st is None:
                    continue  # vanished meanwhile: create again
                if not replace_stale or attempt == 2:
                    raise InternalError(
                        f"doorbell semaphore {path} of {task} already exists "
                        f"(created {time.time() - st.st_mtime:.0f} s ago); is {task} running "
                        "twice in one namespace?"
                    ) from e
                _log.info("replacing stale doorbell semaphore %s of %s", path, task)
                try:
                    posix_ipc.unlink_semaphore(name)
                except posix_ipc.ExistentialError:
                    pass
                continue
            except (posix_ipc.Error, OSError, ValueError) as e:
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ResourceExhaustedError(
                        f"cannot create doorbell semaphore {path} of {task}: {e.strerror}; "
                        "/dev/shm is full (remove what dead processes left behind with "
                        "`python -m shmrdv gc`)"
                    ) from e
                raise InternalError(
                    f"cannot create doorbell semaphore {path} of {task}: {e}"
                ) from e
            bell = cls(sem, name, path, task)
            try:
                # posix_ipc applies the umask; the research found 0666 under umask 0 (§7).
                os.chmod(path, 0o600)
            except OSError as e:
                bell.close()
                bell.unlink()
                raise InternalError(f"cannot chmod doorbell semaphore {path}: {e}") from e
            _log.debug("created doorbell semaphore %s of %s", path, task)
            return bell
        raise InternalError(f"cannot create doorbell semaphore {path} of {task}: it keeps changing")

    @classmethod
    def open(cls, names: Names, task: str) -> Bell | None:
        """Open ``task``'s existing bell (the producer side); None if it does not exist.

        Raises ``InternalError`` if the semaphore's file is not ours (another owner uid, group
        or other permission bits, not a regular file): a semaphore planted by another user is
        never posted or waited on. Does not block.
        """
        name, path = names.bell(task), names.bell_path(task)
        what = f"doorbell semaphore of {task}"
        # Checked before opening and compared after: once a file of ours is under the name, only
        # we can remove or replace it (/dev/shm is sticky), so the one we opened is that one.
        before = _check_ours(path, what)
        if before is None:
            return None
        try:
            sem = posix_ipc.Semaphore(name)
        except posix_ipc.ExistentialError:
            return None
        except (posix_ipc.Error, OSError, ValueError) as e:
            raise InternalError(f"cannot open {what} {path}: {e}") from e
        bell = cls(sem, name, path, task)
        try:
            after = _check_ours(path, what)
        except BaseException:
            bell.close()
            raise
        if after is None or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            bell.close()
            return None  # replaced while we opened it: a restarted consumer; look again later
        return bell

    @property
    def path(self) -> str:
        """The semaphore's file, ``/dev/shm/sem.<name>``."""
        return self._path

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """How many posts are waiting to be taken (the semaphore's value)."""
        if self._closed:
            self._check_open("read")
        return int(self._sem.value)

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise InternalError(f"cannot {action} doorbell {self._path} of {self._task}: closed")

    @property
    def semaphore(self) -> posix_ipc.Semaphore:
        """The semaphore itself: its ``value`` (posts not taken yet) and its ``release``
        with no Python call around them (a sender, a spinning poller). Both raise on a
        closed handle."""
        return self._sem

    def ring(self) -> None:
        """Post one hint. Never blocks. A saturated counter (SEM_VALUE_MAX) is left as it is.

        Raises ``InternalError`` if this handle is closed.
        """
        if self._closed:
            self._check_open("ring")
        try:
            self._sem.release()
        except posix_ipc.Error as e:  # closed by another thread meanwhile
            raise InternalError(f"cannot post doorbell {self._path} of {self._task}: {e}") from e
        except OSError as e:
            # posix_ipc: release() at SEM_VALUE_MAX raises EOVERFLOW (pitfalls.md §4). The
            # waiter has more hints than it will ever need.
            if e.errno != errno.EOVERFLOW:
                raise InternalError(
                    f"cannot post doorbell {self._path} of {self._task}: {e}"
                ) from e
            _log.debug("doorbell %s is saturated; post dropped", self._path)

    def wait(self, timeout: float | None) -> bool:
        """Block until a post arrives (True, one post taken) or ``timeout`` seconds pass (False).

        ``None`` waits forever (until a post, or ``close()`` which returns False). Retries
        signal interruptions with the remaining time; a ``KeyboardInterrupt`` from the SIGINT
        handler propagates. The GIL is released while blocked. Raises ``InternalError`` if
        the handle was closed before the call.
        """
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._lock:
            self._check_open("wait on")
            self._waiters += 1
        try:
            while True:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    self._sem.acquire(remaining)
                except posix_ipc.BusyError:
                    return False
                except posix_ipc.SignalError:
                    # EINTR from a signal whose handler did not raise (pitfalls.md §4).
                    if self._closed:
                        return False
                    continue
                return not self._closed
        finally:
            with self._lock:
                self._waiters -= 1
                self._idle.notify_all()

    def drain(self) -> int:
        """Take every pending post without blocking; return how many were taken (a read of
        the semaphore's value when there is none: no system call, no exception)."""
        if self._closed:
            self._check_open("drain")
        count = 0
        sem = self._sem
        # The value is read first (no system call): the usual last ``acquire(0)`` that
        # fails costs an exception, on a poller's hot path.
        while sem.value > 0:
            try:
                sem.acquire(0)
            except posix_ipc.BusyError:
                return count  # taken meanwhile by another handle
            except posix_ipc.SignalError:
                continue
            count += 1
        return count

    def close(self, timeout: float = 5.0) -> None:
        """Close this handle (the name stays: see ``unlink``). Idempotent.

        Threads blocked in ``wait`` on this handle are woken first (by posts, which they take
        back) and return False; ``close`` blocks until they have left, at most ``timeout``
        seconds, after which it logs and leaves the handle open rather than unmap a semaphore
        under a waiter.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + timeout
            while self._waiters:
                for _ in range(self._waiters):
                    self._release_quietly()
                woke = self._idle.wait(max(deadline - time.monotonic(), 0.0))
                if not woke and self._waiters:
                    _log.warning(
                        "doorbell %s: %d waiter(s) did not leave; handle left open",
                        self._path,
                        self._waiters,
                    )
                    self._finalizer.detach()
                    return
        self._finalizer()

    def _release_quietly(self) -> None:
        try:
            self._sem.release()
        except OSError:
            pass  # saturated: the waiters will wake anyway

    def unlink(self) -> None:
        """Remove the bell's name (existing handles keep working). A missing name is fine."""
        try:
            posix_ipc.unlink_semaphore(self._name)
        except posix_ipc.ExistentialError:
            pass
        except (posix_ipc.Error, OSError) as e:
            raise InternalError(f"cannot unlink doorbell {self._path} of {self._task}: {e}") from e

    def __repr__(self) -> str:
        return f"<Bell {self._task} {self._name} {'closed' if self._closed else 'open'}>"
