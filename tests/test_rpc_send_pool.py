"""The producer's copies for other hosts in reused memory: equal to the value, read-only,
never reused while the copy or a view of it lives, bounded, and sent as a plain copy is."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from shmrdv._cluster import Peers
from shmrdv._keys import DeviceName, parse_key
from shmrdv._rendezvous import Received
from shmrdv._rpc import series_wire
from shmrdv._rpc.outbox import Outbox
from shmrdv._rpc.send_pool import MIN_BYTES, SendPool
from shmrdv._shm.transport import ShmBoard
from shmrdv._transport import TransportContext
from tests.helpers import PRODUCER, make_key

KIB64 = 64 << 10


def _address(a: npt.NDArray[Any]) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.mark.parametrize(
    "value",
    [
        np.arange(KIB64 // 4, dtype=np.float32).reshape(128, 128),
        np.arange(KIB64, dtype=np.int64)[::2],  # not contiguous
        np.arange(KIB64 // 8, dtype=">f8"),  # not native
        np.ones((3, 5000, 3), np.complex64),  # not a multiple of a page
        np.ones(5000, [("x", "<f8"), ("y", "<i4")]),  # a dtype the interface cannot name
    ],
    ids=["f32", "strided", "big-endian", "complex", "structured"],
)
def test_send_pool_copy_is_a_read_only_equal_copy(value: npt.NDArray[Any]) -> None:
    pool = SendPool(1 << 20)
    copy = pool.copy(value)
    assert copy is not None
    assert copy.dtype == value.dtype and copy.shape == value.shape
    np.testing.assert_array_equal(copy, value)
    assert copy.flags.c_contiguous and not copy.flags.writeable
    assert not np.shares_memory(copy, value)


def test_send_pool_reuses_a_block_only_once_the_copy_and_its_views_are_gone() -> None:
    pool = SendPool(1 << 20)
    value = np.ones(KIB64, np.uint8)
    first = pool.copy(value)
    assert first is not None
    where = _address(first)
    again = pool.copy(value)  # the first lives: a new block
    assert again is not None and _address(again) != where
    del again
    view = first[10:20]
    del first
    second = pool.copy(value)  # a view of the first lives: a new block
    assert second is not None and _address(second) != where
    np.testing.assert_array_equal(view, 1)
    del view
    third = pool.copy(np.full(KIB64, 7, np.uint8))  # now the first's block comes back
    assert third is not None and _address(third) == where
    np.testing.assert_array_equal(third, 7)
    assert pool.stats()["send_pool_reused"] == 2
    assert pool.stats()["send_pool_made"] == 2


def test_send_pool_keeps_at_most_its_bound_and_pushes_out_the_stalest_size() -> None:
    pool = SendPool(4 * KIB64)
    small = [pool.copy(np.zeros(KIB64, np.uint8)) for _ in range(3)]
    del small
    assert pool.stats()["send_pool_free_bytes"] == 3 * KIB64
    big = pool.copy(np.zeros(2 * KIB64, np.uint8))
    del big  # 5 blocks' worth: one of the stalest size goes
    assert pool.stats()["send_pool_free_bytes"] == 4 * KIB64
    again = pool.copy(np.zeros(2 * KIB64, np.uint8))
    assert again is not None and pool.stats()["send_pool_reused"] == 1


def test_send_pool_declines_what_it_does_not_pool() -> None:
    pool = SendPool(1 << 20)
    assert pool.copy(np.zeros(MIN_BYTES - 1, np.uint8)) is None
    assert pool.copy(np.zeros((1 << 20) + 1, np.uint8)) is None
    assert pool.copy(np.empty(MIN_BYTES, object)) is None
    pool.close()
    assert pool.copy(np.zeros(KIB64, np.uint8)) is None
    assert pool.stats()["send_pool_free_bytes"] == 0


def test_send_pool_block_freed_in_a_collection_comes_back() -> None:
    pool = SendPool(1 << 20)
    copy = pool.copy(np.zeros(KIB64, np.uint8))
    cycle: list[Any] = [copy]
    cycle.append(cycle)
    del copy, cycle
    gc.collect()
    assert pool.stats()["send_pool_free_bytes"] == KIB64


def test_send_pool_copy_is_sent_as_a_plain_copy_is() -> None:
    pool = SendPool(16 << 20)
    for value in (np.arange(KIB64, dtype=np.float32), np.arange(3 << 20, dtype=np.int16)):
        copy = pool.copy(value)
        assert copy is not None
        for budget in (4 << 20, 100_000):
            sent = list(series_wire.encode_series([Received(copy, False)], budget))
            plain = list(series_wire.encode_series([Received(value.copy(), False)], budget))
            assert sent == plain


@pytest.fixture
def outbox(ns: str) -> Iterator[Outbox]:
    peers = Peers(ShmBoard(ns), None)
    ctx = TransportContext(
        task=DeviceName.parse(PRODUCER),
        task_name=PRODUCER,
        incarnation=1,
        namespace=ns,
        peers=peers,
        cleaned_up=lambda step: False,
        max_inflight_bytes=1 << 20,
    )
    box = Outbox(ctx)
    yield box
    box.close()
    peers.close()


def test_outbox_sends_in_the_memory_of_a_copy_already_written(outbox: Outbox) -> None:
    pk = parse_key(make_key("pool"))
    src = np.arange(KIB64 // 4, dtype=np.float32)
    got: list[Received] = []
    for i in range(3):
        src[0] = i
        outbox.send(1, pk, src, False, None)
        outbox.serve_recv(1, pk, lambda error, received: got.append(received))  # type: ignore[arg-type]
        value = got.pop().value
        assert value[0] == i and not value.flags.writeable
        np.testing.assert_array_equal(value[1:], src[1:])
        outbox.done_with(1, pk, value.nbytes)
        del value  # written: its memory serves the next send
    stats = outbox.stats()
    assert stats["send_pool_made"] == 1 and stats["send_pool_reused"] == 2
    outbox.close()
    assert outbox.stats()["send_pool_free_bytes"] == 0
