"""Who polls the doorbell: leader/follower among blocked receivers, else one thread.

One thread at a time polls this worker's doorbell and runs ``Consumer.scan``. A blocked
receiver (``wait``) that finds no one polling becomes the leader: it spins on the
doorbell briefly, then blocks on it, scans, delivers what arrived — to itself and to
every other waiter — and hands the role on. The value thus reaches a lone receiver with
one wake-up, not two (doorbell -> dispatcher thread -> receiver). Other blocked
receivers (followers) wait on a condition until delivered or the role is free.

The dispatcher thread (one per transport, whatever the number of pending keys) takes the
role only while callback receives are pending and no blocked receiver has held it for a
moment (``_HANDOFF_NS``: a receiver in a loop keeps it, and serves the callback receives
with its own scans); it runs their ``done`` callbacks outside every lock.

The poller's own post: a thread about to spin posts this worker's doorbell itself
(``_hold``), and leaves that post pending while it polls and between its polls. A
producer that finds a post pending after appending a ring record does not post
(``producer.py``): whoever takes a pending post looks at the rings' heads after it, and
its ``head`` store came before its look at the semaphore (an atomic read-modify-write,
the publish lock's release, lies between them: a full barrier on x86-64, the only
machine with rings). A spinning receiver thus costs its producers no post and itself no
post to take per message. Before any poller blocks on the doorbell it takes that post
back (an atomic read-modify-write too) and looks at the heads once more
(``_came_meanwhile``): either that look sees a record that came meanwhile, or its
producer saw no post pending and posted; no wake-up is lost. A message that has no ring
record (a producer without a ring, or a segment's first post, made before its notice) is
always posted, and a spin looks for a post besides its own every ``_BELL_EVERY`` turns.

Thread model (docs/threads.md): ``wait`` from any receiving thread; ``kick`` / ``wake_all`` from any thread;
``_cond`` guards only the poller role and is never held while polling or delivering.
"""

from __future__ import annotations

import logging
import threading
import time

from .._cpus import usable_cpus
from .._rendezvous import Received, RecvSlot
from .bell import Bell
from .consumer import TICK, Consumer
from .delivery import Item, deliver

__all__ = ["Dispatcher"]

_log = logging.getLogger("shmrdv.shm")

# Before blocking on the doorbell, a polling thread spins on the rings' heads in shared
# memory (no system call, no GIL handoff): waking a process that sleeps on another vCPU
# costs 30-70 µs on this kind of VM (research/peer_numbers.md), so a reply that comes
# within the spin is taken at once. The spin adapts (``_adapt_spin``) between these bounds,
# is off while only one CPU is usable (the sender could not run meanwhile) and after a
# wait that went unanswered, until a post comes again; ``busy_poll`` replaces it by a
# fixed budget. The bound is 250 µs: a zero-copy pool-slot message takes its peer
# 60-100 µs of work per side here, so with 100 µs a blocked wait (that work plus the
# wake-up) averaged above the bound, the spin fell to its minimum and both sides blocked
# on every message (16 MiB allocate round trip 183-268 µs, 0-22 spins of 1,000 found the
# message; 92-160 µs and 1,000-1,560 with 250 µs; issue 18 §2). (500 µs measured no
# better for 64 B: two spinning processes on two vCPUs starve the one doing the work.)
_SPIN_MIN_NS = 20_000
_SPIN_MAX_NS = 250_000
# After a doorbell post that brought nothing, a message is on its way (a large message's
# producer posts as its bytes are complete, then names and announces it: ``producer.py``):
# the next wait spins at least this long, and so takes it without a second wake-up.
_ON_ITS_WAY_NS = 100_000
# A spin looks at the doorbell itself (for producers without a ring) every this many turns.
_BELL_EVERY = 32
# What a spin saw (``_spin``): nothing, a ring's head move, a doorbell post.
_NOTHING, _HEADS, _POSTED = 0, 1, 2
# The dispatcher thread takes the poller role only once no blocked receiver has held it
# for this long: a receiver in a loop comes back sooner, and polls itself. It bounds the
# extra delay of a callback receive whose value comes while no receiver blocks (then the
# thread polls, as before).
_HANDOFF_NS = 2_000_000
# How often the usable CPUs are counted again (a quota may change; a file read).
_CPUS_EVERY_NS = 10_000_000_000


