"""RecvTensorSeries (issue 19 §3, the pipeline): a key received again and again gets its
values pushed by its producer before they are asked for, over one server-streaming call,
against a real server on loopback. Order, deadlines, aborts, closing, the producer's
window, the server's bounds and the fallback to RecvTensor hold as for RecvTensor."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import CHANNEL_OPTIONS, StepSource, make_key, series_client
from test_rpc_hostile_clients import _NeverReads, windowed  # noqa: F401 (a fixture)

import shmrdv
from shmrdv._errors import (
    AbortedError,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from shmrdv._keys import ParsedKey
from shmrdv._rendezvous import Received, RecvSlot
from shmrdv._rpc import assembly, messages, series_wire
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.methods import RECV_TENSOR_SERIES_METHOD
from shmrdv._rpc.proto import rendezvous_pb2
from shmrdv._rpc.series_client import SeriesClient
from shmrdv._rpc.series_service import SeriesLimits
from shmrdv._rpc.server import RpcServer
from shmrdv._rpc.transport import GrpcTransport

pytestmark = pytest.mark.timeout(60)

source = rpc_helpers.source

_P = "/job:series/replica:0/task:0"
_C = "/job:series/replica:0/task:1"


# -- the messages ----------------------------------------------------------------------------


def test_series_messages_are_tensor_chunks_that_reassemble() -> None:
    values = [
        Received(np.arange(10, dtype=np.float32)),
        Received(np.zeros((0, 3), np.int64)),
        Received(np.arange(3000, dtype=">i4").reshape(30, 100), is_dead=True),
        Received(np.array(7.5)),
    ]
    out = list(series_wire.encode_series(values, 4096))  # the 12 KB one in chunks
    assert sum(done for _, done in out) == len(values)
    assert len(out) >= 3
    got: list[Received] = []
    assembler = None
    for message, _ in out:
        parsed = rendezvous_pb2.TensorChunks.FromString(message)  # protobuf agrees
        chunks = list(series_wire.series_chunks(message))
        assert [bytes(c) for c in chunks] == [c.SerializeToString() for c in parsed.chunks]
        for chunk in chunks:
            assembler = assembler or assembly.StreamAssembler()
            assembler.feed(chunk)
            if assembler.complete:
                got.append(Received(assembler.result(), assembler.is_dead))
                assembler = None
    for want, have in zip(values, got, strict=True):
        assert have.value.dtype == want.value.dtype and have.is_dead == want.is_dead
        np.testing.assert_array_equal(have.value, want.value)


@pytest.mark.parametrize(
    "value",
    [
        np.arange(10, dtype=np.float32).reshape(2, 5),
        np.array(7.5),
        np.array([True, False, True]),
        np.arange(12, dtype=np.complex64).reshape(3, 1, 4),
        np.arange(5, dtype=np.uint16),
    ],
    ids=lambda a: f"{a.dtype}{a.shape}",
)
@pytest.mark.parametrize("is_dead", [False, True])
def test_a_whole_value_chunk_is_read_in_one_pass_as_the_assembler_reads_it(
    value: np.ndarray, is_dead: bool
) -> None:
    ((message, _),) = series_wire.encode_series([Received(value, is_dead)], 1 << 20)
    (chunk,) = series_wire.series_chunks(message)
    whole = assembly.whole_tensor(chunk)
    assert whole is not None
    assembler = assembly.StreamAssembler()
    assembler.feed(chunk)
    got, dead = whole
    want = assembler.result()
    assert dead == is_dead == assembler.is_dead
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert got.flags.writeable and got.flags.owndata  # the one copy, the receiver's own


def test_whole_tensor_leaves_every_other_chunk_to_the_assembler() -> None:
    big = [m for m, _ in series_wire.encode_series([Received(np.arange(5000))], 4096)]
    first = next(series_wire.series_chunks(big[0]))
    later = next(series_wire.series_chunks(big[1]))
    strings = series_wire.encode_series([Received(np.array(["a", "bc"]))], 1 << 20)
    ((swapped, _),) = series_wire.encode_series([Received(np.ones(3, ">f4"))], 1 << 20)
    empty = series_wire.encode_series([Received(np.zeros((0, 3)))], 1 << 20)
    for chunk in (
        first,  # a header with part of the data
        later,  # data without a header
        next(series_wire.series_chunks(next(iter(strings))[0])),
        next(series_wire.series_chunks(swapped)),  # converted on arrival (not big-endian here)
        next(series_wire.series_chunks(next(iter(empty))[0])),
        memoryview(b"\x0a\x02\x08\x01\x1a\x04abc"),  # data shorter than it says
        memoryview(b"\x0a\xff\x01"),
    ):
        assert assembly.whole_tensor(chunk) is None


def test_series_limits_refuse_bad_values() -> None:
    with pytest.raises(InvalidArgumentError, match="max_series_per_peer"):
        SeriesLimits(max_series_per_peer=0)
    with pytest.raises(InvalidArgumentError, match="idle"):
        SeriesLimits(idle=-1)


def test_series_chunks_refuse_bytes_that_do_not_parse() -> None:
    with pytest.raises(InvalidArgumentError, match="RecvTensorSeries"):
        list(series_wire.series_chunks(b"\x0a\xff\x01"))


# -- two Workers: a channel key ------------------------------------------------------------


def _key() -> str:
    return shmrdv.create_key(_P + "/device:CPU:0", 0, _C + "/device:CPU:0", "channel")


@pytest.fixture
def pair(ns: str) -> Iterator[tuple[shmrdv.Worker, shmrdv.Worker]]:
    with (
        shmrdv.Worker(_P, namespace=ns, transports=("grpc",)) as producer,
        shmrdv.Worker(_C, namespace=ns, transports=("grpc",)) as consumer,
    ):
        yield producer, consumer


def test_a_channel_key_is_pushed_in_order_over_one_series(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    """Before: one RecvTensor per value (a round trip each, ~1,200 values/s)."""
    producer, consumer = pair
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    n = 300

    def send() -> None:
        for i in range(n):
            p.send(_key(), np.full(1000, i, np.int32))

    t = threading.Thread(target=send)
    t.start()
    got = [int(c.recv(_key(), timeout=20).value[0]) for _ in range(n)]
    t.join(10)
    assert got == list(range(n))
    server = producer.stats()["grpc"]
    assert server["server_series"] == 1
    wait_for(lambda: producer.stats()["grpc"]["server_series_values"] == n - 1, timeout=10)
    assert server["server_values_served"] == 1  # the first, by RecvTensor
    assert consumer.stats()["grpc"]["received"] == n


def test_a_receive_that_times_out_on_a_series_loses_nothing(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):
        p.send(_key(), np.array([i]))
        assert c.recv(_key(), timeout=10).value.tolist() == [i]
    assert consumer.stats()["grpc"]["series"] == 1
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        c.recv(_key(), timeout=0.3)
    assert time.monotonic() - t0 < 5
    p.send(_key(), np.array([2]))
    p.send(_key(), np.array([3]))
    assert [c.recv(_key(), timeout=10).value.tolist() for _ in range(2)] == [[2], [3]]


def test_a_callback_receive_on_a_series_runs_off_its_reader(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    """A callback that blocks (here: receives the key's next value) must not hold up the
    series' reader, which is the thread that brings that value."""
    producer, consumer = pair
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):
        p.send(_key(), np.array([i]))
        c.recv(_key(), timeout=10)
    seen: list[object] = []
    finished = threading.Event()

    def done(error: BaseException | None, received: Received | None) -> None:
        assert received is not None
        seen.append((threading.current_thread().name, int(received.value[0])))
        seen.append(int(c.recv(_key(), timeout=10).value[0]))
        finished.set()

    c.recv_async(_key(), done)
    p.send(_key(), np.array([2]))
    p.send(_key(), np.array([3]))
    assert finished.wait(20)
    assert seen == [("shmrdv-rpc-done", 2), 3]


