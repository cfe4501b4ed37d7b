"""Who polls a worker's doorbell: a blocked receiver as leader, else one dispatcher thread.

One thread at a time polls the doorbell and runs ``Consumer.scan``. A blocked receiver
(``wait``) that finds no one polling becomes the leader: it spins on the doorbell's value
for a fixed budget, then blocks on it, scans, delivers what arrived, to itself and to every
other waiter, and hands the role on. A lone receiver is thus woken by its producer's post
alone. Other blocked receivers (followers) wait on a condition until delivered or the role
is free. The dispatcher thread (one per transport) takes the role only while callback
receives wait and no blocked receiver has held it for ``_HANDOFF_NS`` (a receiver in a
loop keeps it, and serves the callback receives with its own scans); it never spins.

The spin: waking a process asleep on another CPU takes a while (research/peer_numbers.md),
so a reply that comes within ``SPIN_NS`` is taken with no sleep at all. A producer posts
for every message (unless a post is pending already), so the spin reads only the
semaphore's value (no system call). Its budget is fixed; it is off where it cannot pay: on
one CPU; for a second after a quarter or fewer of its last ``SPIN_WINDOW`` spins found a post
(the peer could not answer within it: its CPUs are taken, or the traffic is sparse); and
after a wait that went unanswered, until a post comes again. ``Worker(busy_poll=s)``
replaces it: the leader polls for ``s`` seconds after the last message.

Thread model (docs/threads.md): ``wait`` from any receiving thread; ``kick`` and
``wake_all`` from any thread; ``_cond`` guards only the poller role and is never held while
polling or delivering.
"""

from __future__ import annotations

import os
import threading
import time

from .._rendezvous import RecvSlot
from .bell import Bell
from .consumer import TICK, Consumer

__all__ = ["SPIN_NS", "SPIN_WINDOW", "Poller", "spin_pays"]

#: How long a leader polls the doorbell's value before it blocks (ns): about a reply's
#: worth of work on the other side of a ping-pong, a large message's included.
SPIN_NS = 250_000
# The dispatcher thread takes the poller role only once no blocked receiver has held it
# for this long: a receiver in a loop comes back sooner, and polls itself.
_HANDOFF_NS = 2_000_000
# The spin is judged by its last ``SPIN_WINDOW`` spins: if fewer than a quarter found a post,
# the peer could not answer within the budget, and the spin stays off for ``_PAUSE_NS``.
SPIN_WINDOW = 16
_PAUSE_NS = 1_000_000_000


def spin_pays() -> bool:
    """Whether a spin can pay on this host at all: its peer can run meanwhile."""
    return (os.cpu_count() or 1) > 1


class Poller:
    """The doorbell poller of one transport (see the module docstring)."""

    def __init__(self, bell: Bell, consumer: Consumer, label: str, busy_poll: float = 0.0) -> None:
        self._bell = bell
        self._sem = bell.semaphore  # its ``value``: one C call, no system call
        self._consumer = consumer
        self._lock = threading.Lock()
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
        """Block up to ``timeout`` s as leader (polling) or follower; early once filled.

        A blocked receiver has priority over the dispatcher thread: finding the thread
        polling, it rings the doorbell so that the thread hands the role over.
        """
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
                if not self._role_free(slot):
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

    def _role_free(self, slot: RecvSlot) -> bool:
        """(Under ``_cond``) whether a follower should take the poller role now."""
        return not (self._polling or slot.filled or self._closed)

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

    def _budget(self, now: int) -> int:
        """How long this poll may spin (ns): ``busy_poll``'s, else ``SPIN_NS`` where it
        pays (the module docstring)."""
        if self._busy_ns:
            return max(self._last_msg_ns + self._busy_ns - now, 0)
        if self._spin_ok and self._answered and now >= self._paused_until:
            return SPIN_NS
        return 0

    def _judge(self, hit: bool, now: int) -> None:
        """Count a spin; after ``SPIN_WINDOW`` of them, pause the spin if few paid."""
        self._window += 1
        self._window_hits += hit
        if self._window == SPIN_WINDOW:
            if self._window_hits * 4 < SPIN_WINDOW and not self._busy_ns:
                self._paused_until = now + _PAUSE_NS
            self._window = self._window_hits = 0

    def _poll(self, wait: float, spin: bool) -> None:
        """Wait up to ``wait`` s for a doorbell post (spinning first if ``spin``), then
        scan and deliver. The dispatcher thread never spins: a spinning thread keeps the
        GIL from the receiver that wants the role (and from the user's threads)."""
        bell = self._bell
        start = time.perf_counter_ns()
        budget = self._budget(start) if spin else 0
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
            self._judge(seen, now)
            if seen:
                self._spin_hits += 1
            else:
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
        """Time spent spinning (µs: the CPU time of a spinning poller), spins started and
        those that found a post, polls made by the dispatcher thread, doorbell posts taken,
        and values found only once a wait on the doorbell timed out (0 unless a producer
        could not post)."""
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
