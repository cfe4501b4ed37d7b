"""LocalRendezvous specifics: no copy, the table, counters, abort and close, thread safety.

The behaviours every transport shares are in test_conformance_local.py; the receive
flavours of the base class in test_rendezvous.py.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmrdv._errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
)
from shmrdv._keys import create_key, parse_key
from shmrdv._rendezvous import LocalRendezvous, Received

DEV = "/job:w/replica:0/task:0/device:CPU:0"
OTHER = "/job:w/replica:0/task:1/device:CPU:0"


def key(name: str, incarnation: int = 1, frame_iter: tuple[int, int] = (0, 0)) -> str:
    return create_key(DEV, incarnation, DEV, name, frame_iter)


def test_local_recv_gets_the_sent_object_itself() -> None:
    with LocalRendezvous() as rdv:
        sent = np.arange(4)
        rdv.send(key("a"), sent)
        got = rdv.recv(key("a"), timeout=1)
        assert got.value is sent
        assert got.is_dead is False


def test_local_recv_copy_gives_private_writable_array() -> None:
    with LocalRendezvous() as rdv:
        sent = np.arange(4)
        sent.flags.writeable = False
        rdv.send(key("a"), sent)
        got = rdv.recv(key("a"), timeout=1, copy=True)
        assert got.value is not sent
        assert not np.shares_memory(got.value, sent)
        assert got.value.flags.writeable
        np.testing.assert_array_equal(got.value, sent)


def test_local_waiting_receiver_gets_the_sent_object_itself() -> None:
    with LocalRendezvous() as rdv:
        fut = rdv.recv_future(key("a"))
        sent = np.arange(4)
        rdv.send(key("a"), sent)
        assert fut.result(1).value is sent


def test_local_numpy_scalar_arrives_as_0d_array() -> None:
    with LocalRendezvous() as rdv:
        rdv.send(key("a"), np.float32(2.5))
        got = rdv.recv(key("a"), timeout=1).value
        assert got.shape == () and got.dtype == np.float32 and got == 2.5


def test_local_keys_differing_in_any_part_are_never_merged() -> None:
    keys = [
        key("edge"),
        key("edge", incarnation=2),
        key("edge", frame_iter=(0, 1)),
        key("edge", frame_iter=(1, 0)),
        key("edge2"),
        create_key(DEV, 1, OTHER, "edge"),
        create_key(OTHER, 1, DEV, "edge"),
    ]
    with LocalRendezvous() as rdv:
        for i, k in enumerate(keys):
            rdv.send(k, np.array([i]))
        assert rdv.stats()["keys"] == len(keys)
        assert rdv.pending_keys() == keys  # the table holds the full key strings
        for i, k in reversed(list(enumerate(keys))):
            assert rdv.recv(k, timeout=1).value[0] == i


def test_local_str_and_parsed_key_name_one_channel() -> None:
    with LocalRendezvous() as rdv:
        rdv.send(parse_key(key("a")), np.array([1]))
        assert rdv.recv(key("a"), timeout=1).value[0] == 1
        rdv.send(key("a"), np.array([2]))
        assert rdv.recv(parse_key(key("a")), timeout=1).value[0] == 2


def test_local_empty_channels_are_removed() -> None:
    with LocalRendezvous() as rdv:
        for i in range(100):
            rdv.send(key(f"k{i}"), np.array([i]))
            rdv.recv(key(f"k{i}"), timeout=1)
        for i in range(100):
            fut = rdv.recv_future(key(f"w{i}"))
            rdv.send(key(f"w{i}"), np.array([i]))
            fut.result(1)
        for i in range(10):
            with pytest.raises(DeadlineExceededError):
                rdv.recv(key(f"t{i}"), timeout=0)
            assert rdv.recv_future(key(f"c{i}")).cancel()
        assert rdv.pending_keys() == []
        assert len(rdv._table) == 0
        assert rdv.stats() == {
            "pending_values": 0,
            "pending_waiters": 0,
            "keys": 0,
            "sent": 200,
            "received": 200,
        }


def test_local_channel_holds_values_or_waiters_never_both() -> None:
    with LocalRendezvous() as rdv:
        futs = [rdv.recv_future(key("a")) for _ in range(3)]
        assert rdv.stats()["pending_waiters"] == 3
        for i in range(5):
            rdv.send(key("a"), np.array([i]))
        assert [f.result(1).value[0] for f in futs] == [0, 1, 2]
        s = rdv.stats()
        assert (s["pending_values"], s["pending_waiters"], s["keys"]) == (2, 0, 1)
        assert rdv._table.values_of(key("a")) == 2 and rdv._table.waiters_of(key("a")) == 0


def test_local_stats_and_repr() -> None:
    rdv = LocalRendezvous()
    rdv.send(key("a"), np.zeros(1))
    rdv.send(key("a"), np.zeros(1))
    rdv.recv_future(key("b"))
    rdv.recv(key("a"), timeout=1)
    assert rdv.stats() == {
        "pending_values": 1,
        "pending_waiters": 1,
        "keys": 2,
        "sent": 2,
        "received": 1,
    }
    text = repr(rdv)
    assert text.startswith("<LocalRendezvous open")
    assert "pending_values=1" in text and "pending_waiters=1" in text and "keys=2" in text
    rdv.close()
    assert "aborted=CancelledError('LocalRendezvous closed')" in repr(rdv)


def test_local_send_refuses_bad_values_and_queues_nothing() -> None:
    with LocalRendezvous() as rdv:
        for bad in ([1, 2], "text", None, np.array([object()]), np.array([1, None])):
            with pytest.raises(InvalidArgumentError):
                rdv.send(key("a"), bad)
        assert rdv.stats()["sent"] == 0 and rdv.pending_keys() == []


def test_local_send_refuses_bad_key() -> None:
    with LocalRendezvous() as rdv:
        with pytest.raises(InvalidArgumentError, match="rendezvous key"):
            rdv.send("a;b", np.zeros(1))
        with pytest.raises(InvalidArgumentError):
            rdv.send(42, np.zeros(1))  # type: ignore[arg-type]
        assert rdv.pending_keys() == []


def test_local_is_dead_is_coerced_to_bool() -> None:
    with LocalRendezvous() as rdv:
        rdv.send(key("a"), np.zeros(1), is_dead=1)  # type: ignore[arg-type]
        assert rdv.recv(key("a"), timeout=1).is_dead is True


def test_local_done_runs_outside_the_lock() -> None:
    # done calls back into the rendezvous; under the lock this would deadlock.
    rdv = LocalRendezvous()
    results: list[Any] = []

    def done(error: BaseException | None, received: Received | None) -> None:
        rdv.send(key("echo"), np.array([7]))
        results.append(rdv.recv(key("echo"), timeout=1))
        results.append(rdv.stats())

    def run() -> None:
        rdv.recv_async(key("a"), done)
        rdv.send(key("a"), np.zeros(1))  # done runs in this thread
        rdv.send(key("b"), np.zeros(1))
        rdv.recv_async(key("b"), done)  # done runs in this thread, value queued

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "a done callback ran under the rendezvous lock"
    assert len(results) == 4
    rdv.close()


def test_local_done_runs_in_the_completing_thread() -> None:
    with LocalRendezvous() as rdv:
        where: list[str] = []

        def done(error: BaseException | None, received: Received | None) -> None:
            where.append(threading.current_thread().name)

        rdv.recv_async(key("a"), done)
        t = threading.Thread(target=rdv.send, args=(key("a"), np.zeros(1)), name="sender")
        t.start()
        t.join(5)
        rdv.send(key("b"), np.zeros(1))
        rdv.recv_async(key("b"), done)
        assert where == ["sender", threading.current_thread().name]


def test_local_abort_fails_waiters_drops_values_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    rdv = LocalRendezvous()
    rdv.send(key("v1"), np.zeros(1))
    rdv.send(key("v1"), np.zeros(1))
    rdv.send(key("v2"), np.zeros(1))
    futs = [rdv.recv_future(key("w")) for _ in range(3)]
    error = AbortedError("Cleanup 7")
    with caplog.at_level(logging.DEBUG, logger="shmrdv.local"):
        rdv.start_abort(error)
    assert all(f.exception(1) is error for f in futs)
    assert rdv.pending_keys() == []
    assert rdv.stats()["pending_values"] == 0
    assert any("dropped 3 value(s)" in r.getMessage() for r in caplog.records)
    assert rdv.aborted is error


def test_local_after_abort_send_and_recv_raise_the_first_error() -> None:
    rdv = LocalRendezvous()
    first = AbortedError("first")
    rdv.start_abort(first)
    rdv.start_abort(AbortedError("second"))
    rdv.close()
    with pytest.raises(AbortedError) as sent:
        rdv.send(key("a"), np.zeros(1))
    assert sent.value is first
    t0 = time.monotonic()
    with pytest.raises(AbortedError) as got:
        rdv.recv(key("a"), timeout=5)
    assert got.value is first and time.monotonic() - t0 < 1
    assert rdv.pending_keys() == []


def test_local_abort_error_traceback_does_not_grow() -> None:
    rdv = LocalRendezvous()
    rdv.start_abort(AbortedError("x"))

    def depth() -> int:
        try:
            rdv.send(key("a"), np.zeros(1))
        except AbortedError as e:
            n, tb = 0, e.__traceback__
            while tb is not None:
                n, tb = n + 1, tb.tb_next
            return n
        raise AssertionError("send did not raise")

    assert depth() == depth() == depth()


def test_local_abort_needs_an_exception() -> None:
    with LocalRendezvous() as rdv:
        with pytest.raises(InvalidArgumentError, match="exception instance"):
            rdv.start_abort(None)  # type: ignore[arg-type]
        assert rdv.aborted is None


def test_local_close_is_idempotent_and_cancels() -> None:
    rdv = LocalRendezvous()
    fut = rdv.recv_future(key("a"))
    rdv.close()
    err = fut.exception(1)
    assert isinstance(err, CancelledError) and "closed" in str(err)
    rdv.close()
    with pytest.raises(CancelledError):
        rdv.recv(key("a"), timeout=1)


def test_local_context_manager_closes() -> None:
    with LocalRendezvous() as rdv:
        fut = rdv.recv_future(key("a"))
    assert isinstance(fut.exception(1), CancelledError)
    assert isinstance(rdv.aborted, CancelledError)


def test_local_abort_callback_may_reenter() -> None:
    rdv = LocalRendezvous()
    seen: list[BaseException | None] = []

    def done(error: BaseException | None, received: Received | None) -> None:
        seen.append(error)
        rdv.start_abort(AbortedError("nested"))  # a no-op, and must not deadlock
        rdv.recv_async(key("b"), lambda e, r: seen.append(e))

    rdv.recv_async(key("a"), done)
    t = threading.Thread(target=rdv.start_abort, args=(AbortedError("outer"),), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive()
    assert [str(e) for e in seen] == ["outer", "outer"]


# -- thread safety -------------------------------------------------------------------------

SENDERS = RECEIVERS = 8
KEYS_PER_SENDER = 4
MESSAGES = 250  # per key: 8 * 4 * 250 = 8000 messages


@pytest.fixture
def often_switching() -> Iterator[None]:
    """Switch threads every microsecond instead of every 5 ms: many more interleavings per run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("often_switching")
