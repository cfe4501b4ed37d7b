"""The conformance checks of what arrives: values and their order, per key and across
keys, and what a transport must refuse.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import InvalidArgumentError
from .pair import EXPIRE_S, PROMPT_S, SETTLE_S, WAIT_S, RendezvousPair
from .tools import (
    expect_nothing,
    expect_timeout,
    new_key,
    recv_now,
    spawn,
)
from .values import assert_same, expect, sample_values

__all__ = [
    "check_copy_true",
    "check_dtypes_round_trip",
    "check_fifo_channel",
    "check_is_dead_travels",
    "check_large_value",
    "check_many_keys_interleaved",
    "check_object_array_refused",
    "check_plain_subclasses_arrive",
    "check_recv_after_send",
    "check_recv_before_send",
    "check_recv_timeout_removes_waiter",
    "check_state_losing_subclass_refused",
    "check_waiters_fifo",
]


def check_recv_after_send(pair: RendezvousPair) -> None:
    """A value sent before anyone waits is queued and handed to the next recv."""
    key = new_key(pair, "after")
    sent = np.arange(10, dtype=np.float32)
    pair.producer.send(key, sent)
    pair.settle()
    got = recv_now(pair, key)
    expect(got.is_dead is False, f"is_dead should be False, got {got.is_dead!r}")
    assert_same(got.value, sent)
    expect_nothing(pair, key, "one send, one recv")


def check_recv_before_send(pair: RendezvousPair) -> None:
    """A receive waiting before the send (blocked thread, or a future) gets the value."""
    key = new_key(pair, "before_thread")
    sent = np.arange(6, dtype=np.int64).reshape(2, 3)
    blocked = spawn(lambda: pair.consumer.recv(key, timeout=WAIT_S))
    time.sleep(SETTLE_S)
    pair.producer.send(key, sent)
    assert_same(blocked.result(WAIT_S + PROMPT_S).value, sent, "blocked recv")

    key = new_key(pair, "before_future")
    fut = pair.consumer.recv_future(key)
    pair.producer.send(key, sent + 1)
    assert_same(fut.result(WAIT_S).value, sent + 1, "recv_future")


def check_fifo_channel(pair: RendezvousPair) -> None:
    """Several sends of one key form a FIFO channel: each recv takes the oldest."""
    key = new_key(pair, "fifo")
    sent = [np.full(4, i, dtype=np.int32) for i in range(8)]
    for value in sent:
        pair.producer.send(key, value)
    pair.settle()
    for i, value in enumerate(sent):
        assert_same(recv_now(pair, key).value, value, f"recv #{i} of one key")
    expect_nothing(pair, key, "8 sends, 8 recvs")


def check_waiters_fifo(pair: RendezvousPair) -> None:
    """Several receivers waiting on one key are served in the order they started."""
    key = new_key(pair, "waiters")
    futures = [pair.consumer.recv_future(key) for _ in range(4)]
    for i in range(4):
        pair.producer.send(key, np.array([i], dtype=np.int16))
    for i, fut in enumerate(futures):
        assert_same(fut.result(WAIT_S).value, np.array([i], dtype=np.int16), f"waiter #{i}")


def check_many_keys_interleaved(pair: RendezvousPair) -> None:
    """Sends to many keys, interleaved, stay apart and in order per key."""
    keys = [new_key(pair, f"many{k}") for k in range(16)]
    for seq in range(3):
        for k, key in enumerate(keys):
            pair.producer.send(key, np.array([k, seq], dtype=np.int64))
    pair.settle()
    for k in reversed(range(len(keys))):  # another order than the sends'
        for seq in range(3):
            got = recv_now(pair, keys[k]).value
            assert_same(got, np.array([k, seq], dtype=np.int64), f"key #{k} recv #{seq}")


def check_is_dead_travels(pair: RendezvousPair) -> None:
    """``is_dead`` reaches the receiver with the value, and does not stick to the key."""
    key = new_key(pair, "dead")
    sent = np.arange(5, dtype=np.float64)
    pair.producer.send(key, sent, is_dead=True)
    pair.producer.send(key, sent * 2)
    pair.settle()
    dead = recv_now(pair, key)
    expect(dead.is_dead is True, f"first recv: is_dead should be True, got {dead.is_dead!r}")
    assert_same(dead.value, sent, "dead value")
    live = recv_now(pair, key)
    expect(live.is_dead is False, f"second recv: is_dead should be False, got {live.is_dead!r}")
    assert_same(live.value, sent * 2, "live value")


def check_dtypes_round_trip(pair: RendezvousPair) -> None:
    """Every supported kind of value comes out with the same dtype, shape and bytes."""
    values = sample_values()
    keys = {name: new_key(pair, f"dtype_{name}") for name in values}
    for name, value in values.items():
        pair.producer.send(keys[name], value)
    pair.settle()
    for name, value in values.items():
        assert_same(recv_now(pair, keys[name]).value, value, name)


def check_recv_timeout_removes_waiter(pair: RendezvousPair) -> None:
    """An expired recv raises DeadlineExceededError and removes its waiter.

    The next recv gets the next send. (TensorFlow leaves the timed-out waiter queued, and
    it swallows the next send.)
    """
    key = new_key(pair, "timeout")
    expect_timeout(lambda: pair.consumer.recv(key, timeout=EXPIRE_S), "recv(timeout)")
    expect_timeout(lambda: pair.consumer.recv(key, timeout=0), "recv(timeout=0)")
    sent = np.array([42], dtype=np.uint8)
    pair.producer.send(key, sent)
    pair.settle()
    assert_same(recv_now(pair, key).value, sent, "send after a timed-out recv")


def check_object_array_refused(pair: RendezvousPair) -> None:
    """Arrays of Python objects are refused by send (InvalidArgumentError); nothing is queued."""
    key = new_key(pair, "object")
    refused = {
        "object": np.array([1, "two", None], dtype=object),
        "structured with an object field": np.array([(1, "x")], dtype=[("a", "<i4"), ("b", "O")]),
    }
    for what, value in refused.items():
        try:
            pair.producer.send(key, value)
        except InvalidArgumentError as e:
            expect(isinstance(e, ValueError), "InvalidArgumentError should be a ValueError")
        else:
            raise AssertionError(f"send of an {what} array was accepted")
    expect_nothing(pair, key, "refused sends")


def check_state_losing_subclass_refused(pair: RendezvousPair) -> None:
    """A masked array is refused by send (InvalidArgumentError naming the mask); nothing is
    queued: only its data would travel, and the receiver would lose the mask silently."""
    key = new_key(pair, "masked")
    masked = np.ma.masked_array(np.arange(4.0), mask=[False, True, False, True])
    try:
        pair.producer.send(key, masked)
    except InvalidArgumentError as e:
        expect("mask" in str(e), f"the refusal of a masked array does not name the mask: {e}")
    else:
        raise AssertionError("send of a numpy.ma.MaskedArray was accepted")
    expect_nothing(pair, key, "a refused masked array")


def check_plain_subclasses_arrive(pair: RendezvousPair) -> None:
    """Memory-mapped arrays, matrices and record arrays hold all their values in their bytes:
    each arrives as a plain ndarray of the same dtype, shape and values."""
    import tempfile

    with tempfile.TemporaryFile() as f:
        mapped = np.memmap(f, dtype=np.float32, mode="w+", shape=(3, 5))
        mapped[:] = np.arange(15, dtype=np.float32).reshape(3, 5)
        sent: dict[str, npt.NDArray[Any]] = {
            "memmap": mapped,
            "memmap slice": mapped[1:, ::2],
            # A view: np.matrix() itself warns (PendingDeprecationWarning).
            "matrix": np.arange(4, dtype=np.int16).reshape(2, 2).view(np.matrix),
            "recarray": np.rec.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
        }
        for what, value in sent.items():
            key = new_key(pair, f"subclass-{what}")
            pair.producer.send(key, value)
            pair.settle()
            got = recv_now(pair, key).value
            expect(type(got) is np.ndarray, f"a {what} arrived as {type(got).__name__}")
            assert_same(got, np.asarray(value), what)
        del mapped


def check_copy_true(pair: RendezvousPair) -> None:
    """``copy=True`` gives a writable array of its own, equal to what was sent."""
    key = new_key(pair, "copy")
    sent = np.arange(16, dtype=np.int64)
    for _ in range(3):
        pair.producer.send(key, sent)
    pair.settle()
    a = recv_now(pair, key, copy=True).value
    b = recv_now(pair, key, copy=True).value
    c = pair.consumer.recv_future(key, copy=True).result(WAIT_S).value
    for name, arr in (("recv", a), ("recv (2nd)", b), ("recv_future", c)):
        assert_same(arr, sent, f"{name}(copy=True)")
        expect(arr.flags.writeable, f"{name}(copy=True) returned a read-only array")
        expect(not np.shares_memory(arr, sent), f"{name}(copy=True) shares the sent array")
    expect(not np.shares_memory(a, b), "two copy=True receives share memory")
    a[:] = -1
    assert_same(b, sent, "a copy after writing to another")
    assert_same(sent, np.arange(16, dtype=np.int64), "the sent array after writing to a copy")


def check_large_value(pair: RendezvousPair) -> None:
    """An 8 MiB value arrives bit-exact."""
    key = new_key(pair, "large")
    sent = np.random.default_rng(20240611).standard_normal((1024, 1024))  # 8 MiB of float64
    pair.producer.send(key, sent)
    pair.settle()
    assert_same(recv_now(pair, key).value, sent, "8 MiB float64")
