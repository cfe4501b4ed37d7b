"""A series (RecvTensorSeries) survives its connection dropping: nothing sent is lost.

Two real Workers over gRPC on loopback; the consumer reaches the producer through a small
TCP proxy in this process (its cluster spec gives the proxy's address for the producer),
which can hold what the producer writes (the bytes stay in the proxy: the producer's
gRPC has taken them, the consumer has not got them) and cut every connection (both
sockets closed, what it held dropped). Values in flight at the cut must still reach the
consumer, in order, each once, once the proxy accepts again: the producer keeps what it
handed to a series until the consumer acknowledges it, and a consumer that re-opens its
series after a drop says how many values it holds.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import CHANNEL_OPTIONS, StepSource, make_key

import shmrdv
from shmrdv._errors import DeadlineExceededError
from shmrdv._rpc import assembly, messages, series_wire
from shmrdv._rpc.methods import RECV_TENSOR_SERIES_ACK_METHOD, RECV_TENSOR_SERIES_METHOD
from shmrdv._rpc.proto import worker_pb2
from shmrdv._rpc.series_service import SeriesLimits
from shmrdv._rpc.server import RpcServer

pytestmark = pytest.mark.timeout(60)

source = rpc_helpers.source

_P = "/job:resume/replica:0/task:0"
_C = "/job:resume/replica:0/task:1"
_JOIN = 5.0


def _key() -> str:
    return shmrdv.create_key(_P + "/device:CPU:0", 0, _C + "/device:CPU:0", "channel")


class CutProxy:
    """A TCP proxy on loopback to ``upstream`` (``host:port``) that can hold what comes
    from upstream and cut every connection it carries; it accepts again after a cut."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._holding = False
        self.refusing = False  # close each connection at once (the producer unreachable)
        self.held = 0  # bytes from upstream held back since hold()
        self.accepted = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="proxy-accept")]
        self._threads[0].start()

    def hold(self) -> None:
        """Keep what upstream sends from now on (read, not forwarded) until the cut."""
        with self._lock:
            self._holding = True

    def cut(self) -> None:
        """Close both sockets of every connection; what was held is dropped."""
        with self._lock:
            socks, self._socks = self._socks, []
            self._holding = False
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked on it
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(_JOIN)  # no connection accepted after this
        self.cut()
        for t in list(self._threads):
            t.join(_JOIN)
        self._listener.close()
        assert not any(t.is_alive() for t in self._threads)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.refusing:
                down.close()
                continue
            try:
                up = socket.create_connection(self._upstream, timeout=_JOIN)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            down.settimeout(None)
            with self._lock:
                self._socks += [down, up]
                self.accepted += 1
            for src, dst, downstream in ((down, up, False), (up, down, True)):
                t = threading.Thread(target=self._pump, args=(src, dst, downstream))
                t.name = "proxy-pump"
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    if downstream and self._holding:
                        self.held += len(data)
                        continue
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def proxied(ns: str) -> Iterator[tuple[shmrdv.Worker, shmrdv.Worker, CutProxy]]:
    with shmrdv.Worker(_P, namespace=ns, transports=("grpc",)) as producer:
        assert producer.address is not None
        proxy = CutProxy(producer.address)
        try:
            cluster = {"resume": {0: proxy.address}}  # the consumer's way to the producer
            with shmrdv.Worker(_C, cluster=cluster, namespace=ns, transports=("grpc",)) as consumer:
                yield producer, consumer, proxy
        finally:
            proxy.close()