class Dispatcher:
    """The doorbell poller of one transport (see the module docstring)."""

    def __init__(self, bell: Bell, consumer: Consumer, label: str, busy_poll: float = 0.0) -> None:
        self._bell = bell
        self._consumer = consumer
        # ``_cond``'s lock. The two ``with`` blocks of every blocked receive (``wait``)
        # take it directly: a ``Condition``'s ``__enter__`` is a Python call around the
        # same lock, and ``_cond.wait`` / ``notify_all`` work the same under it.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._polling = False
        self._thread_polls = False  # the poller is the dispatcher thread
        self._blocked = 0  # blocked receivers waiting for the role
        self._released_ns = 0  # perf_counter_ns when a blocked receiver last left the role
        self._closed = False
        self._spin_ns = _SPIN_MIN_NS
        self._wait_avg_ns = _SPIN_MAX_NS
        self._busy_ns = int(busy_poll * 1e9)
        self._multi_cpu = usable_cpus() > 1
        self._cpus_at = time.monotonic_ns() + _CPUS_EVERY_NS
        self._spun_ns = 0  # wall time spent spinning (a spinning thread is on a CPU)
        self._last_msg_ns = 0  # perf_counter_ns of the last poll that found a message
        self._spins = 0  # spins started
        self._spin_hits = 0  # spins that found a message
        self._thread_poll_count = 0  # polls made by the dispatcher thread
        self._held = False  # the poller's own post is pending (``_hold``)
        self._posts = 0  # doorbell posts taken, the poller's own not counted
        self._tick_finds = 0  # values found after a doorbell wait timed out
        self._thread = threading.Thread(
            target=self._run, name=f"shmrdv-shm-dispatch {label}", daemon=True
        )
        self._thread.start()

    def kick(self) -> None:
        """A callback receive was queued: make sure someone polls."""
        with self._cond:
            self._cond.notify_all()

    def wake_all(self) -> None:
        """Let followers look at their slots again (after an abort filled some)."""
        with self._cond:
            self._cond.notify_all()
        self._bell.ring()  # and the leader stop waiting on the doorbell

    def wait(self, slot: RecvSlot, timeout: float) -> None:
        """Block up to ``timeout`` s as leader (polling) or follower; early once filled.

        A blocked receiver has priority over the dispatcher thread: finding the thread
        polling, it rings the doorbell so that the thread hands the role over, and then
        takes it (one wake-up per message for it, not two, however many callback receives
        are pending besides).
        """
        with self._lock:  # (``_cond``'s lock: its ``wait`` below works under it)
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
            self._poll(timeout)
        finally:
            with self._lock:
                self._polling = False
                self._released_ns = time.perf_counter_ns()
                # Only a follower needs to hear at once that the role is free. The
                # dispatcher thread (callback receives pending) takes it only once no
                # blocked receiver has held it for ``_HANDOFF_NS`` (``_run``): a receiver
                # that comes back for its next message meanwhile polls again itself, where
                # waking the thread would cost a wake-up and a GIL handoff per message, and
                # the receiver another one to take the role back (issue 18: ``--pending``).
                if self._blocked:
                    self._cond.notify_all()

    def _role_free(self, slot: RecvSlot) -> bool:
        """(Under ``_cond``) whether a waiting receiver should now take the poller role."""
        return not (self._polling or slot.filled or self._closed)

    def _run(self) -> None:
        consumer = self._consumer
        cond = self._cond
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
                self._thread_poll_count += 1
            try:
                self._poll(TICK, spin=False)
            finally:
                with self._cond:
                    self._polling = self._thread_polls = False
                    self._cond.notify_all()

    def _poll(self, wait: float, spin: bool = True) -> None:
        """Wait up to ``wait`` s for a message (spinning first if ``spin``), then scan and
        deliver. The dispatcher thread never spins: a spinning thread keeps the GIL, and
        the blocked receiver that wants the poller role (and the user's threads) would
        wait for it up to the interpreter's switch interval (5 ms)."""
        bell = self._bell
        consumer = self._consumer
        start = time.perf_counter_ns()
        busy = self._busy_ns
        if not spin:
            budget = 0
        elif busy:
            # ``busy_poll``: until that long after the last message (traffic keeps the
            # receiver polling; an idle one sleeps once the budget is spent, and the next
            # post starts it again). The adaptive spin (``_adapt_spin``) is not used then.
            budget = self._last_msg_ns + busy - start
            if budget < 0:
                budget = 0
        else:
            budget = self._spin_budget(start)
        found = woken = unanswered = False
        seen = _NOTHING
        if budget:
            # First the rings' sizes (issue 20 §3: a truncated ring read is a SIGBUS); the
            # spin then reads only their heads, for a moment. A ring that fails the check
            # is failed by a scan, under the lock. (What came since the receive looked is
            # found by the spin at once: no scan needed for it.)
            intact = consumer.rings_intact()
            posted = bell.pending > self._held
            if posted or not intact or consumer.arrived():  # (heads read once sizes are)
                # A post came (a message without a ring record, an abort), a ring failed
                # (the scan fails it), or the message is there already: taken at once,
                # and not counted as a wait the spin adapts to.
                if posted:
                    self._take_posts()
                items = consumer.scan(check=not intact, posted=posted)
                if items:
                    deliver(items)
                    return
            if not self._held:
                self._hold()
            self._spins += 1
            seen = self._spin(start + budget)
            now = time.perf_counter_ns()
            self._spun_ns += now - start
            if seen:
                found = True
                self._spin_hits += 1
                self._last_msg_ns = now  # (the spin's end: when the message was seen)
                if not busy:
                    self._adapt_spin(now - start)
                if seen == _POSTED:
                    self._take_posts()
            else:
                wait -= (now - start) / 1e9
        if found:
            pass  # scanned below
        elif self._held and (self._take_posts() or self._came_meanwhile()):
            # The poller stops polling: its post taken back, the heads are looked at once
            # more (``_came_meanwhile``) before it sleeps. A post of a producer that came
            # meanwhile is taken with it, and scanned for like a wake-up.
            seen = _POSTED
            self._last_msg_ns = time.perf_counter_ns()
        elif bell.wait(max(wait, 0.0)):
            woken = True
            self._last_msg_ns = now = time.perf_counter_ns()
            if not busy:
                self._adapt_spin(now - start)
            self._posts += 1 + bell.drain()
        else:
            self._spin_ns = 0  # unanswered: no spin until posts come again
            unanswered = True
        # A spin that saw a ring's head move needs no look made per post (producers
        # without a ring post, and a post besides the poller's own is seen by the next
        # poll). The rings' sizes were checked right before the spin.
        items = consumer.scan(not found, seen != _HEADS)  # (check, posted)
        if items:
            if unanswered:
                self._count_tick_finds(items)
            deliver(items)
        elif woken and not busy and self._spin_ns < _ON_ITS_WAY_NS:
            self._spin_ns = _ON_ITS_WAY_NS  # a post with nothing yet: see _ON_ITS_WAY_NS
        # Drop the batch before waiting again: a received array kept alive here would
        # hold its pool slot (and its ``held`` name) until the next wake-up.
        del items

    def _count_tick_finds(self, items: list[Item]) -> None:
        """Count the values a scan found after a wait on the doorbell timed out, unless
        a post came meanwhile (late, not lost)."""
        if self._bell.pending:
            return
        for _, _, result in items:
            if type(result) is Received:
                self._tick_finds += 1

    def _hold(self) -> None:
        """Post this worker's own doorbell before a spin (see "The poller's own post")."""
        try:
            self._bell.ring()
        except Exception:  # pragma: no cover - closed meanwhile: the poll ends with it
            return
        self._held = True

    def _take_posts(self) -> bool:
        """Take every pending post, the poller's own (``_held``) included; whether a post
        besides it was there. (Taking a post is an atomic read-modify-write of the
        semaphore: on x86-64 a full barrier, so the heads read after it are current.)"""
        taken = self._bell.drain()
        held = self._held
        self._held = False
        if taken > held:
            self._posts += taken - held
            return True
        return False

    def _came_meanwhile(self) -> bool:
        """After the poller's own post was taken back: whether a ring holds records (its
        size checked first). A producer that saw that post pending did not post (its
        ``head`` store came before that look), so this look is what finds its record."""
        consumer = self._consumer
        return not consumer.rings_intact() or consumer.arrived()

    def _spin_budget(self, now_ns: int) -> int:
        """How long this poll may spin before it blocks on the doorbell, in ns, without
        ``busy_poll`` (``_poll`` has its budget): the adaptive spin, none on one CPU."""
        if now_ns >= self._cpus_at:
            self._cpus_at = now_ns + _CPUS_EVERY_NS
            self._multi_cpu = usable_cpus() > 1
        return self._spin_ns if self._multi_cpu else 0

    def _spin(self, end_ns: int) -> int:
        """Poll the rings' heads (shared memory) until one has records (``_HEADS``) or
        ``end_ns`` (``_NOTHING``); every ``_BELL_EVERY`` turns look for a doorbell post
        besides the poller's own (``_POSTED``), left pending for ``_poll`` to take."""
        arrived = self._consumer.arrived
        clock = time.perf_counter_ns
        bell = self._bell
        held = self._held  # the poller's own post (``_hold``)
        turns = 0
        while True:
            if arrived():
                return _HEADS
            turns += 1
            if turns == _BELL_EVERY:
                turns = 0
                if bell.pending > held:
                    return _POSTED
            if clock() >= end_ns:
                return _NOTHING

    def _adapt_spin(self, waited_ns: int) -> None:
        """Spin about twice as long as doorbells have lately taken to ring, within bounds.

        Ping-pong traffic (a reply within a few hundred µs) is then caught spinning, with
        no sleep and wake-up at all; sparse traffic spins only ``_SPIN_MIN_NS``. The
        average is over the last ~8 waits that ended with a post.
        """
        avg = self._wait_avg_ns = (7 * self._wait_avg_ns + waited_ns) // 8
        self._spin_ns = (
            _SPIN_MIN_NS if avg > _SPIN_MAX_NS else min(2 * avg + _SPIN_MIN_NS, _SPIN_MAX_NS)
        )

    def stats(self) -> dict[str, int]:
        """Time spent spinning (µs; the CPU time of a spinning poller), spins started,
        spins that paid, polls made by the dispatcher thread (not by a blocked receiver),
        doorbell posts taken (the poller's own not counted: none while it spins on a
        ring) and values found only once a wait on the doorbell timed out (a post that
        never came: 0 unless a producer could not post)."""
        return {
            "spin_us": self._spun_ns // 1000,
            "spins": self._spins,
            "spin_hits": self._spin_hits,
            "dispatcher_polls": self._thread_poll_count,
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
