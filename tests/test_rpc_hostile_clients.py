"""Hostile clients against a real server on loopback (issue 19 §4): a client that asks
and never reads holds the producer's ``max_inflight_bytes`` window, not its memory; one
connection cannot use up its host's bound of waiting calls; a value already there is
never refused; the Exchange stream (whose reply queue had no bound) is gone."""

from __future__ import annotations

import secrets
import socket
import struct
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import StepSource, make_key

from shmrdv._cluster import Peers
from shmrdv._errors import ResourceExhaustedError
from shmrdv._keys import DeviceName
from shmrdv._rpc import messages
from shmrdv._rpc.guard import Limits
from shmrdv._rpc.messages import RECV_TENSOR as RECV_TENSOR_METHOD
from shmrdv._rpc.server import RpcServer
from shmrdv._rpc.transport import GrpcTransport
from shmrdv._shm.transport import ShmBoard
from shmrdv._transport import TransportContext

pytestmark = pytest.mark.timeout(60)

source = rpc_helpers.source

_PRODUCER = "/job:worker/replica:0/task:0"
# A channel of its own connection (grpcio shares connections between equal channels).
_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


# -- a raw HTTP/2 client that asks and never reads ------------------------------------------


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _hpack_str(value: bytes) -> bytes:
    assert len(value) < 127
    return bytes([len(value)]) + value


class _NeverReads:
    """An HTTP/2 connection that announces a stream window of 0 bytes: the server may
    answer its calls but can send none of the answers' bytes."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.authority = address.encode()
        initial_window_0 = struct.pack(">HI", 4, 0)
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, initial_window_0))
        self._await_server_settings()
        self.sock.sendall(_frame(4, 1, 0, b""))  # SETTINGS ACK; from now on: never read
        self.next_stream = 1

    def _await_server_settings(self) -> None:
        buf = b""
        while True:
            while len(buf) < 9:
                buf += self.sock.recv(4096)
            length = int.from_bytes(buf[:3], "big")
            kind, flags = buf[3], buf[4]
            while len(buf) < 9 + length:
                buf += self.sock.recv(4096)
            buf = buf[9 + length :]
            if kind == 4 and not flags & 1:
                return

    def call(self, method: str, request: bytes) -> None:
        headers = (
            b"\x83\x86"  # :method POST, :scheme http
            + b"\x04" + _hpack_str(method.encode())  # :path
            + b"\x01" + _hpack_str(self.authority)  # :authority
            + b"\x0f\x10" + _hpack_str(b"application/grpc")  # content-type
            + b"\x00" + _hpack_str(b"te") + _hpack_str(b"trailers")
        )  # fmt: skip
        stream = self.next_stream
        self.next_stream += 2
        message = b"\x00" + struct.pack(">I", len(request)) + request
        self.sock.sendall(_frame(1, 4, stream, headers) + _frame(0, 1, stream, message))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def windowed(ns: str) -> Iterator[GrpcTransport]:
    """A producer's gRPC transport with a 256 KiB max_inflight_bytes window."""
    peers = Peers(ShmBoard(ns), None)
    ctx = TransportContext(
        task=DeviceName.parse(_PRODUCER),
        task_name=_PRODUCER,
        incarnation=1,
        namespace=ns,
        peers=peers,
        cleaned_up=lambda step: False,
        max_inflight_bytes=256 << 10,
    )
    t = GrpcTransport(ctx, "127.0.0.1:0", tls=None, token=None)
    yield t
    t.close()
    peers.close()


def test_a_client_that_asks_and_never_reads_holds_the_window(windowed: GrpcTransport) -> None:
    """Before: the window was given back when a call took the value, so the producer
    accepted send after send into memory that no one read (2,871 sends of 512 KiB into an
    8 MiB window, +3 GB). Now a value counts until its call has ended."""
    assert windowed.address is not None
    hostile = _NeverReads(windowed.address)
    try:
        keys = [make_key(f"never-read{i}", incarnation=1) for i in range(16)]
        for key in keys:
            hostile.call(RECV_TENSOR_METHOD, messages.encode_request(1, key.full_key, 0))
        wait_for(lambda: windowed.stats()["server_parked"] == 16, timeout=20)
        value = np.zeros(64 << 10, np.uint8)
        for key in keys[:4]:  # 4 x 64 KiB fill the window: taken at once, never read
            windowed.send(1, key, value, False, 5.0)
        wait_for(lambda: windowed.stats()["server_parked"] == 12, timeout=20)
        with pytest.raises(ResourceExhaustedError, match="max_inflight_bytes"):
            windowed.send(1, keys[4], value, False, 0.5)
        assert windowed.stats()["inflight_bytes"] == 256 << 10
    finally:
        hostile.close()
    # The connection is gone and its calls with it (request_id 0: nothing to keep for a
    # retry), so the window is free again.
    wait_for(lambda: windowed.stats()["inflight_bytes"] == 0, timeout=20)
    windowed.send(1, make_key("after", incarnation=1), np.zeros(256 << 10, np.uint8), False, 5.0)


