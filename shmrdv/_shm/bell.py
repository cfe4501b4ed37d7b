"""A worker's doorbell (``Bell``), and who polls it (``Poller``).

The doorbell is a named POSIX semaphore counting "look again" hints: the consumer worker
creates it and polls it, producers post it after publishing. A post is a hint, never the
data (the names in /dev/shm are), so a lost or extra post costs a wasted look at most. It
is created with ``O_CREX`` only (``O_CREAT`` silently opens another user's, who could
swallow our wake-ups: research/pitfalls.md §4, §7), and opened only after its file passed
``files.open_checked`` (``sem_open`` has no ``O_NONBLOCK``).

One thread at a time polls the doorbell and runs ``Consumer.scan``: a blocked receiver that
finds no one polling leads, spinning on the value first (waking a sleeping process takes a
while), then blocking; the others wait on a condition. The dispatcher thread leads only for
callback receives, once no blocked receiver led for ``_HANDOFF_NS``, and never spins.

Thread model (docs/threads.md): any thread; ``Poller._cond`` guards only the poller role
and is never held while polling or delivering.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

import posix_ipc

from .._errors import InternalError
from .._rendezvous import Closing, RecvSlot
from .consumer import TICK, Consumer
from .files import open_checked, os_error

if TYPE_CHECKING:
    from .naming import Names

__all__ = ["SPIN_NS", "SPIN_WINDOW", "Bell", "Poller", "spin_pays"]

_log = logging.getLogger("shmrdv.shm.bell")

# glibc's semaphore file holds one ``sem_t`` (32 bytes on x86-64): a larger one is not ours.
_MAX_SEM_FILE = 4096
# How long a leader polls the doorbell's value before it blocks (ns): about a reply's worth
# of work on the other side of a ping-pong, a large message's included.
SPIN_NS = 250_000
# The dispatcher thread takes the poller role only once no blocked receiver has held it
# for this long: a receiver in a loop comes back sooner, and polls itself.
_HANDOFF_NS = 2_000_000
# The spin is judged by its last ``SPIN_WINDOW`` spins: if fewer than a quarter found a post,
# the peer could not answer within the budget, and the spin stays off for ``_PAUSE_NS``.
SPIN_WINDOW = 16
_PAUSE_NS = 1_000_000_000


def _check_ours(path: str, what: str) -> os.stat_result | None:
    """The semaphore file's ``fstat`` if it passes ``open_checked``, None if it is missing."""
    try:
        fd, st = open_checked(path, os.O_RDONLY, what, max_size=_MAX_SEM_FILE)
    except FileNotFoundError:
        return None
    os.close(fd)
    return st


