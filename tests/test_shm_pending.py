"""Many pending receives: an arrival goes to its own channel (issue 15 §1), via the seam."""

from __future__ import annotations

import threading
import time

import numpy as np
from shm_harness import Endpoint, key_between

import shmrdv

P, C = "/job:pend/replica:0/task:0", "/job:pend/replica:0/task:1"


def test_pending_receives_do_not_make_handoffs_probe_or_list() -> None:
    ns = shmrdv.new_namespace()
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "warm"), np.zeros(1))
        cons.recv(1, key_between(P, C, "warm"))
        calls: list[object] = []
        cancels = [
            cons.transport.start_recv(
                1, key_between(P, C, f"never{i}"), lambda e, r: calls.append(e)
            )
            for i in range(2000)
        ]
        before = cons.transport.stats()
        assert before["pending_keys"] == 2000
        for i in range(50):
            k = key_between(P, C, f"ping{i}")
            if i % 2:
                prod.send(1, k, np.full(16, i, np.float32))  # there before the receive
                got = cons.recv(1, k)
            else:
                box: dict[str, object] = {}
                t = threading.Thread(target=lambda k=k, box=box: box.update(got=cons.recv(1, k)))
                t.start()  # a blocked receiver, woken by the doorbell
                prod.send(1, k, np.full(16, i, np.float32))
                t.join(10)
                got = box["got"]  # type: ignore[assignment]
            assert got.value[0] == i
        after = cons.transport.stats()
        # Each arrival was a ring record for its own channel: no name opened, no listing.
        assert after["name_probes"] == before["name_probes"]
        assert after["listings"] == before["listings"]
        assert after["received"] - before["received"] == 50
        assert all(c() for c in cancels)  # O(1) each, and none was delivered
        assert cons.transport.stats()["pending_keys"] == 0
        assert calls == []


def test_pending_large_messages_go_by_notice() -> None:
    """A segment's arrival is announced in the ring: taken by name with no probing first."""
    ns = shmrdv.new_namespace()
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "warm"), np.zeros(1))
        cons.recv(1, key_between(P, C, "warm"))
        big = np.arange(200_000, dtype=np.float64)  # > the inline limit: a segment
        for i in range(5):
            prod.send(2, key_between(P, C, f"big{i}"), big)
        for i in reversed(range(5)):
            got = cons.recv(2, key_between(P, C, f"big{i}"))
            assert np.array_equal(got.value, big)
            del got
        stats = cons.transport.stats()
        assert stats["name_probes"] == 5  # one open per message, no failed attempt
        assert stats["listings"] == 0


def test_pending_callback_receives_leave_a_blocked_receivers_loop_alone() -> None:
    """Issue 18 (``--pending``): with callback receives pending, a receiver that blocks
    message after message keeps the poller role; the dispatcher thread does not take it
    back (a wake-up and two GIL handoffs) each time the receiver lets it go."""
    ns = shmrdv.new_namespace()
    n = 60
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "warm"), np.zeros(1))
        cons.recv(1, key_between(P, C, "warm"))
        calls: list[object] = []
        cancel = cons.transport.start_recv(
            1, key_between(P, C, "never"), lambda e, r: calls.append(e)
        )
        asked = threading.Semaphore(0)

        def produce() -> None:
            for i in range(n):
                assert asked.acquire(timeout=10)
                time.sleep(0.001)  # the receiver blocks first
                prod.send(1, key_between(P, C, f"loop{i}"), np.full(4, i, np.float32))

        t = threading.Thread(target=produce)
        t.start()
        before = cons.transport.stats()["dispatcher_polls"]
        for i in range(n):
            asked.release()
            assert cons.recv(1, key_between(P, C, f"loop{i}")).value[0] == i
        polls = cons.transport.stats()["dispatcher_polls"] - before
        t.join(10)
        assert polls < n // 3, polls  # before: about one per message
        assert cancel() and calls == []