def _value(i: int, size: int) -> npt.NDArray[Any]:
    return np.full(size // 4, i, np.int32)


def _check(got: npt.NDArray[Any], i: int, size: int) -> None:
    assert got.shape == (size // 4,)
    assert got[0] == got[-1] == i, f"value {i} came as {got[0]}"


@pytest.mark.parametrize(
    ("size", "n"),
    [(1024, 20), (6 << 20, 3)],
    ids=["small-written-whole", "6m-cut-inside-a-value"],
)
def test_values_in_flight_when_the_connection_drops_come_once_in_order(
    proxied: tuple[shmrdv.Worker, shmrdv.Worker, CutProxy], size: int, n: int
) -> None:
    """Before: the series failed the waiting receive (``UnavailableError``) and the values
    its producer had written were gone: the next receives timed out."""
    producer, consumer, proxy = proxied
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):  # the second opens the key's series
        p.send(_key(), _value(i, size), timeout=10)
        _check(c.recv(_key(), timeout=10).value, i, size)
    assert consumer.stats()["grpc"]["series"] == 1
    waiting = c.recv_future(_key())  # a receive waiting on the series at the cut
    proxy.hold()
    for i in range(2, 2 + n):
        p.send(_key(), _value(i, size), timeout=10)
    if size <= 1024:  # all taken off the producer's outbox and written to the stream
        wait_for(lambda: proxy.held >= n * size, timeout=10, what="every value written")
        assert producer.stats()["grpc"]["outbox_values"] == 0
    else:  # the first value partly written
        wait_for(lambda: proxy.held >= 1 << 20, timeout=10, what="bytes held")
    proxy.cut()
    _check(waiting.result(timeout=20).value, 2, size)
    for i in range(3, 2 + n):
        _check(c.recv(_key(), timeout=20).value, i, size)
    for i in range(2 + n, 4 + n):  # the series goes on
        p.send(_key(), _value(i, size), timeout=10)
        _check(c.recv(_key(), timeout=20).value, i, size)
    with pytest.raises(DeadlineExceededError):
        c.recv(_key(), timeout=0.5)  # nothing twice
    assert proxy.accepted >= 2
    stats = consumer.stats()["grpc"]
    assert stats["received"] == 4 + n


def test_a_drop_with_nothing_in_flight_loses_and_repeats_nothing(
    proxied: tuple[shmrdv.Worker, shmrdv.Worker, CutProxy],
) -> None:
    """Every value written was received (and acknowledged) before the cut: after it the
    series goes on from the next one, none repeated."""
    producer, consumer, proxy = proxied
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(10):
        p.send(_key(), _value(i, 1024), timeout=10)
        _check(c.recv(_key(), timeout=10).value, i, 1024)
    proxy.cut()
    for i in range(10, 20):
        p.send(_key(), _value(i, 1024), timeout=10)
        _check(c.recv(_key(), timeout=20).value, i, 1024)
    with pytest.raises(DeadlineExceededError):
        c.recv(_key(), timeout=0.5)


def test_a_producer_unreachable_past_the_grace_fails_the_waiting_receive_and_loses_nothing(
    proxied: tuple[shmrdv.Worker, shmrdv.Worker, CutProxy],
) -> None:
    """The connection drops and the producer cannot be reached for longer than
    ``GONE_GRACE``: the receive waiting fails (``UnavailableError`` naming the producer),
    as a receive from a producer gone does; once it can be reached again, the next
    receives get every value sent, in order, once."""
    producer, consumer, proxy = proxied
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):
        p.send(_key(), _value(i, 1024), timeout=10)
        _check(c.recv(_key(), timeout=10).value, i, 1024)
    waiting = c.recv_future(_key())
    proxy.hold()
    for i in range(2, 6):
        p.send(_key(), _value(i, 1024), timeout=10)
    wait_for(lambda: proxy.held >= 4 * 1024, timeout=10, what="every value written")
    proxy.refusing = True
    proxy.cut()
    with pytest.raises(shmrdv.UnavailableError, match=_P) as info:
        waiting.result(timeout=20)
    assert "went away" in str(info.value)
    proxy.refusing = False
    for i in range(2, 6):
        _check(c.recv(_key(), timeout=20).value, i, 1024)
    with pytest.raises(DeadlineExceededError):
        c.recv(_key(), timeout=0.5)


def test_the_window_counts_what_a_series_sent_until_it_is_acknowledged(ns: str) -> None:
    """``max_inflight_bytes`` holds everything sent and not yet known to have arrived:
    with the connection holding what the producer writes, the producer stops at its
    window (before: what its server had written counted no more, and four windows' worth
    of sends went through), and after a cut every value it sent arrives, once."""
    window, size = 256 << 10, 16 << 10
    with shmrdv.Worker(
        _P, namespace=ns, transports=("grpc",), max_inflight_bytes=window
    ) as producer:
        assert producer.address is not None
        proxy = CutProxy(producer.address)
        try:
            cluster = {"resume": {0: proxy.address}}
            with shmrdv.Worker(_C, cluster=cluster, namespace=ns, transports=("grpc",)) as consumer:
                p, c = producer.rendezvous(1), consumer.rendezvous(1)
                for i in range(2):
                    p.send(_key(), _value(i, size), timeout=10)
                    _check(c.recv(_key(), timeout=10).value, i, size)
                proxy.hold()
                sent = 2
                with pytest.raises(shmrdv.ResourceExhaustedError, match="max_inflight_bytes"):
                    while sent < 2 + 4 * window // size:
                        p.send(_key(), _value(sent, size), timeout=0.5)
                        sent += 1
                assert sent - 2 <= window // size
                assert producer.stats()["grpc"]["inflight_bytes"] <= window
                proxy.cut()
                for i in range(2, sent):
                    _check(c.recv(_key(), timeout=20).value, i, size)
                with pytest.raises(DeadlineExceededError):
                    c.recv(_key(), timeout=0.5)
        finally:
            proxy.close()


# -- the wire: the count a series holds, the ack ---------------------------------------------


