"""A producer's way to one consumer worker: the ``Route``.

A route is what a producer keeps per consumer worker: the ring it appends that worker's
small messages to (``ring.py``; made with the route, published under its name only once
formatted), the consumer's doorbell (``bell.py``; looked up lazily, since the consumer
may not have started yet) and what it sent there in segments. The producer (``producer.py``)
numbers, writes and publishes the messages; a route checks its ring's size before a
write (a truncated ring is given up: segments from then on, found by name) and posts its
doorbell for what was written.

Thread model (``docs/threads.md``): the ring is written, checked and given up under the
producer's publish lock (single producer per ring); the doorbell cache is set and cleared
under the lock the producer gives each route (``Producer._lock``). A post is made outside
both: it never blocks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._errors import InternalError, RendezvousError
from .bell import Bell
from .files import Segment, move_noreplace
from .naming import Names
from .ring import RINGS_SUPPORTED, Ring, ring_size

if TYPE_CHECKING:
    import posix_ipc

__all__ = ["RING_CAPACITY", "SEEK_END", "EarlyPost", "Route", "file_size"]

_log = logging.getLogger("shmrdv.shm")

# The bytes of records a ring holds (``ring_size`` adds its words).
RING_CAPACITY = 1 << 20
# A file's size: ``file_size(fd, 0, SEEK_END)`` (its end, for the ring's size check).
file_size = os.lseek
SEEK_END = os.SEEK_END
# How often a producer looks again for the doorbell of a consumer that has not started.
_BELL_LOOK_S = 0.02


class Route:
    """What a producer keeps per consumer worker: its ring and its doorbell, and what it
    sent there in segments (``sent``, ``sent_bytes``: ``stats``, two attributes a send adds
    to where a dict of counters would cost two lookups each; a ring record is counted by
    its key's ``_KeyOut``). ``lock`` guards the doorbell cache (``bell``, ``post``, ``sem``);
    the ring's fields change under the producer's publish lock."""

    __slots__ = (
        "bell",
        "bell_look_at",
        "lock",
        "names",
        "post",
        "ring",
        "ring_buf",
        "ring_fd",
        "ring_segment",
        "ring_size",
        "sem",
        "sent",
        "sent_bytes",
        "task",
    )

    def __init__(
        self, names: Names, task: str, lock: threading.Lock, ring: tuple[Segment, Ring] | None
    ) -> None:
        self.names = names
        self.task = task
        self.lock = lock
        self.ring_segment: Segment | None = None if ring is None else ring[0]
        self.ring: Ring | None = None if ring is None else ring[1]
        # The ring file's descriptor: its size (``os.lseek(fd, 0, SEEK_END)``, a system call
        # lighter than ``fstat``) is checked before every write.
        self.ring_fd = -1 if ring is None else ring[0].fd
        self.ring_size = 0 if ring is None else ring[0].size
        self.ring_buf: memoryview = memoryview(b"") if ring is None else ring[1].buf
        self.bell: Bell | None = None
        self.post: Callable[[], None] | None = None  # ``bell.post``, while ``bell`` is set
        self.sem: posix_ipc.Semaphore | None = None  # ``bell.semaphore``, likewise
        self.bell_look_at = 0.0
        self.sent = 0
        self.sent_bytes = 0

    @classmethod
    def open(
        cls, names: Names, producer: str, incarnation: int, task: str, lock: threading.Lock
    ) -> Route:
        """The route of the producer run (``producer``, ``incarnation``) to the consumer
        worker ``task``, with its ring where one can be made (``lock``: see the class)."""
        ring = _make_ring(names, producer, incarnation, task) if RINGS_SUPPORTED else None
        return cls(names, task, lock, ring)

    # -- the ring ---------------------------------------------------------------------

    def ring_intact(self) -> bool:
        """Whether the ring file still holds the whole ring (one ``lseek``; under the
        publish lock). A process of this user that kept a descriptor may have truncated it,
        and writing to a lost page would kill this process with SIGBUS (issue 20 §3): such
        a ring is given up, and this consumer is sent segments, found by name."""
        seg = self.ring_segment
        if seg is None or self.ring is None:
            return False
        try:
            if file_size(self.ring_fd, 0, SEEK_END) >= seg.size:  # (one ``lseek``)
                return True
            seg.check_size(seg.size)  # says what is wrong
        except (InternalError, OSError, ValueError) as e:
            _log.warning("the ring to %s is unusable (%s); segments from now on", self.task, e)
            self.ring.release()
            self.ring = None
            self.ring_segment = None
            self.ring_fd = -1
            seg.close()
            return False
        return True

    def close_ring(self) -> None:
        """Unmap the ring (under the publish lock). A ring its consumer never attached keeps
        its name while it holds messages (they are the consumer's); an empty one goes."""
        ring, seg = self.ring, self.ring_segment
        self.ring = self.ring_segment = None
        self.ring_fd = -1
        if ring is not None and seg is not None:
            # (Checked first: a truncated ring's words may be gone.)
            if _intact(seg) and not ring.pending():
                seg.unlink_quietly()
            ring.release()
            seg.close()

    # -- the doorbell -----------------------------------------------------------------

    def post_record(self) -> None:
        """Post the doorbell for a ring record just committed (no post waiting)."""
        bell = self.bell  # (read before ``sem``: set before it, cleared after it)
        sem = self.sem
        if sem is not None:
            try:
                sem.release()  # ``Bell.post``
            except Exception:
                bell = bell or self.bell
                if bell is not None:
                    bell.ring()  # says what is wrong (closed), or drops a saturating post
        elif (bell := bell or self.peer_bell()) is not None:
            bell.ring()

    def after_publish(self, nbytes: int, posted: bool) -> None:
        """Count a segment message of ``nbytes`` just published, and post the doorbell for
        it unless ``posted`` (then post again only if that post may have been taken too
        early: the message's ring notice is still unread while no post waits)."""
        self.sent += 1
        self.sent_bytes += nbytes
        bell = self.bell
        if posted:
            # The publish posted the doorbell before the notice. If that post was taken
            # but the ring notice was not, its consumer may have looked before the message
            # was there and gone back to sleep: post again (reads of the semaphore and of
            # the ring's words, no system call, say; the publish checked the ring's size).
            if bell is not None and not bell.pending and _unread(self.ring):
                bell.ring()
            return
        if bell is None:
            bell = self.peer_bell()
            if bell is None:
                return
        bell.ring()

    def peer_bell(self) -> Bell | None:
        """The consumer's doorbell, opened on first use (looked for again every
        ``_BELL_LOOK_S`` while the consumer has not started); None while there is none."""
        now = time.monotonic()
        if now < self.bell_look_at:
            return None
        self.bell_look_at = now + _BELL_LOOK_S
        try:
            bell = Bell.open(self.names, self.task)
        except RendezvousError:
            _log.warning(
                "doorbell of %s refused (not ours); relying on the dispatcher tick", self.task
            )
            self.bell_look_at = now + 3600.0
            return None
        if bell is None:
            return None  # consumer not started: it scans when it starts
        with self.lock:
            if self.bell is None:
                self.bell = bell
                self.sem = bell.semaphore
                self.post = bell.post
            else:
                bell.close()
            return self.bell

    def drop_bell(self) -> Bell | None:
        """Forget the doorbell (under ``lock``); return it, for the caller to close."""
        with self.lock:
            bell = self.bell
            self.post = None
            self.sem = None
            self.bell = None
        return bell


class EarlyPost:
    """``copy_into``'s ``almost`` for a large send: posts the consumer's doorbell (``post``,
    ``Bell.post``) as the copy ends, and says whether it did (the publish then does not)."""

    __slots__ = ("post", "posted")

    def __init__(self, post: Callable[[], None] | None) -> None:
        self.post = post
        self.posted = False

    def __call__(self) -> None:
        if self.post is not None:
            try:
                self.post()
                self.posted = True
            except Exception:  # closed or saturated: the publish posts, ``ring`` says why
                pass


def _make_ring(
    names: Names, producer: str, incarnation: int, task: str
) -> tuple[Segment, Ring] | None:
    """The ring of the producer run for the consumer ``task``, or None where one cannot be
    made."""
    seg: Segment | None = None
    name = names.ring(producer, incarnation, task)
    try:
        seg = Segment.create(names, ring_size(RING_CAPACITY), keep_fd=True)
        meta = json.dumps({"producer": producer, "incarnation": incarnation, "consumer": task})
        ring = Ring.format(memoryview(seg.buf), RING_CAPACITY, meta.encode())
        move_noreplace(seg.path, Names.path(name))  # published only once formatted
        seg.name = name
    except (OSError, RendezvousError) as e:
        _log.warning("no ring to %s (%s); segments only, found by name", task, e)
        if seg is not None:
            seg.unlink_quietly()
            seg.close()
        return None
    return seg, ring


def _unread(ring: Ring | None) -> bool:
    """Whether ``ring`` (a producer's ring to its consumer) holds records its consumer has
    not taken; True when there is no ring (its consumer looks by name) or it cannot tell."""
    if ring is None:
        return True
    try:
        return ring.pending()
    except (ValueError, TypeError):  # released by a thread that found the ring truncated
        return True


def _intact(seg: Segment) -> bool:
    """Whether the file still holds all ``seg`` maps (one ``fstat``)."""
    try:
        seg.check_size(seg.size)
    except InternalError:
        return False
    return True
