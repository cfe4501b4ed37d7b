"""Who polls the doorbell: leader/follower among blocked receivers, else one thread.

One thread at a time polls this worker's doorbell and runs ``Consumer.scan``. A blocked
receiver (``wait``) that finds no one polling becomes the leader: it spins on the
doorbell briefly, then blocks on it, scans, delivers what arrived — to itself and to
every other waiter — and hands the role on. The value thus reaches a lone receiver with
one wake-up, not two (doorbell -> dispatcher thread -> receiver). Other blocked
receivers (followers) wait on a condition until delivered or the role is free.

The dispatcher thread (one per transport, whatever the number of pending keys) takes the
role only while callback receives are pending and no blocked receiver holds it; it runs
their ``done`` callbacks outside every lock.

Thread model: ``wait`` from any receiving thread; ``kick`` / ``wake_all`` from any thread;
``_cond`` guards only the poller role and is never held while polling or delivering.
"""

from __future__ import annotations

import logging
import threading
import time

from .._rendezvous import RecvSlot
from .bell import Bell
from .consumer import TICK, Consumer, deliver

__all__ = ["Dispatcher"]

_log = logging.getLogger("shmrdv.shm")

# Before blocking on the doorbell, a polling thread tries it without blocking for this
# long: waking a process that sleeps on another vCPU costs 30-70 µs on this kind of VM
# (research/peer_numbers.md), so a reply that comes within the spin is taken at once.
# The spin adapts (``_adapt_spin``) between these bounds; an idle consumer spins at most
# once per TICK: under 0.1 % of a core. (500 µs measured no better here: two spinning
# processes on two vCPUs starve the one doing the work.)
_SPIN_MIN_NS = 20_000
_SPIN_MAX_NS = 100_000


class Dispatcher:
    """The doorbell poller of one transport (see the module docstring)."""

    def __init__(self, bell: Bell, consumer: Consumer, label: str) -> None:
        self._bell = bell
        self._consumer = consumer
        self._cond = threading.Condition(threading.Lock())
        self._polling = False
        self._thread_polls = False  # the poller is the dispatcher thread
        self._blocked = 0  # blocked receivers waiting for the role
        self._closed = False
        self._spin_ns = _SPIN_MIN_NS
        self._wait_avg_ns = _SPIN_MAX_NS
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
        with self._cond:
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
            with self._cond:
                self._polling = False
                # Only a follower or the dispatcher thread (callback receives pending) needs
                # to hear that the role is free: waking the parked thread for nothing costs
                # it a wake-up and both threads a GIL handoff per message (issue 18 §1).
                if self._blocked or self._consumer.callback_waiters > 0:
                    self._cond.notify_all()

    def _role_free(self, slot: RecvSlot) -> bool:
        """(Under ``_cond``) whether a waiting receiver should now take the poller role."""
        return not (self._polling or slot.filled or self._closed)

    def _run(self) -> None:
        consumer = self._consumer
        while True:
            with self._cond:
                while not self._closed and (
                    self._polling or self._blocked or consumer.callback_waiters <= 0
                ):
                    self._cond.wait()
                if self._closed:
                    return
                self._polling = self._thread_polls = True
            try:
                self._poll(TICK)
            finally:
                with self._cond:
                    self._polling = self._thread_polls = False
                    self._cond.notify_all()

    def _poll(self, wait: float) -> None:
        """Wait up to ``wait`` s for the doorbell (spinning first), then scan and deliver."""
        bell = self._bell
        rang = False
        start = time.perf_counter_ns()
        end = start + self._spin_ns
        while time.perf_counter_ns() < end:
            if bell.wait(0):
                rang = True
                break
        if not rang:
            rang = bell.wait(max(wait, 0.0))
        if rang:
            self._adapt_spin(time.perf_counter_ns() - start)
            bell.drain()
        items = self._consumer.scan()
        if items:
            deliver(items)
        # Drop the batch before waiting again: a received array kept alive here would
        # hold its pool slot (and its ``held`` name) until the next wake-up.
        del items

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

    def close(self) -> None:
        """Stop the thread (after the consumer is closed). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._bell.ring()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