def test_producer_cleanup_fails_a_receive_waiting_on_a_series(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):
        p.send(_key(), np.array([i]))
        c.recv(_key(), timeout=10)
    threading.Timer(0.3, producer.cleanup, (1,)).start()
    t0 = time.monotonic()
    with pytest.raises(AbortedError):
        c.recv(_key(), timeout=20)
    assert time.monotonic() - t0 < 10


def test_consumer_abort_and_close_end_a_receive_waiting_on_a_series(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    producer, consumer = pair
    for step in (1, 2):
        p, c = producer.rendezvous(step), consumer.rendezvous(step)
        for i in range(2):
            p.send(_key(), np.array([i]))
            c.recv(_key(), timeout=10)
    threading.Timer(0.3, consumer.rendezvous(1).start_abort, (AbortedError("stop"),)).start()
    with pytest.raises(AbortedError, match="stop"):
        consumer.rendezvous(1).recv(_key(), timeout=20)
    threading.Timer(0.3, consumer.close).start()
    t0 = time.monotonic()
    with pytest.raises(shmrdv.RendezvousError):
        consumer.rendezvous(2).recv(_key(), timeout=20)
    assert time.monotonic() - t0 < 10


def test_a_closing_producer_fails_a_receive_waiting_on_a_series(ns: str) -> None:
    with shmrdv.Worker(_C, namespace=ns, transports=("grpc",)) as consumer:
        producer = shmrdv.Worker(_P, namespace=ns, transports=("grpc",))
        try:
            p, c = producer.rendezvous(1), consumer.rendezvous(1)
            for i in range(2):
                p.send(_key(), np.array([i]))
                c.recv(_key(), timeout=10)
            threading.Timer(0.3, producer.close).start()
            t0 = time.monotonic()
            with pytest.raises(UnavailableError):
                c.recv(_key(), timeout=20)
            assert time.monotonic() - t0 < 10
        finally:
            producer.close()


# -- the producer's side against hostile or broken clients ----------------------------------


def test_a_series_that_is_never_read_holds_the_window(
    windowed: GrpcTransport,  # noqa: F811 (the fixture)
) -> None:
    """A value pushed into a series counts until gRPC has taken all of it: a client that
    opens a series and never reads holds the producer's window, not its memory."""
    assert windowed.address is not None
    key = make_key("series-never-read", incarnation=1)
    hostile = _NeverReads(windowed.address)
    try:
        hostile.call(RECV_TENSOR_SERIES_METHOD, messages.encode_request(1, key.full_key, 0))
        wait_for(lambda: windowed.stats()["server_series_open"] == 1, timeout=20)
        value = np.zeros(64 << 10, np.uint8)
        for i in range(4):
            windowed.send(1, key, value + i, False, 5.0)
        with pytest.raises(ResourceExhaustedError, match="max_inflight_bytes"):
            windowed.send(1, key, value, False, 0.5)
        assert windowed.stats()["inflight_bytes"] == 256 << 10
    finally:
        hostile.close()
    # Its connection gone, what it took went back to the key: a real receive gets them.
    wait_for(lambda: windowed.stats()["server_series_open"] == 0, timeout=20)
    with RpcClient() as client:
        for i in range(4):
            got = rpc_helpers.pull(client, windowed.address, 1, key, timeout=10)
            assert got.value[0] == i


def test_series_are_bounded_per_connection(source: StepSource) -> None:
    with (
        RpcServer(
            "127.0.0.1:0", source, series=SeriesLimits(max_series_per_connection=2)
        ) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        series = ch.unary_stream(RECV_TENSOR_SERIES_METHOD)
        calls = []
        for i in range(3):  # one at a time: the server may start calls in any order
            calls.append(
                series(messages.encode_request(1, make_key(f"s{i}").full_key, 0), timeout=30)
            )
            wait_for(lambda: server.stats()["series"] == len(calls), timeout=20)
        with pytest.raises(grpc.RpcError) as info:
            next(calls[2])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_series_per_connection=2" in (info.value.details() or "")
        source.send(1, make_key("s0"), np.array([5]))
        chunk = next(series_wire.series_chunks(next(calls[0])))
        assembler = assembly.StreamAssembler()
        assembler.feed(chunk)
        assert assembler.result().tolist() == [5]
        for call in calls[:2]:
            call.cancel()
        wait_for(lambda: server.stats()["series_open"] == 0, timeout=20)


# -- the consumer's side: fallback and idle ends -------------------------------------------


def _recv(sc: SeriesClient, client: RpcClient, address: str, key: ParsedKey) -> Received:
    slot = RecvSlot()
    if sc.start_recv(1, key, slot.done, lambda: address) is None:
        client.start_recv(address, 1, key, slot.done)
    slot.wait(20)
    assert slot.filled
    return slot.result()


def test_a_producer_without_series_is_pulled_with_recv_tensor(source: StepSource) -> None:
    """A TensorFlow worker (or an older shmrdv) has no RecvTensorSeries: UNIMPLEMENTED,
    and the receives waiting on the series go by RecvTensor, in order."""
    from concurrent.futures import ThreadPoolExecutor

    def recv_tensor(request: bytes, context: grpc.ServicerContext) -> bytes:
        req = messages.decode_request(request)
        slot = RecvSlot()
        source.serve_recv(req.step_id, make_key("tf"), slot.done)
        slot.wait(20)
        return messages.encode_response(slot.result().value, is_dead=False)

    tf = grpc.server(ThreadPoolExecutor(4))
    tf.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "tensorflow.WorkerService",
                {"RecvTensor": grpc.unary_unary_rpc_method_handler(recv_tensor)},
            ),
        )
    )
    port = tf.add_insecure_port("127.0.0.1:0")
    tf.start()
    address = f"127.0.0.1:{port}"
    key = make_key("tf")
    try:
        with RpcClient() as client:
            sc = series_client(client, address)
            for i in range(4):
                source.send(1, key, np.array([i]))
            got = [_recv(sc, client, address, key).value.tolist() for _ in range(4)]
            assert got == [[0], [1], [2], [3]]
            assert sc.stats()["series"] == 0  # the address is known to have none
            sc.close(AbortedError("end"))
    finally:
        tf.stop(0).wait(5)


