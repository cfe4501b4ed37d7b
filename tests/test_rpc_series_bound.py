"""The bounds of a series (RecvTensorSeries), between two real Workers on loopback.

The consumer's series keeps at most ``PREFETCH_BYTES`` of values no receive took, plus
one message (at most ``chunk_bytes`` of data): a value cut into several messages counts
as it comes. The producer keeps at most its ``max_inflight_bytes`` window (a value counts
until it is written to the stream); a send that finds it full waits, then raises
``ResourceExhaustedError``. Measured through ``stats()``: the consumer's
``series_held_bytes`` and ``series_held_peak``, the producer's ``sent`` against what its
server wrote (``server_series_values``, ``server_values_served``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import StepSource, make_key, series_client

import shmrdv
from shmrdv._errors import AbortedError, DeadlineExceededError, ResourceExhaustedError
from shmrdv._rendezvous import RecvSlot
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.methods import DEFAULT_CHUNK_BYTES
from shmrdv._rpc.series_client import PREFETCH_BYTES
from shmrdv._rpc.server import RpcServer

pytestmark = pytest.mark.timeout(60)

source = rpc_helpers.source

_P = "/job:bound/replica:0/task:0"
_C = "/job:bound/replica:0/task:1"
# The most one series may keep: its bound, passed by one message.
_BOUND = PREFETCH_BYTES + DEFAULT_CHUNK_BYTES


def _key() -> str:
    return shmrdv.create_key(_P + "/device:CPU:0", 0, _C + "/device:CPU:0", "channel")


def _value(i: int, size: int) -> npt.NDArray[Any]:
    return np.full(size // 8, i, np.int64)


@contextlib.contextmanager
def _pair(ns: str, window: int) -> Iterator[tuple[shmrdv.Worker, shmrdv.Worker]]:
    with (
        shmrdv.Worker(_P, namespace=ns, transports=("grpc",), max_inflight_bytes=window) as p,
        shmrdv.Worker(_C, namespace=ns, transports=("grpc",)) as c,
    ):
        yield p, c


def _open_series(p: shmrdv.Rendezvous, c: shmrdv.Rendezvous, consumer: shmrdv.Worker) -> None:
    """Values 0 and 1 received: the second opened the key's series."""
    for i in range(2):
        p.send(_key(), _value(i, 1024), timeout=10)
        assert c.recv(_key(), timeout=10).value[0] == i
    assert consumer.stats()["grpc"]["series"] == 1


def _pending(stats: dict[str, int]) -> int:
    """Values the producer holds: sent and not yet written by its server. ``sent`` is
    read before what was written (one ``stats()``), so this never reads high."""
    return stats["sent"] - stats["server_series_values"] - stats["server_values_served"]


