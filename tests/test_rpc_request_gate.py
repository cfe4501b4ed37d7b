"""The request gate (issue 19 §4): a call that sends no request message is dropped at a
short deadline, and silent calls never take more than their share of the server.

Real ``RpcServer`` on 127.0.0.1, real grpc.aio clients opening calls that send their
headers and never a message (``flood_helpers.silent_call_outcomes``).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio
import numpy as np
import pytest
import rpc_helpers
from flood_helpers import silent_call_outcomes
from helpers import wait_for
from rpc_helpers import StepSource, make_key, pull

from shmrdv._rpc import messages
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.limits import ServerLimits
from shmrdv._rpc.methods import (
    GET_STATUS_METHOD,
    MARK_RECV_FINISHED_METHOD,
    RECV_TENSOR_METHOD,
    RECV_TENSOR_SERIES_METHOD,
    RECV_TENSOR_STREAM_METHOD,
)
from shmrdv._rpc.server import RpcServer

source = rpc_helpers.source

# Every method the server serves, and whether its answer is a stream.
METHODS = [
    (RECV_TENSOR_METHOD, False),
    (GET_STATUS_METHOD, False),
    (MARK_RECV_FINISHED_METHOD, False),
    (RECV_TENSOR_STREAM_METHOD, True),
    (RECV_TENSOR_SERIES_METHOD, True),
]


@pytest.mark.parametrize(
    ("method", "response_stream"), METHODS, ids=[m.rsplit("/", 1)[1] for m, _ in METHODS]
)
def test_gate_drops_a_silent_call_of_every_method_at_its_deadline(
    source: StepSource, method: str, response_stream: bool
) -> None:
    limits = ServerLimits(first_message_timeout=0.3)
    with RpcServer("127.0.0.1:0", source, limits=limits) as server:
        [(code, details, took)] = silent_call_outcomes(
            server.address, method, response_stream=response_stream
        )
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "first_message_timeout" in details and server.address in details
        assert 0.25 < took < 5, f"dropped after {took:.2f}s for a 0.3s deadline"
        wait_for(lambda: server.stats()["awaiting_request"] == 0, what="the call freed")
        assert server.stats()["silent_calls_dropped"] == 1
        # The server still serves.
        key = make_key("after")
        source.send(1, key, np.arange(3))
        with RpcClient() as client:
            assert pull(client, server.address, 1, key, timeout=10).value.tolist() == [0, 1, 2]


def test_gate_drops_the_oldest_silent_calls_beyond_its_bound(source: StepSource) -> None:
    """40 call slots: at most 10 calls may wait longer than a second for their request.
    Of 30 silent calls, the 20 oldest are dropped once they pass that second (not before:
    a burst of real calls gets time to be read), long before the 5 s deadline; a real
    call on a new connection is served meanwhile."""
    limits = ServerLimits(max_concurrent_rpcs=40)
    assert limits.max_awaiting_request == 10

    async def flood(
        address: str, server: RpcServer
    ) -> tuple[list[tuple[grpc.StatusCode, str, float]], dict[str, int]]:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(address) as ch:
            t0 = loop.time()
            calls = [ch.stream_unary(GET_STATUS_METHOD)(timeout=20) for _ in range(30)]
            codes = [asyncio.ensure_future(c.code()) for c in calls]
            ended_at: dict[int, float] = {}
            deadline = t0 + 4  # before the gate's deadline (5 s)
            while len(ended_at) < 20 and loop.time() < deadline:
                done, _ = await asyncio.wait(codes, timeout=0.02)
                for i, code in enumerate(codes):
                    if code in done and i not in ended_at:
                        ended_at[i] = loop.time() - t0
            ended = [
                (codes[i].result(), await calls[i].details() or "", took)
                for i, took in ended_at.items()
            ]
            stats = server.stats()
            async with grpc.aio.insecure_channel(address) as fresh:
                await fresh.unary_unary(GET_STATUS_METHOD)(b"", timeout=10)
            for c in calls:
                c.cancel()
            await asyncio.wait(codes, timeout=10)
            return ended, stats

    with RpcServer("127.0.0.1:0", source, limits=limits) as server:
        ended, stats = asyncio.run(flood(server.address, server))
        assert len(ended) == 20, ended
        assert all(code == grpc.StatusCode.UNAVAILABLE for code, _, _ in ended), ended
        assert all("more than 10 calls were waiting" in details for _, details, _ in ended)
        assert all(0.9 < took < 4 for _, _, took in ended), ended
        assert stats["awaiting_request"] == 10 and stats["crowded_calls_dropped"] == 20
        # Calls their clients cancel are freed at once, not at the deadline (5 s).
        wait_for(lambda: server.stats()["awaiting_request"] == 0, timeout=3, what="freed")
        assert server.stats()["silent_calls_dropped"] == 0


def test_gate_refuses_a_unary_call_that_ends_without_its_request(source: StepSource) -> None:
    with RpcServer("127.0.0.1:0", source) as server:
        [(code, details, took)] = silent_call_outcomes(
            server.address, GET_STATUS_METHOD, half_close=True
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "without a request message" in details
        assert took < 5
        assert server.stats()["awaiting_request"] == 0


def test_gate_keeps_the_real_calls_of_a_busy_client(source: StepSource) -> None:
    """900 receives in flight at once, each with its own call, three times as many as may
    wait long for their request: none is taken for silent, not even in the burst (the
    server starts them all before it reads their requests). Fewer than 1,000: beyond,
    gRPC's own overload shedding (``grpc.server.max_pending_requests``) may cancel some."""
    limits = ServerLimits(max_concurrent_rpcs=1200, first_message_timeout=1.0)
    assert limits.max_awaiting_request == 300
    keys = [make_key(f"busy{i}") for i in range(900)]
    with RpcServer("127.0.0.1:0", source, limits=limits) as server:
        with grpc.insecure_channel(server.address, rpc_helpers.CHANNEL_OPTIONS) as channel:
            inline = channel.unary_unary(RECV_TENSOR_METHOD)
            calls = [
                inline.future(messages.encode_request(1, k.full_key, i + 1), timeout=30)
                for i, k in enumerate(keys)
            ]
            wait_for(lambda: server.stats()["parked"] == len(keys), timeout=20, what="all parked")
            time.sleep(1.2)  # past the gate's deadline: they wait for values, not requests
            for i, k in enumerate(keys):
                source.send(1, k, np.array([i]))
            for i, c in enumerate(calls):
                assert messages.decode_response(c.result(timeout=30)).value.tolist() == [i]
        stats = server.stats()
        assert stats["silent_calls_dropped"] == 0 and stats["crowded_calls_dropped"] == 0