def test_an_idle_series_ends_and_a_waiting_receive_opens_another(source: StepSource) -> None:
    with (
        RpcServer("127.0.0.1:0", source, series=SeriesLimits(idle=0.2)) as server,
        RpcClient() as client,
    ):
        sc = series_client(client, server.address)
        key = make_key("idle")
        for i in range(2):
            source.send(1, key, np.array([i]))
            assert _recv(sc, client, server.address, key).value.tolist() == [i]
        slot = RecvSlot()
        assert sc.start_recv(1, key, slot.done, lambda: server.address) is not None
        time.sleep(1.0)  # several idle ends meanwhile
        assert server.stats()["series"] >= 3
        source.send(1, key, np.array([9]))
        slot.wait(20)
        assert slot.result().value.tolist() == [9]
        sc.close(AbortedError("end"))


def test_a_series_whose_values_come_within_idle_lives_on_past_idle(source: StepSource) -> None:
    """One idle timer per series: the one set for an earlier wait, when it fires, sets
    itself again for the wait then in progress, which it does not end early."""
    with (
        RpcServer("127.0.0.1:0", source, series=SeriesLimits(idle=1.0)) as server,
        RpcClient() as client,
    ):
        sc = series_client(client, server.address)
        key = make_key("lives")
        started = time.monotonic()
        for i in range(6):
            if i:
                time.sleep(0.4)  # each wait 0.4 s, all of them 2 s: more than idle
            source.send(1, key, np.array([i]))
            assert _recv(sc, client, server.address, key).value.tolist() == [i]
        assert time.monotonic() - started > 1.5
        assert server.stats()["series"] == 1
        sc.close(AbortedError("end"))


