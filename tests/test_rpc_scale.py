"""A handoff's cost does not grow with the receives pending on the same channel
(issue 15 §1, gRPC side): real RpcServer and RpcClient on 127.0.0.1."""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import pytest
import rpc_helpers
from rpc_helpers import StepSource, make_key

from shmrdv._rendezvous import Received
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.server import RpcServer

# Shared fixtures (tests/rpc_helpers.py): a StepSource, a server on loopback, a channel.
source = rpc_helpers.source


def _handoffs(client: RpcClient, source: StepSource, address: str, n: int) -> float:
    """Median seconds from a send to the parked receive's delivery, over ``n`` handoffs."""
    key = make_key("ping")
    times = []
    for i in range(n):
        arrived = threading.Event()
        got: list[Received | None] = []

        def done(
            error: BaseException | None,
            received: Received | None,
            got: list[Received | None] = got,
            arrived: threading.Event = arrived,
        ) -> None:
            got.append(received)
            arrived.set()

        client.start_recv(address, 1, key, done)
        time.sleep(0.002)  # parked on the server first: the handoff is the send
        t0 = time.perf_counter()
        source.send(1, key, np.array([i]))
        assert arrived.wait(10)
        times.append(time.perf_counter() - t0)
        received = got[0]
        assert received is not None and int(received.value[0]) == i
    return statistics.median(times)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_ten_thousand_pending_receives_do_not_slow_a_handoff(source: StepSource) -> None:
    with RpcServer("127.0.0.1:0", source) as server, RpcClient() as client:
        before = _handoffs(client, source, server.address, 60)
        cancels = [
            client.start_recv(server.address, 1, make_key(f"pending{i}"), lambda e, r: None)
            for i in range(10_000)
        ]
        deadline = time.monotonic() + 60
        while server.stats()["parked"] < 10_000:
            assert time.monotonic() < deadline, f"{server.stats()['parked']} parked"
            time.sleep(0.05)
        with_pending = _handoffs(client, source, server.address, 60)
        assert all(cancel() for cancel in cancels)
        after = _handoffs(client, source, server.address, 60)
        # Issue 15's target is 1.2x; a shared 2-CPU machine needs slack for its noise, and
        # a burst of load during one of the three measurements must not fail the test: the
        # pending run is compared with the slower of the runs around it.
        baseline = max(before, after)
        assert with_pending <= 2.0 * baseline + 0.0005, (before, with_pending, after)
