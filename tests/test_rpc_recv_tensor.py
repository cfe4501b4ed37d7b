"""RecvTensor with shmrdv's extension fields: a tensor up to ``inline_max`` in the one
unary answer, a larger one left for RecvTensorStream, acks riding on the next request,
no thread per receive; real RpcServer and RpcClient on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import StepSource, make_key, pull

from shmrdv._errors import DeadlineExceededError
from shmrdv._rendezvous import Received
from shmrdv._rpc import assembly, messages
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.mark_finished import encode_mark_recv_finished
from shmrdv._rpc.methods import (
    MARK_RECV_FINISHED_METHOD,
    RECV_TENSOR_METHOD,
    RECV_TENSOR_STREAM_METHOD,
)
from shmrdv._rpc.server import RpcServer

# Shared fixtures (tests/rpc_helpers.py): a StepSource, a server on loopback, a channel.
source = rpc_helpers.source
server = rpc_helpers.server
channel = rpc_helpers.channel


def _inline(channel: grpc.Channel, request: bytes) -> bytes:
    data: bytes = channel.unary_unary(RECV_TENSOR_METHOD)(request, timeout=5)
    return data


# -- the server's method ---------------------------------------------------------------------


def test_recv_tensor_answers_a_small_tensor_as_tf_response(
    source: StepSource, channel: grpc.Channel
) -> None:
    key = make_key("small")
    source.send(1, key, np.arange(5, dtype=np.int32))
    data = _inline(channel, messages.encode_request(1, key.full_key, 7, inline_max=1024))
    got = messages.decode_response(data)
    assert got.value.tolist() == [0, 1, 2, 3, 4] and not got.is_dead


def test_recv_tensor_leaves_a_large_tensor_for_the_stream_under_its_request_id(
    source: StepSource, server: RpcServer, channel: grpc.Channel
) -> None:
    key = make_key("large")
    source.send(1, key, np.arange(1000, dtype=np.int64))
    source.send(1, key, np.array([-1]))
    assert _inline(channel, messages.encode_request(1, key.full_key, 9, inline_max=100)) == b""
    assert server.stats()["cached"] == 1
    stream = channel.unary_stream(RECV_TENSOR_STREAM_METHOD)(
        messages.encode_request(1, key.full_key, 9), timeout=5
    )
    assembler = assembly.StreamAssembler()
    for message in stream:
        assembler.feed(message)
    assert assembler.result().tolist() == list(range(1000))
    # The next value was not taken meanwhile.
    rest = _inline(channel, messages.encode_request(1, key.full_key, 10))
    assert messages.decode_response(rest).value.tolist() == [-1]


def test_recv_tensor_left_value_goes_back_when_released(
    source: StepSource, server: RpcServer, channel: grpc.Channel
) -> None:
    key = make_key("released")
    source.send(1, key, np.arange(1000, dtype=np.int64))
    assert _inline(channel, messages.encode_request(1, key.full_key, 11, inline_max=0)) == b""
    release = encode_mark_recv_finished(11, released=True)
    channel.unary_unary(MARK_RECV_FINISHED_METHOD)(release, timeout=5)
    again = _inline(channel, messages.encode_request(1, key.full_key, 12))
    assert messages.decode_response(again).value.tolist() == list(range(1000))


def test_recv_tensor_request_id_zero_is_always_answered_inline(
    source: StepSource, channel: grpc.Channel
) -> None:
    key = make_key("zero")
    source.send(1, key, np.arange(1000, dtype=np.int64))
    data = _inline(channel, messages.encode_request(1, key.full_key, 0, inline_max=0))
    assert messages.decode_response(data).value.tolist() == list(range(1000))


def test_recv_tensor_acks_release_the_cache(
    source: StepSource, server: RpcServer, channel: grpc.Channel
) -> None:
    key = make_key("acks")
    source.send(1, key, np.array([1]))
    source.send(1, key, np.array([2]))
    _inline(channel, messages.encode_request(1, key.full_key, 21))
    assert server.stats()["cached"] == 1
    _inline(channel, messages.encode_request(1, key.full_key, 22, finished=[21]))
    assert server.stats()["cached"] == 1  # 22's, until it is acked in turn


# -- the client ---------------------------------------------------------------------------------


def test_client_small_value_costs_one_call_each(source: StepSource, server: RpcServer) -> None:
    with RpcClient() as client:
        key = make_key("one-call")
        source.send(1, key, np.arange(3))
        before = server.stats()["calls"]
        got = pull(client, server.address, 1, key, timeout=5)
        assert got.value.tolist() == [0, 1, 2]
        assert got.value.flags.writeable
        assert server.stats()["calls"] - before == 1
        for i in range(3):
            source.send(1, key, np.array([i]))
            assert pull(client, server.address, 1, key, timeout=5).value.tolist() == [i]
        assert server.stats()["calls"] - before == 4  # one RecvTensor per receive


def test_client_large_value_is_streamed_after_the_unary_call(
    source: StepSource, server: RpcServer
) -> None:
    with RpcClient(inline_max=1024) as client:
        key = make_key("streamed")
        big = np.arange(100_000, dtype=np.float64)
        source.send(1, key, big)
        source.send(1, key, np.array([7.0]))
        before = server.stats()["calls"]
        got = pull(client, server.address, 1, key, timeout=10)
        np.testing.assert_array_equal(got.value, big)
        # RecvTensor (empty: "too large for you, stream it"), then RecvTensorStream
        assert server.stats()["calls"] - before == 2
        assert pull(client, server.address, 1, key, timeout=5).value.tolist() == [7.0]
        wait_for(lambda: server.stats()["cached"] <= 1)


def test_client_acks_ride_on_the_next_request(source: StepSource, server: RpcServer) -> None:
    with RpcClient() as client:
        key = make_key("piggyback")
        for i in range(20):
            source.send(1, key, np.array([i]))
            assert pull(client, server.address, 1, key, timeout=5).value.tolist() == [i]
            # Each request carried the previous one's ack: at most the last one is cached.
            assert server.stats()["cached"] <= 1
        wait_for(lambda: server.stats()["cached"] == 0)  # the last goes on its own


def test_client_pending_receives_need_no_thread_each(source: StepSource, server: RpcServer) -> None:
    with RpcClient() as client:
        warm = make_key("warm")
        source.send(1, warm, np.array([0]))
        pull(client, server.address, 1, warm, timeout=5)
        before = threading.active_count()
        results: list[tuple[BaseException | None, Received | None]] = []
        all_done = threading.Event()
        lock = threading.Lock()

        def done(error: BaseException | None, received: Received | None) -> None:
            with lock:
                results.append((error, received))
                if len(results) == 32:
                    all_done.set()

        keys = [make_key(f"pending{i}") for i in range(32)]
        for key in keys:
            client.start_recv(server.address, 1, key, done, timeout=20)
        wait_for(lambda: source.pending_waiters(1) == 32)
        assert threading.active_count() <= before + 2
        for i, key in enumerate(keys):
            source.send(1, key, np.array([i]))
        assert all_done.wait(10)
        assert sorted(int(r.value[0]) for e, r in results if r is not None) == list(range(32))
        assert all(e is None for e, _ in results)


def test_client_done_may_block_without_stalling_other_receives(
    source: StepSource, server: RpcServer
) -> None:
    # A done that waits for another receive of the same client must not deadlock it.
    with RpcClient() as client:
        first, second = make_key("first"), make_key("second")
        inner: list[Received] = []
        finished = threading.Event()

        def done(error: BaseException | None, received: Received | None) -> None:
            inner.append(pull(client, server.address, 1, second, timeout=5))
            finished.set()

        client.start_recv(server.address, 1, first, done, timeout=10)
        source.send(1, first, np.array([1]))
        time.sleep(0.1)
        source.send(1, second, np.array([2]))
        assert finished.wait(10)
        assert inner[0].value.tolist() == [2]


def test_client_timeout_removes_the_waiter(source: StepSource, server: RpcServer) -> None:
    with RpcClient() as client:
        key = make_key("late")
        with pytest.raises(DeadlineExceededError, match="late"):
            pull(client, server.address, 1, key, timeout=0.3)
        wait_for(lambda: source.pending_waiters(1) == 0)
        source.send(1, key, np.array([5]))
        assert pull(client, server.address, 1, key, timeout=5).value.tolist() == [5]