class Bell(Closing):
    """A handle on one worker's doorbell: ``create`` (its worker) or ``open`` (a producer).
    ``close()`` closes the handle only, ``unlink()`` removes the name. Thread-safe."""

    def __init__(self, sem: posix_ipc.Semaphore, name: str, path: str, task: str) -> None:
        self._sem, self._name, self._path, self._task = sem, name, path, task
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._waiters = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, sem.close)

    @classmethod
    def create(cls, names: Names, task: str, *, replace_stale: bool = False) -> Bell:
        """Create ``task``'s bell, empty, mode 0600; one of ours there already is replaced if
        ``replace_stale`` (the caller holds the task's record: its owner is dead). Raises
        ``InternalError`` if it exists otherwise, ``ResourceExhaustedError`` if /dev/shm is
        full. Does not block."""
        name, path = names.bell(task), names.bell_path(task)
        what = f"doorbell semaphore {path} of {task}"
        for attempt in (1, 2):
            try:
                sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
                break
            except posix_ipc.ExistentialError as e:
                st = _check_ours(path, f"doorbell semaphore of {task}")
                if st is None:
                    continue  # vanished meanwhile: create again
                if not replace_stale or attempt == 2:
                    raise InternalError(
                        f"{what} already exists (created {time.time() - st.st_mtime:.0f} s "
                        f"ago); is {task} running twice in one namespace?"
                    ) from e
                _log.info("replacing stale %s", what)
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_semaphore(name)
            except OSError as e:  # /dev/shm full, no descriptors left, ...
                raise os_error(e, f"create {what}") from e
            except (posix_ipc.Error, ValueError) as e:
                raise InternalError(f"cannot create {what}: {e}") from e
        else:
            raise InternalError(f"cannot create {what}: it keeps changing")
        bell = cls(sem, name, path, task)
        try:
            # posix_ipc applies the umask; the research found 0666 under umask 0 (§7).
            os.chmod(path, 0o600)
        except OSError as e:
            bell.close()
            bell.unlink()
            raise InternalError(f"cannot chmod {what}: {e}") from e
        return bell

    @classmethod
    def open(cls, names: Names, task: str) -> Bell | None:
        """Open ``task``'s bell; None if there is none. Raises ``InternalError`` if its file
        is not ours: a planted semaphore is never posted or waited on. Does not block."""
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
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """How many posts are waiting to be taken (the semaphore's value)."""
        self._check_open("read")
        return int(self._sem.value)

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise InternalError(f"cannot {action} doorbell {self._path} of {self._task}: closed")

    @property
    def semaphore(self) -> posix_ipc.Semaphore:
        """The semaphore, for ``value`` and ``release`` with no call around them."""
        return self._sem

    def ring(self) -> None:
        """Post one hint (a saturated counter stays). Never blocks; ``InternalError`` once
        closed."""
        self._check_open("ring")
        try:
            self._sem.release()
        except (posix_ipc.Error, OSError) as e:  # (closed by another thread meanwhile)
            # release() at SEM_VALUE_MAX raises EOVERFLOW (pitfalls.md §4): hints enough.
            if getattr(e, "errno", None) != errno.EOVERFLOW:
                raise InternalError(
                    f"cannot post doorbell {self._path} of {self._task}: {e}"
                ) from e

    def wait(self, timeout: float | None) -> bool:
        """Block until a post (True, one taken), ``timeout`` s (None: no limit) or ``close``
        (False). A signal is retried with the time left (posix_ipc turns EINTR into
        ``SignalError``); ``InternalError`` if the handle was closed before."""
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
                    if self._closed:  # (a handler that raised propagates: pitfalls.md §4)
                        return False
                    continue
                return not self._closed
        finally:
            with self._lock:
                self._waiters -= 1
                self._idle.notify_all()

    def drain(self) -> int:
        """Take every pending post without blocking; how many."""
        if self._closed:
            self._check_open("drain")
        count = 0
        sem = self._sem
        # The value first: a last ``acquire(0)`` that fails costs an exception.
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
        """Close the handle (idempotent). Threads in ``wait`` are woken by posts and return
        False; waits up to ``timeout`` s for them to leave, else logs and leaves the handle
        open rather than unmap a semaphore under a waiter."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + timeout
            while self._waiters:
                for _ in range(self._waiters):
                    try:
                        self._sem.release()
                    except OSError:
                        pass  # saturated: the waiters will wake anyway
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

    def unlink(self) -> None:
        """Remove the name (handles keep working); a missing one is fine."""
        try:
            posix_ipc.unlink_semaphore(self._name)
        except posix_ipc.ExistentialError:
            pass
        except (posix_ipc.Error, OSError) as e:
            raise InternalError(f"cannot unlink doorbell {self._path} of {self._task}: {e}") from e

    def __repr__(self) -> str:
        return f"<Bell {self._task} {self._name} {'closed' if self._closed else 'open'}>"


def spin_pays() -> bool:
    """Whether a spin can pay on this host at all: its peer can run meanwhile."""
    return (os.cpu_count() or 1) > 1


class Poller:
    """Who polls one transport's doorbell (see the module docstring). A leader polls for
    ``busy_poll`` s after the last message if set, else spins up to ``SPIN_NS`` while the
    spin pays: on more than one CPU, with a post in enough of the last ``SPIN_WINDOW``."""

    def __init__(self, bell: Bell, consumer: Consumer, label: str, busy_poll: float = 0.0) -> None:
        self._bell = bell
        self._sem = bell.semaphore  # its ``value``: one C call, no system call
        self._consumer = consumer
        self._lock = threading.Lock()  # (``with`` on the bare lock: no Python call)
        self._cond = threading.Condition(self._lock)
        self._polling = False
        self._thread_polls = False  # the poller is the dispatcher thread
        self._blocked = 0  # blocked receivers waiting for the role
        self._released_ns = 0  # perf_counter_ns when a blocked receiver last left the role
        self._closed = False
        self._busy_ns = int(busy_poll * 1e9)
        self._answered = True  # the last wait on the doorbell was answered
        self._spin_ok = spin_pays()
        self._window = self._window_hits = 0  # spins and hits since the last judgement
        self._paused_until = 0  # perf_counter_ns until which the spin is off
        self._last_msg_ns = 0  # when the last poll found a message
        self._spun_ns = self._spins = self._spin_hits = 0
        self._thread_polls_count = self._posts = self._tick_finds = 0
        self._thread = threading.Thread(
            target=self._run, name=f"shmrdv-shm-dispatch {label}", daemon=True
        )
        self._thread.start()

    def kick(self) -> None:
        """A callback receive was queued: make sure someone polls."""
        with self._cond:
            self._cond.notify_all()

    def wake_all(self) -> None:
        """Let followers look at their slots again (an abort filled some), and the leader
        stop waiting on the doorbell."""
        with self._cond:
            self._cond.notify_all()
        self._bell.ring()

    def wait(self, slot: RecvSlot, timeout: float) -> None:
        """Block up to ``timeout`` s as leader (polling) or follower; early once filled. A
        blocked receiver finding the dispatcher thread polling rings, to take the role."""
        with self._lock:
            if slot.filled or self._closed:
                return
            if self._polling:
                self._blocked += 1
                try:
                    if self._thread_polls:
                        self._bell.ring()
                    self._cond.wait(timeout)
                finally:
                    self._blocked -= 1
                if slot.filled or self._closed or self._polling:
                    return
            self._polling = True
        try:
            self._poll(timeout, True)
        finally:
            with self._lock:
                self._polling = False
                self._released_ns = time.perf_counter_ns()
                if self._blocked:  # the dispatcher thread waits ``_HANDOFF_NS`` (``_run``)
                    self._cond.notify_all()

    def _run(self) -> None:
        consumer, cond = self._consumer, self._cond
        while True:
            with cond:
                while True:
                    if self._closed:
                        return
                    if consumer.callback_waiters <= 0:
                        cond.wait()  # ``kick`` wakes it when a callback receive is queued
                    elif self._polling or self._blocked:
                        cond.wait(_HANDOFF_NS / 1e9)  # a blocked receiver polls meanwhile
                    else:
                        idle_ns = self._released_ns + _HANDOFF_NS - time.perf_counter_ns()
                        if idle_ns <= 0:
                            break
                        cond.wait(idle_ns / 1e9)
                self._polling = self._thread_polls = True
                self._thread_polls_count += 1
            try:
                self._poll(TICK, False)
            finally:
                with cond:
                    self._polling = self._thread_polls = False
                    cond.notify_all()

    def _poll(self, wait: float, spin: bool) -> None:
        """Wait up to ``wait`` s for a post (spinning first if ``spin``: never the dispatcher
        thread, which would keep the GIL from a receiver that wants the role), then scan."""
        bell = self._bell
        start = time.perf_counter_ns()
        if not spin:
            budget = 0
        elif self._busy_ns:
            budget = max(self._last_msg_ns + self._busy_ns - start, 0)
        else:
            ok = self._spin_ok and self._answered and start >= self._paused_until
            budget = SPIN_NS if ok else 0
        seen = False
        if budget:
            self._spins += 1
            sem, clock, end = self._sem, time.perf_counter_ns, start + budget
            try:
                while not sem.value:
                    if clock() >= end:
                        break
                else:
                    seen = True
            except Exception:  # closed meanwhile: the scan finds the consumer closed
                seen = True
            now = clock()
            self._spun_ns += now - start
            self._spin_hits += seen
            self._window += 1
            self._window_hits += seen
            if self._window == SPIN_WINDOW:  # pause the spin if few of the window's paid
                if self._window_hits * 4 < SPIN_WINDOW and not self._busy_ns:
                    self._paused_until = now + _PAUSE_NS
                self._window = self._window_hits = 0
            if not seen:
                wait -= (now - start) / 1e9
        if seen or bell.wait(max(wait, 0.0)):
            self._posts += (not seen) + bell.drain()
            self._last_msg_ns = time.perf_counter_ns()
            self._answered = True
            self._consumer.scan()
            return
        self._answered = False  # no spin until posts come again
        found = self._consumer.scan(posted=False)
        if found and not bell.pending:  # a post that never came (late ones are not lost)
            self._tick_finds += found

    def stats(self) -> dict[str, int]:
        """Spinning (its CPU time, spins, those that found a post), the dispatcher thread's
        polls, posts taken, values found only after a wait timed out (a post never came)."""
        return {
            "spin_us": self._spun_ns // 1000,
            "spins": self._spins,
            "spin_hits": self._spin_hits,
            "dispatcher_polls": self._thread_polls_count,
            "doorbell_posts": self._posts,
            "tick_finds": self._tick_finds,
        }

    def close(self) -> None:
        """Stop the thread (after the consumer is closed). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._bell.ring()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