def test_a_series_to_a_producer_not_listening_hands_its_receive_to_recv_tensor(
    source: StepSource,
) -> None:
    """Nothing listening (a producer not up yet, or restarting): the series fails before
    any value, so its receive goes to RecvTensor, which retries (it did fail at once)."""
    with RpcServer("127.0.0.1:0", source) as server:
        address = server.address  # then nothing listens there
    client = RpcClient()
    sc = series_client(client, address)
    key = make_key("nobody")
    slot = RecvSlot()
    assert sc.start_recv(1, key, slot.done, lambda: address) is not None
    wait_for(lambda: client.stats()["inflight"] == 1, timeout=20)  # RecvTensor retries
    time.sleep(0.5)
    assert not slot.filled
    sc.close(AbortedError("end"))
    client.close()
    assert slot.filled
    with pytest.raises(shmrdv.CancelledError):
        slot.result()


def test_a_series_without_a_channel_hands_its_receives_to_recv_tensor(
    source: StepSource,
) -> None:
    """The series' reader thread looks up its channel (the receive that opens it does not
    wait for that): an address no channel can be made for (here one with no port) ends
    the series before any call, and its receives go to RecvTensor, in order."""
    with RpcServer("127.0.0.1:0", source) as server, RpcClient() as client:
        sc = series_client(client, server.address)  # RecvTensor pulls from the server
        key = make_key("no-channel")
        slots = [RecvSlot(), RecvSlot()]
        # The first opens the series (its reader ends it at once); the second waits on it,
        # or, once it has ended, goes to RecvTensor as the transport sends it (None).
        assert sc.start_recv(1, key, slots[0].done, lambda: "no-port-here") is not None
        if sc.start_recv(1, key, slots[1].done, lambda: "no-port-here") is None:
            client.start_recv(server.address, 1, key, slots[1].done)
        for i in range(2):
            source.send(1, key, np.array([i]))
        for i, slot in enumerate(slots):
            slot.wait(20)
            assert slot.filled
            assert slot.result().value.tolist() == [i]
        assert server.stats()["series"] == 0  # no series call was made
        sc.close(AbortedError("end"))


def test_a_series_needs_the_token(source: StepSource) -> None:
    token = "series-" + "t" * 24
    key = make_key("secret")
    with RpcServer("127.0.0.1:0", source, token=token) as server:
        with grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch:
            series = ch.unary_stream(RECV_TENSOR_SERIES_METHOD)
            call = series(messages.encode_request(1, key.full_key, 0), timeout=10)
            with pytest.raises(grpc.RpcError) as info:
                next(call)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with RpcClient(token=token) as client:
            sc = series_client(client, server.address)
            for i in range(3):
                source.send(1, key, np.array([i]))
                assert _recv(sc, client, server.address, key).value.tolist() == [i]
            wait_for(lambda: server.stats()["series_values"] >= 1, timeout=10)
            sc.close(AbortedError("end"))


