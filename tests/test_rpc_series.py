"""RecvTensorSeries (shmrdv's one streaming method): a key received again is pushed to
its consumer, against real servers on loopback. Order, deadlines, aborts, closing, the
producer's window, the server's bounds, the fallback to RecvTensor (a producer without
series, a callback receive with no blocked receiver to read for it) and a connection
that drops (a small TCP proxy that can hold what the producer writes and cut every
connection: ``CutProxy``): every value comes once, in order."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import CHANNEL_OPTIONS, StepSource, make_key, pull
from test_rpc_hostile_clients import _NeverReads, windowed  # noqa: F401 (a fixture)

import shmrdv
from shmrdv._errors import DeadlineExceededError, ResourceExhaustedError
from shmrdv._rendezvous import Received
from shmrdv._rpc import messages
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.guard import Limits
from shmrdv._rpc.messages import MARK_RECV_FINISHED, RECV_TENSOR_SERIES
from shmrdv._rpc.server import RpcServer
from shmrdv._rpc.transport import GrpcTransport

pytestmark = pytest.mark.timeout(60)

source = rpc_helpers.source

_P = "/job:series/replica:0/task:0"
_C = "/job:series/replica:0/task:1"
_JOIN = 5.0


def _key() -> str:
    return shmrdv.create_key(_P + "/device:CPU:0", 0, _C + "/device:CPU:0", "channel")


def _value(i: int, size: int) -> npt.NDArray[Any]:
    return np.full(size // 4, i, np.int32)


def _check(got: npt.NDArray[Any], i: int, size: int) -> None:
    assert got.shape == (size // 4,)
    assert got[0] == got[-1] == i, f"value {i} came as {got[0]}"


def _read(call: Any, n: int, asks: list[int] | None = None) -> list[Received]:
    """``n`` values of a raw series call (ticks skipped, asks counted)."""
    out: list[Received] = []
    assembly = messages.Assembly()
    while len(out) < n:
        message = next(call)
        if not message:
            continue
        got = assembly.feed(message)
        if assembly.ask:
            if asks is not None:
                asks.append(len(out))
            continue
        if got is not None:
            out.append(got)
            assembly = messages.Assembly()
        for part in assembly.packed:
            whole = messages.Assembly().feed(part)
            assert whole is not None
            out.append(whole)
        if assembly.packed:
            assembly = messages.Assembly()
    return out


def _series(ch: grpc.Channel, key: Any, rid: int, held: int = 0, timeout: float = 30) -> Any:
    request = messages.encode_request(1, key.full_key, rid, held=held)
    return ch.unary_stream(RECV_TENSOR_SERIES)(request, timeout=timeout)


def _mark(ch: grpc.Channel, rid: int, *, released: bool = False, held: int = 0) -> bytes:
    request = messages.encode_finished(rid, released=released, held=held)
    data: bytes = ch.unary_unary(MARK_RECV_FINISHED)(request, timeout=10)
    return data


@pytest.fixture
def pair(ns: str) -> Iterator[tuple[shmrdv.Worker, shmrdv.Worker]]:
    with (
        shmrdv.Worker(_P, namespace=ns, transports=("grpc",)) as producer,
        shmrdv.Worker(_C, namespace=ns, transports=("grpc",)) as consumer,
    ):
        yield producer, consumer


def _opened(pair: tuple[shmrdv.Worker, shmrdv.Worker], size: int = 64) -> None:
    """The key's series is open: received twice, the second time through it."""
    producer, consumer = pair
    for i in range(2):
        producer.rendezvous(1).send(_key(), _value(i, size))
        _check(consumer.rendezvous(1).recv(_key(), timeout=10).value, i, size)
    assert consumer.stats()["grpc"]["series"] == 1


# -- a key received again, between two Workers --------------------------------------------


