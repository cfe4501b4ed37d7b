"""A handoff's cost does not grow with the receives pending on the same channel
(issue 15 §1, gRPC side): real RpcServer and RpcClient on 127.0.0.1."""

from __future__ import annotations

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
    """CPU seconds of this process (client and server, all threads) per handoff, over
    ``n`` handoffs of a value to a parked receive.

    CPU time, not wall time: work that grows with the pending receives shows in it, and
    other processes' load on a shared machine does not."""
    key = make_key("ping")
    cpu = 0.0
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
        t0 = time.process_time()
        source.send(1, key, np.array([i]))
        assert arrived.wait(10)
        cpu += time.process_time() - t0
        received = got[0]
        assert received is not None and int(received.value[0]) == i
    return cpu / n


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_ten_thousand_pending_receives_do_not_slow_a_handoff(source: StepSource) -> None:
    with RpcServer("127.0.0.1:0", source) as server, RpcClient() as client:
        before = _handoffs(client, source, server.address, 60)
        cancels = [
            client.start_recv(server.address, 1, make_key(f"pending{i}"), lambda e, r: None)
            for i in range(10_000)
        ]
        deadline = time.monotonic() + 120  # a loaded machine parks them slowly
        while server.stats()["parked"] < 10_000:
            assert time.monotonic() < deadline, f"{server.stats()['parked']} parked"
            time.sleep(0.05)
        with_pending = _handoffs(client, source, server.address, 60)
        assert all(cancel() for cancel in cancels)
        after = _handoffs(client, source, server.address, 60)
        # Issue 15's target is 1.2x; CPU time moves less than wall time on a shared
        # machine, but caches and frequency still do: the pending run is compared with the
        # costlier of the runs around it, with slack. Work per pending receive (a scan of
        # 10,000) would cost several times a handoff.
        baseline = max(before, after)
        assert with_pending <= 2.0 * baseline + 0.0002, (before, with_pending, after)