def test_held_rides_on_the_request_and_both_parsers_read_it() -> None:
    key = make_key("held").full_key
    data = messages.encode_request(3, key, 77, held=12)
    assert messages.decode_request(data).held == 12  # the one-pass reader
    assert messages.decode_request(memoryview(data)).held == 12  # the general one
    assert messages.decode_request(messages.encode_request(3, key, 77)).held == 0
    parsed = worker_pb2.RecvTensorRequest.FromString(data)  # protobuf skips it
    assert (parsed.step_id, parsed.rendezvous_key, parsed.request_id) == (3, key, 77)


def test_an_ack_for_more_than_was_sent_is_refused_and_one_in_range_frees_the_window(
    source: StepSource,
) -> None:
    """A resumable series (a request_id) keeps what it sent until acknowledged; an ack
    naming more values than it handed out is ``INVALID_ARGUMENT``, naming the key."""
    key = make_key("acked")
    with (
        RpcServer("127.0.0.1:0", source) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        series = ch.unary_stream(RECV_TENSOR_SERIES_METHOD)
        ack = ch.unary_unary(RECV_TENSOR_SERIES_ACK_METHOD)
        call = series(messages.encode_request(1, key.full_key, 5), timeout=30)
        source.send(1, key, np.arange(4))
        first = next(call)
        assert list(series_wire.series_chunks(first))  # the value
        assert next(call) == series_wire.ASK  # then, nothing more to send: an ask
        assert server.stats()["series_values"] == 0  # not acknowledged yet
        with pytest.raises(grpc.RpcError) as info:
            ack(messages.encode_request(1, key.full_key, 5, held=2), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert key.full_key in (info.value.details() or "")
        assert ack(messages.encode_request(1, key.full_key, 5, held=1), timeout=10) == b""
        assert server.stats()["series_values"] == 1
        call.cancel()
        wait_for(lambda: server.stats()["series_open"] == 0, timeout=20)
        assert server.stats()["series_retained"] == 0  # nothing went back: forgotten


def test_a_series_cancelled_with_values_not_acknowledged_gives_them_back_in_order(
    source: StepSource,
) -> None:
    """Its call ended (the consumer went away): what it sent and nobody acknowledged
    goes back to the key's head, in order, for a receive by either method; a re-open
    that says it holds the first gets the second."""
    key = make_key("back")
    with (
        RpcServer("127.0.0.1:0", source) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        series = ch.unary_stream(RECV_TENSOR_SERIES_METHOD)
        call = series(messages.encode_request(1, key.full_key, 9), timeout=30)
        for i in range(3):
            source.send(1, key, np.array([i]))
        got = [m for m in (next(call), next(call)) if m != series_wire.ASK]
        assert got
        call.cancel()
        wait_for(lambda: server.stats()["series_open"] == 0, timeout=20)
        assert server.stats()["series_retained"] == 1
        again = series(messages.encode_request(1, key.full_key, 9, held=1), timeout=30)
        values: list[int] = []
        while len(values) < 2:
            message = next(again)
            for chunk in series_wire.series_chunks(message):
                assembler = assembly.StreamAssembler()
                assembler.feed(chunk)
                values.append(int(assembler.result()[0]))
        assert values == [1, 2]
        assert server.stats()["series_resumed"] == 1
        again.cancel()


def test_a_series_whose_consumer_never_acknowledges_stops_at_its_retained_bound(
    source: StepSource,
) -> None:
    """A resumable series keeps at most ``max_retained_bytes`` of values not
    acknowledged (then it asks, and takes no more); an ack lets the next ones go."""
    key = make_key("never-acks")
    size = 16 << 10
    with (
        RpcServer(
            "127.0.0.1:0", source, series=SeriesLimits(max_retained_bytes=4 * size)
        ) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        for i in range(20):
            source.send(1, key, np.full(size // 8, i, np.int64))
        series = ch.unary_stream(RECV_TENSOR_SERIES_METHOD)
        call = series(messages.encode_request(1, key.full_key, 3), timeout=1.5)
        got: list[int] = []
        asks = 0
        with pytest.raises(grpc.RpcError) as info:
            for message in call:
                asks += message == series_wire.ASK
                for chunk in series_wire.series_chunks(message):
                    assembler = assembly.StreamAssembler()
                    assembler.feed(chunk)
                    got.append(int(assembler.result()[0]))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert got == list(range(4)) and asks == 1  # before: all 20
        wait_for(lambda: server.stats()["series_open"] == 0, timeout=20)
        # It went away unacknowledged: all 20 are at the key again, in order.
        again = series(messages.encode_request(1, key.full_key, 3, held=4), timeout=10)
        ack = ch.unary_unary(RECV_TENSOR_SERIES_ACK_METHOD)
        got = []
        for message in again:
            if message == series_wire.ASK:
                ack(messages.encode_request(1, key.full_key, 3, held=4 + len(got)), timeout=10)
                continue
            for chunk in series_wire.series_chunks(message):
                assembler = assembly.StreamAssembler()
                assembler.feed(chunk)
                got.append(int(assembler.result()[0]))
            if len(got) == 16:
                break
        assert got == list(range(4, 20))
        again.cancel()