def test_local_stress_one_receiver_per_key_no_loss_no_dup_fifo() -> None:
    rdv = LocalRendezvous()
    n_keys = SENDERS * KEYS_PER_SENDER
    keys = [key(f"stress{k}") for k in range(n_keys)]
    # Receivers own keys from different senders, so every receiver races every sender.
    owners = list(range(n_keys))
    random.Random(1).shuffle(owners)
    received: dict[int, list[int]] = {k: [] for k in range(n_keys)}
    errors: list[BaseException] = []
    start = threading.Barrier(SENDERS + RECEIVERS)

    def sender(s: int) -> None:
        start.wait(5)
        mine = range(s * KEYS_PER_SENDER, (s + 1) * KEYS_PER_SENDER)
        for seq in range(MESSAGES):
            for k in mine:
                rdv.send(keys[k], np.array([k, seq], dtype=np.int64), is_dead=seq % 7 == 0)

    def receiver(r: int) -> None:
        mine = owners[r * KEYS_PER_SENDER : (r + 1) * KEYS_PER_SENDER]
        start.wait(5)
        try:
            for seq in range(MESSAGES):
                for k in mine:
                    if seq % 3 == 0:
                        got = rdv.recv_future(keys[k]).result(10)
                    else:
                        got = rdv.recv(keys[k], timeout=10)
                    assert got.value[0] == k and got.is_dead == (got.value[1] % 7 == 0)
                    received[k].append(int(got.value[1]))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(SENDERS)]
    threads += [threading.Thread(target=receiver, args=(i,)) for i in range(RECEIVERS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    for k in range(n_keys):
        assert received[k] == list(range(MESSAGES)), f"key {k}: lost, duplicated or reordered"
    assert rdv.stats() == {
        "pending_values": 0,
        "pending_waiters": 0,
        "keys": 0,
        "sent": n_keys * MESSAGES,
        "received": n_keys * MESSAGES,
    }
    assert time.monotonic() - t0 < 5
    rdv.close()


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("often_switching")
def test_local_stress_shared_keys_no_loss_no_dup_per_sender_order() -> None:
    # Every sender sends to every key and every receiver takes from every key. Order
    # across receivers is not observable, but what one receiver takes from one key must
    # follow each sender's order (FIFO), and the union must be exactly what was sent.
    rdv = LocalRendezvous()
    n_keys, per_sender = 4, 150
    keys = [key(f"shared{k}") for k in range(n_keys)]
    taken: list[list[tuple[int, int, int]]] = [[] for _ in range(RECEIVERS)]
    errors: list[BaseException] = []
    start = threading.Barrier(SENDERS + RECEIVERS)

    def sender(s: int) -> None:
        start.wait(5)
        for seq in range(per_sender):
            for k in range(n_keys):
                rdv.send(keys[k], np.array([k, s, seq], dtype=np.int64))

    def receiver(r: int) -> None:
        start.wait(5)
        try:
            # Each receiver takes an equal share of every key, so all the counts add up.
            for _ in range(per_sender * SENDERS // RECEIVERS):
                for k in range(n_keys):
                    v = rdv.recv(keys[k], timeout=10).value
                    taken[r].append((int(v[0]), int(v[1]), int(v[2])))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(SENDERS)]
    threads += [threading.Thread(target=receiver, args=(i,)) for i in range(RECEIVERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    everything = [m for mine in taken for m in mine]
    assert len(everything) == len(set(everything)) == n_keys * SENDERS * per_sender
    for mine in taken:
        for k in range(n_keys):
            for s in range(SENDERS):
                seqs = [seq for kk, ss, seq in mine if kk == k and ss == s]
                assert seqs == sorted(seqs), f"key {k} sender {s}: out of order"
    assert rdv.pending_keys() == []
    rdv.close()
