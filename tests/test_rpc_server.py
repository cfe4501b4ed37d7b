"""RpcServer over a real gRPC server on 127.0.0.1, called with a raw gRPC channel.

The raw channel is what a TensorFlow worker would use: the hand-registered method path
and bytes in, bytes out; responses are parsed with the generated protobuf classes.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import INCARNATION, TASK, StepSource, make_key

from shmrdv._errors import InvalidArgumentError, UnavailableError
from shmrdv._keys import ParsedKey
from shmrdv._rpc import messages
from shmrdv._rpc.guard import Limits
from shmrdv._rpc.messages import GET_STATUS as GET_STATUS_METHOD
from shmrdv._rpc.messages import MARK_RECV_FINISHED as MARK_RECV_FINISHED_METHOD
from shmrdv._rpc.messages import RECV_TENSOR as RECV_TENSOR_METHOD
from shmrdv._rpc.messages import encode_finished
from shmrdv._rpc.proto import rendezvous_pb2, types_pb2, worker_pb2
from shmrdv._rpc.server import RpcServer

# Shared fixtures (tests/rpc_helpers.py): a StepSource, a server on loopback, a channel.
source = rpc_helpers.source
server = rpc_helpers.server
channel = rpc_helpers.channel

_OPTIONS = [("grpc.max_receive_message_length", 2**31 - 1)]


def _request(
    step_id: int,
    key: ParsedKey | str,
    request_id: int = 0,
    *,
    chunks: bool = False,
    offset: int = 0,
) -> bytes:
    text = key if isinstance(key, str) else key.full_key
    return messages.encode_request(step_id, text, request_id, chunks=chunks, offset=offset)


def _unary(channel: grpc.Channel) -> Any:
    return channel.unary_unary(RECV_TENSOR_METHOD)


def _decoded(data: bytes) -> Any:
    got = messages.Assembly().feed(data)
    assert got is not None
    return got


def _value(data: bytes) -> list[Any]:
    return list(_decoded(data).value.tolist())


# -- lifecycle -----------------------------------------------------------------------------------


def test_server_address_reports_bound_port(server: RpcServer) -> None:
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_server_binds_loopback_only(server: RpcServer) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    listeners = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                listeners.append(addr)
    # 127.0.0.1, as IPv4 or IPv4-mapped IPv6 (gRPC may listen on a tcp6 socket); nothing else.
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
    assert listeners and set(listeners) <= loopback


def test_server_bind_in_use_is_unavailable(source: StepSource, server: RpcServer) -> None:
    with pytest.raises(UnavailableError, match=server.address):
        RpcServer(server.address, source).start()


def test_server_bad_bind_is_invalid(source: StepSource) -> None:
    with pytest.raises(InvalidArgumentError, match="host:port"):
        RpcServer("127.0.0.1", source)


def test_server_stop_is_idempotent_and_leaves_no_threads(source: StepSource) -> None:
    # Threads are compared by identity, not counted: threads of earlier tests (a closed
    # channel's, gRPC's aio poller) end on their own schedule, and one ending while the
    # server starts made "count went up" fail once (``assert 5 > 5``). The thread below
    # stands for them: alive at the snapshot, it ends while the server runs.
    leaving = threading.Event()
    straggler = threading.Thread(target=leaving.wait, args=(10,), name="earlier test's thread")
    straggler.start()
    gc.collect()
    before = set(threading.enumerate())
    srv = RpcServer("127.0.0.1:0", source).start()
    leaving.set()
    straggler.join(timeout=10)
    started = set(threading.enumerate()) - before
    assert started, "the server started no thread"
    srv.stop()
    srv.stop()
    srv.close()
    del srv
    gc.collect()
    wait_for(
        lambda: not set(threading.enumerate()) - before,
        what=f"the end of the server's threads {sorted(t.name for t in started)}",
    )


def test_server_stop_fails_waiting_calls_quickly(source: StepSource) -> None:
    srv = RpcServer("127.0.0.1:0", source).start()
    key = make_key("never")
    with grpc.insecure_channel(srv.address, _OPTIONS) as ch:
        fut = _unary(ch).future(_request(1, key), timeout=30)
        wait_for(lambda: source.pending_waiters(1) == 1)
        t0 = time.monotonic()
        srv.stop()
        with pytest.raises(grpc.RpcError) as info:
            fut.result(timeout=5)
        assert time.monotonic() - t0 < 2
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    assert source.pending_waiters(1) == 0  # the waiter was removed from the source


# -- the TensorFlow unary path ------------------------------------------------------------------


def test_recv_tensor_answers_tf_response(source: StepSource, channel: grpc.Channel) -> None:
    key = make_key("a")
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    source.send(1, key, value)
    data = _unary(channel)(_request(1, key), timeout=5)
    resp = worker_pb2.RecvTensorResponse.FromString(data)
    assert resp.tensor.dtype == types_pb2.DT_FLOAT
    assert [d.size for d in resp.tensor.tensor_shape.dim] == [3, 4]
    assert resp.tensor.tensor_content == value.tobytes()
    assert not resp.is_dead
    assert resp.send_start_micros > 0


@pytest.mark.parametrize(
    "value",
    [
        np.arange(10, dtype=np.int64),
        np.array([True, False, True]),
        np.linspace(0, 1, 6, dtype=np.float64).reshape(2, 3),
        np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        np.ones((2, 2), dtype=np.float16),
        np.zeros((0, 5), dtype=np.uint8),
        np.array(7.5, dtype=np.float32),
        np.array(["ab", "cde"], dtype="U3"),
    ],
    ids=["int64", "bool", "float64", "complex64", "float16", "empty", "0-d", "unicode"],
)
def test_recv_tensor_round_trips_values(
    source: StepSource, channel: grpc.Channel, value: np.ndarray[Any, Any]
) -> None:
    key = make_key("v")
    source.send(2, key, value)
    decoded = _decoded(_unary(channel)(_request(2, key), timeout=5))
    assert decoded.value.dtype == value.dtype and decoded.value.shape == value.shape
    np.testing.assert_array_equal(decoded.value, value)


def test_recv_tensor_carries_is_dead(source: StepSource, channel: grpc.Channel) -> None:
    key = make_key("dead")
    source.send(1, key, np.zeros(3), is_dead=True)
    resp = worker_pb2.RecvTensorResponse.FromString(_unary(channel)(_request(1, key), timeout=5))
    assert resp.is_dead


def test_get_status_lists_cpu_device(channel: grpc.Channel) -> None:
    resp = worker_pb2.GetStatusResponse.FromString(
        channel.unary_unary(GET_STATUS_METHOD)(b"", timeout=5)
    )
    (dev,) = resp.device_attributes
    assert dev.name == f"{TASK}/device:CPU:0"
    assert dev.device_type == "CPU"
    assert dev.incarnation == INCARNATION


def test_recv_tensor_waits_for_send(source: StepSource, channel: grpc.Channel) -> None:
    key = make_key("later")
    fut = _unary(channel).future(_request(1, key), timeout=10)
    wait_for(lambda: source.pending_waiters(1) == 1)
    assert not fut.done()
    source.send(1, key, np.array([42]))
    assert _decoded(fut.result(timeout=5)).value.tolist() == [42]


def test_recv_tensor_deadline_removes_waiter(source: StepSource, channel: grpc.Channel) -> None:
    key = make_key("slow")
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(_request(1, key), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: source.pending_waiters(1) == 0)
    source.send(1, key, np.array([1]))  # not swallowed by the expired waiter
    assert _value(_unary(channel)(_request(1, key), timeout=5)) == [1]


def test_recv_tensor_cancel_removes_waiter(source: StepSource, channel: grpc.Channel) -> None:
    key = make_key("cancelled")
    fut = _unary(channel).future(_request(1, key), timeout=10)
    wait_for(lambda: source.pending_waiters(1) == 1)
    assert fut.cancel()
    wait_for(lambda: source.pending_waiters(1) == 0)
    source.send(1, key, np.array([5]))
    assert _value(_unary(channel)(_request(1, key), timeout=5)) == [5]


def test_recv_tensor_cleaned_up_step_aborts_at_once(
    source: StepSource, channel: grpc.Channel
) -> None:
    source.cleanup(9)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(_request(9, make_key("x")), timeout=10)
    assert time.monotonic() - t0 < 1
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "9" in info.value.details()


def test_recv_tensor_cleanup_while_waiting_aborts(
    source: StepSource, channel: grpc.Channel
) -> None:
    fut = _unary(channel).future(_request(4, make_key("x")), timeout=10)
    wait_for(lambda: source.pending_waiters(4) == 1)
    source.cleanup(4)
    with pytest.raises(grpc.RpcError) as info:
        fut.result(timeout=5)
    assert info.value.code() == grpc.StatusCode.ABORTED


def test_recv_tensor_wrong_src_is_invalid_argument(channel: grpc.Channel) -> None:
    key = make_key("x", src_task="/job:worker/replica:0/task:10")
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(_request(1, key), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == f"Invalid rendezvous key (src): {key.full_key} @ {TASK}"


def test_recv_tensor_wrong_incarnation_is_aborted(channel: grpc.Channel) -> None:
    key = make_key("x", incarnation=12345)
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(_request(1, key), timeout=5)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert info.value.details() == (
        f"RecvTensor expects a different device incarnation: {12345:016x} vs. {INCARNATION:016x}. "
        f'Your worker job ("{TASK}") was probably restarted. Check your worker job for '
        "the reason why it was restarted."
    )


def test_recv_tensor_incarnation_zero_is_not_checked(
    source: StepSource, channel: grpc.Channel
) -> None:
    key = make_key("x", incarnation=0)
    source.send(1, key, np.array([3]))
    assert _value(_unary(channel)(_request(1, key), timeout=5)) == [3]


@pytest.mark.parametrize("bad", ["not a key", b"\xff\xff\xff"])
def test_recv_tensor_bad_request_is_invalid_argument(channel: grpc.Channel, bad: object) -> None:
    request = _request(1, bad) if isinstance(bad, str) else bad
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(request, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- request_id: retries, duplicates, MarkRecvFinished --------------------------------------------


def test_recv_tensor_retry_is_served_from_cache(source: StepSource, channel: grpc.Channel) -> None:
    key = make_key("retry")
    source.send(1, key, np.array([1, 2, 3]))
    source.send(1, key, np.array([4, 5, 6]))
    first = _unary(channel)(_request(1, key, request_id=77), timeout=5)
    second = _unary(channel)(_request(1, key, request_id=77), timeout=5)
    assert _decoded(first).value.tolist() == [1, 2, 3]
    assert _decoded(second).value.tolist() == [1, 2, 3]
    assert worker_pb2.RecvTensorResponse.FromString(first).require_ack
    # A new request_id takes the next value.
    third = _unary(channel)(_request(1, key, request_id=78), timeout=5)
    assert _decoded(third).value.tolist() == [4, 5, 6]


def test_recv_tensor_duplicate_while_waiting_joins(
    source: StepSource, channel: grpc.Channel
) -> None:
    key = make_key("dup")
    a = _unary(channel).future(_request(1, key, request_id=5), timeout=10)
    wait_for(lambda: source.pending_waiters(1) == 1)
    b = _unary(channel).future(_request(1, key, request_id=5), timeout=10)
    time.sleep(0.1)
    assert source.pending_waiters(1) == 1  # joined, not a second waiter
    source.send(1, key, np.array([9]))
    assert _decoded(a.result(timeout=5)).value.tolist() == [9]
    assert _decoded(b.result(timeout=5)).value.tolist() == [9]


def test_mark_recv_finished_releases_the_cached_response(
    source: StepSource, channel: grpc.Channel, server: RpcServer
) -> None:
    key = make_key("ack")
    source.send(1, key, np.array([1]))
    _unary(channel)(_request(1, key, request_id=31), timeout=5)
    assert server.stats()["cached"] == 1
    ack = worker_pb2.MarkRecvFinishedRequest(request_id=31).SerializeToString()
    channel.unary_unary(MARK_RECV_FINISHED_METHOD)(ack, timeout=5)
    assert server.stats()["cached"] == 0
    # The id was answered and is gone from the cache: a retry must not steal the next value.
    source.send(1, key, np.array([2]))
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(_request(1, key, request_id=31), timeout=5)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "31" in info.value.details()


def test_recv_tensor_cache_expires(source: StepSource) -> None:
    key = make_key("ttl")
    with (
        RpcServer("127.0.0.1:0", source, limits=Limits(cache_ttl=0.05)) as srv,
        grpc.insecure_channel(srv.address, _OPTIONS) as ch,
    ):
        source.send(1, key, np.array([1]))
        _unary(ch)(_request(1, key, request_id=3), timeout=5)
        time.sleep(0.1)
        source.send(1, key, np.array([2]))
        _unary(ch)(_request(1, key, request_id=4), timeout=5)  # a lookup expires old entries
        assert srv.stats()["cached"] == 1


# -- large values, in chunks ----------------------------------------------------------------


def _chunked(
    channel: grpc.Channel, step_id: int, key: ParsedKey, rid: int
) -> tuple[Any, list[int]]:
    """A large value fetched as a shmrdv client does: the first chunk answers the call,
    the others are asked for by offset under the same request_id."""
    first = _unary(channel)(_request(step_id, key, rid, chunks=True), timeout=10)
    assembly = messages.Assembly()
    got = assembly.feed(first)
    sizes = [len(first)]
    for offset in assembly.missing:
        chunk = _unary(channel)(_request(step_id, key, rid, chunks=True, offset=offset), timeout=10)
        sizes.append(len(chunk))
        got = assembly.feed(chunk)
    return got, sizes


def test_a_large_value_comes_in_bounded_chunks(source: StepSource, channel: grpc.Channel) -> None:
    key = make_key("big")
    value = np.random.default_rng(0).random((1000, 300))  # 2.4 MB in 64 KiB chunks
    source.send(1, key, value)
    got, sizes = _chunked(channel, 1, key, 77)
    assert max(sizes) <= (64 << 10) + 256
    assert len(sizes) == -(-value.nbytes // (64 << 10))
    np.testing.assert_array_equal(got.value, value)
    ext = rendezvous_pb2.RecvTensorResponseExt.FromString(
        _unary(channel)(_request(1, key, 77, chunks=True, offset=64 << 10), timeout=10)
    )
    assert ext.offset == 64 << 10 and ext.content_bytes == value.nbytes  # a retry: cached


def test_a_large_value_goes_whole_to_a_client_that_takes_no_chunks(
    source: StepSource, channel: grpc.Channel
) -> None:
    key = make_key("tf")
    value = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: TensorFlow's client
    source.send(1, key, value)
    data = _unary(channel)(_request(1, key, 5), timeout=10)
    ref = worker_pb2.RecvTensorResponse.FromString(data)
    assert ref.tensor.tensor_content == value.tobytes()


def test_server_many_waiting_calls_need_no_threads(
    source: StepSource, channel: grpc.Channel
) -> None:
    before = threading.active_count()
    keys = [make_key(f"k{i}") for i in range(64)]
    futs = [_unary(channel).future(_request(1, k), timeout=20) for k in keys]
    wait_for(lambda: source.pending_waiters(1) == 64)
    assert threading.active_count() <= before + 2  # gRPC's own channel thread at most
    for i, k in enumerate(keys):
        source.send(1, k, np.array([i]))
    assert [_decoded(f.result(timeout=10)).value[0] for f in futs] == list(range(64))


def test_a_chunked_value_not_acknowledged_is_kept_for_a_retry(
    source: StepSource, channel: grpc.Channel, server: RpcServer
) -> None:
    key = make_key("retry-chunks")
    value = np.arange(1 << 17, dtype=np.float64)
    source.send(1, key, value)
    _unary(channel)(_request(1, key, 99, chunks=True), timeout=10)  # the first chunk
    got, _ = _chunked(channel, 1, key, 99)  # all over again, under the same request_id
    np.testing.assert_array_equal(got.value, value)
    assert server.stats()["requeued"] == 0


def test_expired_undelivered_value_goes_back(source: StepSource) -> None:
    key = make_key("expire")
    value = np.arange(1 << 17, dtype=np.float64)
    with (
        RpcServer("127.0.0.1:0", source, limits=Limits(cache_ttl=0.05)) as srv,
        grpc.insecure_channel(srv.address, _OPTIONS) as ch,
    ):
        source.send(1, key, value)
        _unary(ch)(_request(1, key, 4, chunks=True), timeout=10)  # the first chunk, no ack
        wait_for(lambda: srv.stats()["requeued"] == 1)  # no other call needed
        np.testing.assert_array_equal(
            _decoded(_unary(ch)(_request(1, key), timeout=10)).value, value
        )


def test_released_request_id_gives_a_taken_value_back(
    source: StepSource, channel: grpc.Channel, server: RpcServer
) -> None:
    key = make_key("release")
    value = np.arange(1 << 17, dtype=np.float64)
    source.send(1, key, value)
    _unary(channel)(_request(1, key, 8, chunks=True), timeout=10)  # cached for a retry...
    channel.unary_unary(MARK_RECV_FINISHED_METHOD)(encode_finished(8, released=True), timeout=5)
    assert server.stats()["requeued"] == 1  # ...until released
    np.testing.assert_array_equal(
        _decoded(_unary(channel)(_request(1, key), timeout=10)).value, value
    )


def test_acked_value_is_not_given_back(
    source: StepSource, channel: grpc.Channel, server: RpcServer
) -> None:
    key = make_key("acked")
    source.send(1, key, np.arange(1 << 17, dtype=np.float64))
    _chunked(channel, 1, key, 12)
    channel.unary_unary(MARK_RECV_FINISHED_METHOD)(encode_finished(12), timeout=5)
    assert server.stats()["cached"] == 0 and server.stats()["requeued"] == 0
    with pytest.raises(grpc.RpcError) as info:  # TensorFlow: a request_id answered before
        _unary(channel)(_request(1, key, 12), timeout=5)
    assert info.value.code() == grpc.StatusCode.ABORTED


def test_released_request_id_of_a_parked_call_leaves_the_value_in_its_key(
    source: StepSource, channel: grpc.Channel, server: RpcServer
) -> None:
    # A client cancels a parked call and releases its request_id: the call is unparked
    # (ABORTED) and takes nothing, so the value sent next goes to the next call.
    key = make_key("released_parked")
    parked = _unary(channel).future(_request(1, key, request_id=9), timeout=10)
    wait_for(lambda: server.stats()["parked"] == 1)
    channel.unary_unary(MARK_RECV_FINISHED_METHOD)(encode_finished(9, released=True), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        parked.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.ABORTED
    value = np.arange(5.0)
    source.send(1, key, value)
    np.testing.assert_array_equal(
        _decoded(_unary(channel)(_request(1, key), timeout=10)).value, value
    )


def test_call_after_its_release_takes_nothing(
    source: StepSource, channel: grpc.Channel, server: RpcServer
) -> None:
    # The release of a cancelled call overtook the call itself (another HTTP/2 stream):
    # the call arrives for a request_id its client already gave up, and takes nothing.
    key = make_key("release_first")
    channel.unary_unary(MARK_RECV_FINISHED_METHOD)(encode_finished(10, released=True), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        _unary(channel)(_request(1, key, request_id=10), timeout=10)
    assert info.value.code() == grpc.StatusCode.ABORTED and "released" in info.value.details()
    value = np.arange(3.0)
    source.send(1, key, value)
    np.testing.assert_array_equal(
        _decoded(_unary(channel)(_request(1, key), timeout=10)).value, value
    )