def _check(got: npt.NDArray[Any], i: int, size: int) -> None:
    assert got.shape == (size // 8,)
    assert got[0] == got[-1] == i, f"value {i} came as {got[0]}"


@pytest.mark.parametrize(
    "size",
    [256 << 10, 1 << 20, 10 << 20],
    ids=["256k-packed-in-a-message", "1m", "10m-in-three-messages"],
)
def test_a_series_nobody_receives_from_keeps_its_bound_and_stops_the_producer(
    ns: str, size: int
) -> None:
    """Nothing received for a while: the consumer's series fills to its bound and stops
    there (10 MiB values: it held 40 MiB, the bound passed by a whole value, before
    what came of a value being assembled counted); the producer's sends then fill its
    window and fail; once the consumer receives, every value comes in order, once."""
    window = max(4 << 20, 2 * size)
    with _pair(ns, window) as (producer, consumer):
        p, c = producer.rendezvous(1), consumer.rendezvous(1)
        _open_series(p, c, consumer)
        sent = 2
        # At most this many sends fit anywhere (a broken bound lets them all through).
        most = (4 * PREFETCH_BYTES + window) // size
        try:
            while sent < most:
                p.send(_key(), _value(sent, size), timeout=2.0)
                sent += 1
        except ResourceExhaustedError as e:
            assert "max_inflight_bytes" in str(e)
        else:
            pytest.fail(f"{sent} values of {size} bytes went out: nothing held the producer")
        wait_for(
            lambda: consumer.stats()["grpc"]["series_held_bytes"] >= PREFETCH_BYTES, timeout=10
        )
        time.sleep(0.2)  # anything more that came would show now
        held = consumer.stats()["grpc"]
        assert held["received"] == 2  # nothing went to a receive
        assert PREFETCH_BYTES <= held["series_held_bytes"] <= held["series_held_peak"] <= _BOUND
        kept = producer.stats()["grpc"]
        assert kept["inflight_bytes"] <= window
        assert 0 < _pending(kept) * size <= window
        for i in range(2, sent):
            _check(c.recv(_key(), timeout=10).value, i, size)
        with pytest.raises(DeadlineExceededError):
            c.recv(_key(), timeout=0.3)  # nothing twice
        p.send(_key(), _value(sent, size), timeout=5)  # the window came back
        _check(c.recv(_key(), timeout=10).value, sent, size)
        assert consumer.stats()["grpc"]["series_held_peak"] <= _BOUND


def test_a_slow_consumer_holds_its_producer_to_the_window(ns: str) -> None:
    """A consumer slower than its producer: the producer keeps at most its window of
    values not written yet, at every moment it is looked at, and waits for room; the
    consumer's series at most its bound; every value comes, in order."""
    size, window, n = 256 << 10, 2 << 20, 240  # 60 MiB: more than the series and window
    with _pair(ns, window) as (producer, consumer):
        p, c = producer.rendezvous(1), consumer.rendezvous(1)
        _open_series(p, c, consumer)
        most = {"pending": 0, "inflight": 0}
        stop = threading.Event()
        errors: list[BaseException] = []

        def watch() -> None:
            while not stop.is_set():
                kept = producer.stats()["grpc"]
                most["pending"] = max(most["pending"], _pending(kept))
                most["inflight"] = max(most["inflight"], kept["inflight_bytes"])
                stop.wait(0.002)

        def send() -> None:
            try:
                for i in range(2, n):
                    p.send(_key(), _value(i, size), timeout=20)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=watch), threading.Thread(target=send)]
        for t in threads:
            t.start()
        try:
            for i in range(2, n):
                _check(c.recv(_key(), timeout=20).value, i, size)
                time.sleep(0.004)  # slow: ~60 MiB/s
        finally:
            threads[1].join(20)
            stop.set()
            threads[0].join(20)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        with pytest.raises(DeadlineExceededError):
            c.recv(_key(), timeout=0.3)  # nothing twice
        assert 0 < most["pending"] * size <= window
        assert most["inflight"] <= window
        assert producer.stats()["grpc"]["window_waits"] > 0  # it was held back
        assert consumer.stats()["grpc"]["series_held_peak"] <= _BOUND


def test_a_value_larger_than_the_bound_comes_whole_into_an_empty_series(
    source: StepSource,
) -> None:
    """A bound of 256 KiB, values of 1 MiB in 64 KiB messages: the first comes whole
    (what came of it counts, but an empty table has room), then the series stops until
    a receive takes it; each receive gets the next, whole, in order."""
    size, bound = 1 << 20, 256 << 10
    with (
        RpcServer("127.0.0.1:0", source, chunk_bytes=64 << 10) as server,
        RpcClient() as client,
    ):
        series = series_client(client, server.address, prefetch_bytes=bound)
        key = make_key("larger")
        try:
            for i in range(4):
                source.send(1, key, _value(i, size))
            slot = RecvSlot()
            assert series.start_recv(1, key, slot.done, lambda: server.address) is not None
            assert slot.wait(10)
            _check(slot.result().value, 0, size)
            wait_for(lambda: series.stats()["series_held_bytes"] >= size, timeout=10)
            time.sleep(0.2)  # anything more that came would show now
            assert series.stats()["series_held_peak"] == size  # one value, nothing more
            for i in range(1, 4):
                slot = RecvSlot()
                series.start_recv(1, key, slot.done, lambda: server.address)
                assert slot.wait(10)
                _check(slot.result().value, i, size)
            assert series.stats()["series_held_peak"] == size
        finally:
            series.close(AbortedError("end"))