# -- bounds on waiting calls ----------------------------------------------------------------


def _park(channel: grpc.Channel, name: str, n: int) -> list[grpc.Future]:
    call = channel.unary_unary(RECV_TENSOR_METHOD)
    return [
        call.future(
            messages.encode_request(1, make_key(f"{name}{i}").full_key, secrets.randbits(62) + 1),
            timeout=30,
        )
        for i in range(n)
    ]


def _wait_parked(server: RpcServer, n: int) -> None:
    wait_for(lambda: server.stats()["parked"] == n, timeout=20)


def test_one_connection_cannot_use_up_its_hosts_bound(source: StepSource) -> None:
    """Before: only the host was bounded, so one client parking 16,384 wants made every
    other consumer on its host get RESOURCE_EXHAUSTED."""
    with (
        RpcServer(
            "127.0.0.1:0",
            source,
            limits=Limits(max_waiting_per_peer=4, max_waiting_per_connection=2),
        ) as server,
        grpc.insecure_channel(server.address, _OWN_CONNECTION) as greedy,
        grpc.insecure_channel(server.address, _OWN_CONNECTION) as other,
    ):
        parked = _park(greedy, "greedy", 2)
        _wait_parked(server, 2)
        with pytest.raises(grpc.RpcError) as info:
            _park(greedy, "more", 1)[0].result(timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting_per_connection=2" in (info.value.details() or "")
        theirs = _park(other, "other", 2)  # the other consumer on that host still waits
        _wait_parked(server, 4)
        for i, call in enumerate(theirs):
            source.send(1, make_key(f"other{i}"), np.array([i]))
            got = messages.Assembly().feed(call.result(timeout=10))
            assert got is not None and got.value.tolist() == [i]
        for call in parked:
            call.cancel()


def test_a_value_already_there_is_never_refused(source: StepSource) -> None:
    """Before: with the bound full, a request for a value already waiting got
    RESOURCE_EXHAUSTED too."""
    with (
        RpcServer(
            "127.0.0.1:0", source, limits=Limits(max_waiting=3, max_waiting_per_peer=3)
        ) as server,
        grpc.insecure_channel(server.address, _OWN_CONNECTION) as greedy,
        grpc.insecure_channel(server.address, _OWN_CONNECTION) as other,
    ):
        parked = _park(greedy, "greedy", 3)
        _wait_parked(server, 3)
        key = make_key("there")
        for channel in (other, greedy):
            source.send(1, key, np.array([42]))
            data = channel.unary_unary(RECV_TENSOR_METHOD)(
                messages.encode_request(1, key.full_key, secrets.randbits(62) + 1), timeout=10
            )
            got = messages.Assembly().feed(data)
            assert got is not None and got.value.tolist() == [42]
        for call in parked:
            call.cancel()


# -- the Exchange stream is gone --------------------------------------------------------------


def test_exchange_is_gone_and_failing_calls_leave_nothing_queued(source: StepSource) -> None:
    """Before: an Exchange client flooding wants that failed at once, and never reading the
    replies, grew the server by 133 MB/s (its reply queue had no bound). The method is gone;
    the same flood of failing RecvTensor calls is answered call by call (each a status,
    no queue), and the server stays responsive."""
    with (
        RpcServer("127.0.0.1:0", source) as server,
        grpc.insecure_channel(server.address) as ch,
    ):
        exchange = ch.stream_stream("/shmrdv.Rendezvous/Exchange")
        with pytest.raises(grpc.RpcError) as info:
            list(exchange(iter([b""]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # Keys of another incarnation fail at once (ABORTED), as the flood's did.
        bad = make_key("flood", incarnation=12345)
        recv = ch.unary_unary(RECV_TENSOR_METHOD)
        t0 = time.monotonic()
        for batch in range(10):
            calls = [
                recv.future(messages.encode_request(1, bad.full_key, batch * 200 + i + 1))
                for i in range(200)
            ]
            for call in calls:
                assert call.code() == grpc.StatusCode.ABORTED
        assert time.monotonic() - t0 < 30
        stats = server.stats()
        assert stats["parked"] == 0 and stats["cached"] == 0