def test_a_key_received_again_is_pushed_in_order_over_one_series(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    _opened(pair)
    for i in range(2, 200):
        producer.rendezvous(1).send(_key(), _value(i, 64))
    for i in range(2, 200):
        _check(consumer.rendezvous(1).recv(_key(), timeout=10).value, i, 64)
    stats = producer.stats()["grpc"]
    assert stats["server_series"] == 1 and stats["server_calls"] == 1  # one RecvTensor
    assert stats["server_series_values"] == 199


def test_a_large_value_is_pushed_in_chunks(pair: tuple[shmrdv.Worker, shmrdv.Worker]) -> None:
    producer, consumer = pair
    _opened(pair)
    for i in range(2, 5):
        producer.rendezvous(1).send(_key(), _value(i, 9 << 20))  # three 4 MiB chunks
    for i in range(2, 5):
        _check(consumer.rendezvous(1).recv(_key(), timeout=20).value, i, 9 << 20)


def test_a_receive_that_times_out_on_a_series_loses_nothing(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    _opened(pair)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        consumer.rendezvous(1).recv(_key(), timeout=0.3)
    assert time.monotonic() - t0 < 1.0  # the series' ticks let the reader see its deadline
    producer.rendezvous(1).send(_key(), _value(7, 64))
    _check(consumer.rendezvous(1).recv(_key(), timeout=10).value, 7, 64)


def test_blocking_and_callback_receives_mixed_on_a_series_keep_order(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    """A callback receive with no blocked receiver to read the series for it releases
    the series (what was not read goes back to the key, in order) and goes on with
    RecvTensor; a later blocked receive opens the series again."""
    producer, consumer = pair
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    _opened(pair)
    for i in range(2, 40):
        p.send(_key(), _value(i, 64))
    got = []
    for i in range(2, 40):
        if i % 3:
            got.append(int(c.recv(_key(), timeout=10).value[0]))
        else:
            got.append(int(c.recv_future(_key()).result(timeout=10).value[0]))
    assert got == list(range(2, 40))
    with pytest.raises(DeadlineExceededError):
        c.recv(_key(), timeout=0.3)  # nothing twice


def test_producer_cleanup_fails_a_receive_waiting_on_a_series(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    _opened(pair)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(consumer.rendezvous(1).recv, _key(), timeout=20)
        time.sleep(0.3)
        producer.cleanup(1)
        with pytest.raises(shmrdv.AbortedError, match="Cleanup 1"):
            waiting.result(timeout=10)


@pytest.mark.parametrize("how", ["abort", "close"])
def test_consumer_abort_and_close_end_a_receive_waiting_on_a_series(
    pair: tuple[shmrdv.Worker, shmrdv.Worker], how: str
) -> None:
    _, consumer = pair
    _opened(pair)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(consumer.rendezvous(1).recv, _key(), timeout=20)
        time.sleep(0.3)
        t0 = time.monotonic()
        if how == "abort":
            consumer.rendezvous(1).start_abort(shmrdv.AbortedError("stop"))
        else:
            consumer.close()
        with pytest.raises(shmrdv.AbortedError):
            waiting.result(timeout=10)
        assert time.monotonic() - t0 < 2


def test_a_closing_producer_fails_a_receive_waiting_on_a_series(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    _opened(pair)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(consumer.rendezvous(1).recv, _key(), timeout=20)
        time.sleep(0.3)
        t0 = time.monotonic()
        producer.close()
        with pytest.raises(shmrdv.UnavailableError, match=_P):
            waiting.result(timeout=10)
        assert time.monotonic() - t0 < 3


# -- against a server -------------------------------------------------------------------------


def test_an_idle_series_ends_and_the_next_receive_opens_another(source: StepSource) -> None:
    key = make_key("idle")
    with (
        RpcServer("127.0.0.1:0", source, limits=Limits(series_idle=0.3)) as server,
        RpcClient() as client,
    ):
        for i in range(2):
            source.send(1, key, np.array([i]))
            assert pull(client, server.address, 1, key, timeout=10).value.tolist() == [i]
        wait_for(lambda: server.stats()["series_open"] == 0, timeout=10)  # ended idle
        source.send(1, key, np.array([2]))
        assert pull(client, server.address, 1, key, timeout=10).value.tolist() == [2]
        assert server.stats()["series"] == 2


def test_a_producer_without_series_is_pulled_with_recv_tensor() -> None:
    """TensorFlow's worker (here: a raw server of RecvTensor alone) has no series: the
    key received again goes on with RecvTensor, every time."""
    values = iter(range(10))

    def recv(request: bytes, context: Any) -> bytes:
        return messages.encode_value(np.array([next(values)]), False).chunks[0]

    handler = grpc.method_handlers_generic_handler(
        "tensorflow.WorkerService", {"RecvTensor": grpc.unary_unary_rpc_method_handler(recv)}
    )
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RpcClient() as client:
            key = make_key("tf")
            got = [
                int(pull(client, f"127.0.0.1:{port}", 1, key, timeout=10).value[0])
                for _ in range(5)
            ]
            assert got == list(range(5))
            assert client.stats()["series"] == 0
    finally:
        server.stop(0).wait(5)


def test_series_are_bounded_per_connection(source: StepSource) -> None:
    with (
        RpcServer("127.0.0.1:0", source, limits=Limits(max_series_per_connection=1)) as server,
        RpcClient() as client,
    ):
        keys = [make_key("s0"), make_key("s1")]
        for i in range(4):
            for key in keys:
                source.send(1, key, np.array([i]))
                assert pull(client, server.address, 1, key, timeout=10).value.tolist() == [i]
        stats = server.stats()
        assert stats["series_refused"] >= 1 and stats["series_open"] == 1


def test_a_series_that_is_never_read_holds_the_window(
    windowed: GrpcTransport,  # noqa: F811 (the fixture)
) -> None:
    """A value pushed into a series counts until its consumer acknowledges it: a client
    that opens a series and never reads holds the producer's window, not its memory."""
    assert windowed.address is not None
    key = make_key("series-never-read", incarnation=1)
    hostile = _NeverReads(windowed.address)
    try:
        hostile.call(RECV_TENSOR_SERIES, messages.encode_request(1, key.full_key, 3))
        wait_for(lambda: windowed.stats()["server_series_open"] == 1, timeout=20)
        value = np.zeros(64 << 10, np.uint8)
        for i in range(4):
            windowed.send(1, key, value + i, False, 5.0)
        with pytest.raises(ResourceExhaustedError, match="max_inflight_bytes"):
            windowed.send(1, key, value, False, 0.5)
        assert windowed.stats()["inflight_bytes"] == 256 << 10
    finally:
        hostile.close()
    # Its connection gone, its consumer may still come back for what it was pushed; at
    # its release (or expiry) that goes back to the key, in order.
    wait_for(lambda: windowed.stats()["server_series_open"] == 0, timeout=20)
    with grpc.insecure_channel(windowed.address, CHANNEL_OPTIONS) as ch:
        _mark(ch, 3, released=True)
    with RpcClient() as client:
        for i in range(4):
            got = pull(client, windowed.address, 1, key, timeout=10)
            assert got.value[0] == i


def test_a_series_whose_consumer_never_acknowledges_stops_at_its_bound(
    source: StepSource,
) -> None:
    """A series pushes at most ``max_pushed_bytes`` ahead of its consumer's
    acknowledgement (then it asks, and takes no more); an ack lets the next ones go."""
    key = make_key("never-acks")
    size = 16 << 10
    with (
        RpcServer("127.0.0.1:0", source, limits=Limits(max_pushed_bytes=4 * size)) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        for i in range(20):
            source.send(1, key, np.full(size // 8, i, np.int64))
        call = _series(ch, key, 3, timeout=30)
        asks: list[int] = []
        got = [int(r.value[0]) for r in _read(call, 4, asks)]
        assert got == list(range(4))
        time.sleep(0.3)
        assert server.stats()["series_values"] == 4  # the bound: no more taken
        _mark(ch, 3, held=4)
        got = [int(r.value[0]) for r in _read(call, 4, asks)]
        assert got == list(range(4, 8))
        call.cancel()


def test_a_released_series_gives_back_what_was_not_read_in_order(source: StepSource) -> None:
    key = make_key("back")
    with (
        RpcServer("127.0.0.1:0", source) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        call = _series(ch, key, 9)
        for i in range(5):
            source.send(1, key, np.array([i]))
        assert [int(r.value[0]) for r in _read(call, 2)][:2] == [0, 1]  # (a pack may hold more)
        wait_for(lambda: server.stats()["series_values"] == 5)
        _mark(ch, 9, released=True, held=2)  # it holds two: the other three go back
        with RpcClient() as client:
            got = [int(pull(client, server.address, 1, key, timeout=10).value[0]) for _ in range(3)]
        assert got == [2, 3, 4]
        call.cancel()


def test_a_series_opened_again_gets_what_its_consumer_lacks(source: StepSource) -> None:
    key = make_key("again")
    with (
        RpcServer("127.0.0.1:0", source) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        call = _series(ch, key, 11)
        for i in range(3):
            source.send(1, key, np.array([i]))
        assert [int(r.value[0]) for r in _read(call, 1)][:1] == [0]  # (a pack may hold more)
        wait_for(lambda: server.stats()["series_values"] == 3)
        call.cancel()  # a dropped connection
        wait_for(lambda: server.stats()["series_open"] == 0)
        again = _series(ch, key, 11, held=1)
        assert [int(r.value[0]) for r in _read(again, 2)] == [1, 2]
        again.cancel()


def test_values_sent_faster_than_pushed_go_several_to_a_message(source: StepSource) -> None:
    key = make_key("packed")
    with (
        RpcServer("127.0.0.1:0", source) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        for i in range(10):
            source.send(1, key, np.array([i]))
        call = _series(ch, key, 21)
        message = next(call)
        assembly = messages.Assembly()
        assert assembly.feed(message) is None
        values = [messages.Assembly().feed(part) for part in assembly.packed]
        assert [int(v.value[0]) for v in values if v is not None] == list(range(10))
        assert server.stats()["series_values"] == 10
        call.cancel()


def test_an_ack_for_more_than_was_sent_is_refused(source: StepSource) -> None:
    key = make_key("acked")
    with (
        RpcServer("127.0.0.1:0", source) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        call = _series(ch, key, 5)
        source.send(1, key, np.arange(4))
        _read(call, 1)
        with pytest.raises(grpc.RpcError) as info:
            _mark(ch, 5, held=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _mark(ch, 5, held=1) == b""
        call.cancel()
        assert server.stats()["series_values"] == 1


# -- a dropped connection loses nothing ------------------------------------------------------


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
        self._held_from: set[socket.socket] = set()  # upstream sockets held since hold()
        self.refusing = False  # close each connection at once (the producer unreachable)
        self.held = 0  # bytes from upstream held back since hold()
        self.accepted = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="proxy-accept")]
        self._threads[0].start()

    def hold(self) -> None:
        """Keep what upstream sends on the connections open now (read, not forwarded)
        until the cut."""
        with self._lock:
            self._held_from = set(self._socks)

    def cut(self) -> None:
        """Close both sockets of every connection; what was held is dropped. The holding
        ends only once they are closed: what came after the held bytes is never forwarded
        (TCP drops no middle, a proxy that did would corrupt the stream)."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked on it
            except OSError:
                pass
            s.close()
        with self._lock:
            self._held_from = set()

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
                    if downstream and src in self._held_from:
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
            cluster = {"series": {0: proxy.address}}  # the consumer's way to the producer
            with shmrdv.Worker(_C, cluster=cluster, namespace=ns, transports=("grpc",)) as consumer:
                yield producer, consumer, proxy
        finally:
            proxy.close()


@pytest.mark.parametrize(
    ("size", "n"),
    [(1024, 20), (6 << 20, 3)],
    ids=["small-written-whole", "6m-cut-inside-a-value"],
)
def test_values_in_flight_when_the_connection_drops_come_once_in_order(
    proxied: tuple[shmrdv.Worker, shmrdv.Worker, CutProxy], size: int, n: int
) -> None:
    producer, consumer, proxy = proxied
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):  # the second opens the key's series
        p.send(_key(), _value(i, size), timeout=10)
        _check(c.recv(_key(), timeout=10).value, i, size)
    assert consumer.stats()["grpc"]["series"] == 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.recv, _key(), timeout=20)  # reading the series at the cut
        time.sleep(0.2)
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
    assert consumer.stats()["grpc"]["received"] == 4 + n


def test_a_drop_with_nothing_in_flight_loses_and_repeats_nothing(
    proxied: tuple[shmrdv.Worker, shmrdv.Worker, CutProxy],
) -> None:
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
    producer, consumer, proxy = proxied
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):
        p.send(_key(), _value(i, 1024), timeout=10)
        _check(c.recv(_key(), timeout=10).value, i, 1024)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.recv, _key(), timeout=20)
        time.sleep(0.2)
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


def test_the_window_counts_what_a_series_pushed_until_it_is_acknowledged(ns: str) -> None:
    """With the connection holding what the producer writes, the producer stops at its
    window; after a cut every value it sent arrives, once."""
    window, size = 256 << 10, 16 << 10
    with shmrdv.Worker(
        _P, namespace=ns, transports=("grpc",), max_inflight_bytes=window
    ) as producer:
        assert producer.address is not None
        proxy = CutProxy(producer.address)
        try:
            cluster = {"series": {0: proxy.address}}
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