def test_blocking_and_callback_receives_mixed_on_a_series_keep_order(
    pair: tuple[shmrdv.Worker, shmrdv.Worker],
) -> None:
    """Values already sent go to the receives in the order they were made, whichever
    flavour each is (a blocked ``recv``, a future, a callback) and whichever thread
    delivers them: none lost, none out of order."""
    producer, consumer = pair
    p, c = producer.rendezvous(1), consumer.rendezvous(1)
    for i in range(2):  # the second opens the series
        p.send(_key(), np.array([i]))
        assert c.recv(_key(), timeout=10).value.tolist() == [i]
    n = 60  # steps; every fourth makes two receives (a future, then a recv)
    total = n + n // 4
    got: list[tuple[int, int]] = []  # (receive's index, value)
    lock = threading.Lock()
    callbacks = threading.Semaphore(0)

    def later() -> None:
        time.sleep(0.05)
        for i in range(2, 2 + total):
            p.send(_key(), np.full(256 if i % 3 else 20000, i, np.int32))

    def note(index: int) -> shmrdv.DoneCallback:
        def done(error: BaseException | None, received: Received | None) -> None:
            assert error is None and received is not None
            with lock:
                got.append((index, int(received.value[0])))
            callbacks.release()

        return done

    sender = threading.Thread(target=later)
    sender.start()
    futures = []
    asyncs = 0
    for index in range(n):
        kind = index % 4
        if kind == 0:
            value = int(c.recv(_key(), timeout=20).value[0])
            with lock:
                got.append((index, value))
        elif kind == 1:
            futures.append((index, c.recv_future(_key())))
        elif kind == 2:
            c.recv_async(_key(), note(index))
            asyncs += 1
        else:
            futures.append((index, c.recv_future(_key())))
            value = int(c.recv(_key(), timeout=20).value[0])
            with lock:
                got.append((index + 1000, value))
    sender.join(20)
    for index, fut in futures:
        got.append((index, int(fut.result(timeout=20).value[0])))
    for _ in range(asyncs):
        assert callbacks.acquire(timeout=20)
    assert sorted(value for _, value in got) == list(range(2, 2 + total))
    # Each receive got the value of its place in line: receives made in the order of
    # their indices (a kind-3 step makes the future, then the recv).
    order: list[int] = []
    for index in range(n):
        order.append(index)
        if index % 4 == 3:
            order.append(index + 1000)
    by_index = dict(got)
    assert [by_index[i] for i in order] == list(range(2, 2 + total))


def _fake_series_server(messages_out: list[bytes]) -> tuple[grpc.Server, str]:
    """A server whose RecvTensorSeries yields ``messages_out`` and ends."""
    from concurrent.futures import ThreadPoolExecutor

    def series(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from messages_out

    server = grpc.server(ThreadPoolExecutor(2))
    service, method = RECV_TENSOR_SERIES_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                service, {method: grpc.unary_stream_rpc_method_handler(series)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("what", "error"),
    [("garbage", "bad RecvTensorSeries"), ("cut", "ended inside a value")],
)
def test_a_producer_sending_a_bad_series_fails_the_waiting_receives(what: str, error: str) -> None:
    """A value that does not parse, or a series that ends inside one: the receives
    waiting on it fail with an ``InternalError`` naming the key, the producer and what
    was wrong, and the value received before is still there (taken first)."""
    key = make_key("bad")
    good = next(iter(series_wire.encode_series([Received(np.arange(3))], 1 << 20)))[0]
    if what == "garbage":
        bad = [b"\x0a\xff\x01"]
    else:
        bad = [m for m, _ in series_wire.encode_series([Received(np.arange(5000))], 4096)][:1]
    server, address = _fake_series_server([good, *bad])
    try:
        with RpcClient() as client:
            sc = series_client(client, address)
            first, second = RecvSlot(), RecvSlot()
            assert sc.start_recv(1, key, first.done, lambda: address) is not None
            assert sc.start_recv(1, key, second.done, lambda: address) is not None
            assert first.wait(20) and second.wait(20)
            assert first.result().value.tolist() == [0, 1, 2]
            with pytest.raises(shmrdv.InternalError, match=error) as info:
                second.result()
            assert address in str(info.value) and key.full_key in str(info.value)
            sc.close(AbortedError("end"))
    finally:
        server.stop(0).wait(5)
