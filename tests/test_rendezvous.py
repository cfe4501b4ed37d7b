"""The receive flavours of the Rendezvous base class, exercised through LocalRendezvous.

recv (timeout, interruption), recv_async, recv_future (cancel and its race) and arecv
(timeout, cancellation and its race) are written once in _rendezvous.py on top of a
rendezvous's ``start_recv``; these tests pin them down with the reference transport.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmrdv._errors import AbortedError, DeadlineExceededError, InvalidArgumentError
from shmrdv._keys import ParsedKey, create_key, parse_key
from shmrdv._rendezvous import (
    Canceller,
    DoneCallback,
    LocalRendezvous,
    Received,
    Rendezvous,
    check_timeout,
)
from shmrdv._worker import StepRendezvous

DEV = "/job:w/replica:0/task:0/device:CPU:0"
KEY = create_key(DEV, 1, DEV, "edge")


@pytest.fixture
def rdv() -> Iterator[LocalRendezvous]:
    with LocalRendezvous() as r:
        yield r


class _SlowDelivery(LocalRendezvous):
    """Holds each delivery at a gate, after the waiter was taken and before done runs.

    That is the window in which a cancellation must lose: the value is on its way.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        def slow(error: BaseException | None, received: Received | None) -> None:
            self.entered.set()
            self.gate.wait(5)
            done(error, received)

        return super().start_recv(key, slow, copy=copy, blocking=blocking)


def _send_in_thread(rdv: LocalRendezvous, value: Any) -> threading.Thread:
    t = threading.Thread(target=rdv.send, args=(KEY, value), daemon=True)
    t.start()
    return t


# -- timeouts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timeout", [-1, -0.001, math.nan, math.inf, "soon", "1", True, b"1", object(), [1.0]], ids=repr
)
def test_rendezvous_recv_timeout_invalid(rdv: LocalRendezvous, timeout: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout"):
        rdv.recv(KEY, timeout=timeout)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        asyncio.run(rdv.arecv(KEY, timeout=timeout))
    assert rdv.stats()["pending_waiters"] == 0  # refused before any waiter was queued


@pytest.mark.parametrize("timeout", [None, 0, 0.5, 3, np.float32(0.5), np.int64(2)], ids=repr)
def test_rendezvous_check_timeout_accepts(timeout: float | None) -> None:
    assert check_timeout(timeout) == timeout


def test_rendezvous_recv_timeout_zero_on_empty_key(rdv: LocalRendezvous) -> None:
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError) as e:
        rdv.recv(KEY, timeout=0)
    assert time.monotonic() - t0 < 0.5
    assert isinstance(e.value, TimeoutError)
    assert KEY in str(e.value) and "removed" in str(e.value)
    assert rdv.stats()["pending_waiters"] == 0


def test_rendezvous_recv_timeout_zero_takes_a_queued_value(rdv: LocalRendezvous) -> None:
    rdv.send(KEY, np.arange(2))
    assert rdv.recv(KEY, timeout=0).value.tolist() == [0, 1]


def test_rendezvous_recv_timeout_removes_waiter(rdv: LocalRendezvous) -> None:
    with pytest.raises(DeadlineExceededError):
        rdv.recv(KEY, timeout=0.05)
    assert rdv.stats()["pending_waiters"] == 0
    rdv.send(KEY, np.array([5]))
    assert rdv.recv(KEY, timeout=1).value[0] == 5


def test_rendezvous_recv_timeout_lost_race_returns_value() -> None:
    # The timeout expires while the value is on its way: the value wins, not the timeout.
    rdv = _SlowDelivery()
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(rdv.recv(KEY, timeout=0.2)), daemon=True)
    t.start()
    time.sleep(0.05)
    _send_in_thread(rdv, np.array([1]))
    assert rdv.entered.wait(2)
    time.sleep(0.3)  # past the timeout, delivery still held at the gate
    rdv.gate.set()
    t.join(2)
    assert len(result) == 1 and result[0].value[0] == 1
    rdv.close()


# -- interruption (Ctrl-C) -----------------------------------------------------------------


@pytest.fixture
def interrupt_main() -> Iterator[Any]:
    """``interrupt_main(after)`` raises KeyboardInterrupt in the main thread, as Ctrl-C would.

    SIGUSR1 sent to the main thread itself (a process-directed signal may land in another
    thread and only be noticed later), since pytest-timeout owns SIGALRM.
    """

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    main = threading.main_thread().ident
    assert main == threading.get_ident()
    old = signal.signal(signal.SIGUSR1, handler)
    timers: list[threading.Timer] = []

    def schedule(after: float) -> None:
        t = threading.Timer(after, signal.pthread_kill, args=(main, signal.SIGUSR1))
        timers.append(t)
        t.start()

    try:
        yield schedule
    finally:
        for t in timers:
            t.cancel()
            t.join(5)
        signal.signal(signal.SIGUSR1, old)


def test_rendezvous_recv_interrupted_removes_waiter(
    rdv: LocalRendezvous, interrupt_main: Any
) -> None:
    interrupt_main(0.1)
    with pytest.raises(KeyboardInterrupt):
        rdv.recv(KEY, timeout=5)
    assert rdv.stats()["pending_waiters"] == 0
    rdv.send(KEY, np.array([3]))
    assert rdv.recv(KEY, timeout=1).value[0] == 3


def test_rendezvous_recv_interrupted_after_value_taken_warns(
    interrupt_main: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Ctrl-C lands while the value is on its way: the interrupt wins, and the dropped
    # value is logged rather than lost silently.
    rdv = _SlowDelivery()

    def deliver_slowly() -> None:
        assert rdv.entered.wait(5)  # the waiter is taken, delivery held at the gate
        interrupt_main(0)
        time.sleep(0.2)
        rdv.gate.set()

    helper = threading.Thread(target=deliver_slowly, daemon=True)
    helper.start()
    threading.Timer(0.05, rdv.send, args=(KEY, np.array([4]))).start()
    with caplog.at_level(logging.WARNING, logger="shmrdv"), pytest.raises(KeyboardInterrupt):
        rdv.recv(KEY, timeout=5)
    helper.join(5)
    assert any("dropped" in r.getMessage() and KEY in r.getMessage() for r in caplog.records)
    assert rdv.pending_keys() == []
    rdv.close()


# -- recv_async ----------------------------------------------------------------------------


def test_rendezvous_recv_async_bad_key_reaches_done(rdv: LocalRendezvous) -> None:
    calls: list[tuple[BaseException | None, Received | None]] = []
    rdv.recv_async("no;such;key", lambda e, r: calls.append((e, r)))
    rdv.recv_async(123, lambda e, r: calls.append((e, r)))  # type: ignore[arg-type]
    assert len(calls) == 2
    for error, received in calls:
        assert isinstance(error, InvalidArgumentError) and received is None


def test_rendezvous_recv_async_done_exception_is_logged(
    rdv: LocalRendezvous, caplog: pytest.LogCaptureFixture
) -> None:
    def bad(error: BaseException | None, received: Received | None) -> None:
        raise RuntimeError("boom in done")

    with caplog.at_level(logging.ERROR, logger="shmrdv.callbacks"):
        rdv.recv_async(KEY, bad)
        rdv.send(KEY, np.zeros(1))  # does not raise
        rdv.send(KEY, np.zeros(1))
        rdv.recv_async(KEY, bad)  # value queued: done runs here, still does not raise
    boom = [r for r in caplog.records if r.exc_info and "boom in done" in str(r.exc_info[1])]
    assert len(boom) == 2


def test_rendezvous_recv_async_copy(rdv: LocalRendezvous) -> None:
    sent = np.arange(3)
    got: list[Received | None] = []
    rdv.recv_async(KEY, lambda e, r: got.append(r), copy=True)
    rdv.send(KEY, sent)
    assert got[0] is not None and not np.shares_memory(got[0].value, sent)


# -- recv_future ---------------------------------------------------------------------------


def test_rendezvous_recv_future_cancel_before_send(rdv: LocalRendezvous) -> None:
    fut = rdv.recv_future(KEY)
    assert fut.cancel() is True and fut.cancelled()
    assert rdv.stats()["pending_waiters"] == 0
    rdv.send(KEY, np.array([1]))
    assert rdv.recv(KEY, timeout=1).value[0] == 1


def test_rendezvous_recv_future_cancel_after_value_taken_returns_false() -> None:
    rdv = _SlowDelivery()
    fut = rdv.recv_future(KEY)
    sender = _send_in_thread(rdv, np.array([8]))
    assert rdv.entered.wait(2)  # the waiter is taken, done not yet called
    assert fut.cancel() is False
    assert not fut.cancelled() and not fut.done()
    rdv.gate.set()
    assert fut.result(2).value[0] == 8
    sender.join(2)
    rdv.close()


def test_rendezvous_recv_future_cancel_after_done_returns_false(rdv: LocalRendezvous) -> None:
    rdv.send(KEY, np.array([2]))
    fut = rdv.recv_future(KEY)
    assert fut.done() and fut.cancel() is False
    assert fut.result(0).value[0] == 2


def test_rendezvous_recv_future_bad_key(rdv: LocalRendezvous) -> None:
    fut = rdv.recv_future("bad")
    assert isinstance(fut.exception(0), InvalidArgumentError)


def test_rendezvous_recv_future_aborted(rdv: LocalRendezvous) -> None:
    fut = rdv.recv_future(KEY)
    error = AbortedError("stop")
    rdv.start_abort(error)
    assert fut.exception(1) is error
    assert rdv.recv_future(KEY).exception(0) is error


# -- arecv ---------------------------------------------------------------------------------


def test_rendezvous_arecv_value_then_timeout(rdv: LocalRendezvous) -> None:
    async def main() -> Received:
        rdv.send(KEY, np.array([6]))
        got = await rdv.arecv(KEY, timeout=1)
        with pytest.raises(DeadlineExceededError):
            await rdv.arecv(KEY, timeout=0.05)
        return got

    assert asyncio.run(main()).value[0] == 6
    assert rdv.stats()["pending_waiters"] == 0


def test_rendezvous_arecv_cancel_removes_waiter(rdv: LocalRendezvous) -> None:
    async def main() -> None:
        task = asyncio.ensure_future(rdv.arecv(KEY))
        await asyncio.sleep(0.01)
        assert rdv.stats()["pending_waiters"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rdv.stats()["pending_waiters"] == 0

    asyncio.run(main())


def test_rendezvous_arecv_returns_value_that_raced_cancellation() -> None:
    rdv = _SlowDelivery()

    async def main() -> tuple[Received, bool]:
        task = asyncio.ensure_future(rdv.arecv(KEY))
        await asyncio.sleep(0.01)
        _send_in_thread(rdv, np.array([9]))
        assert await asyncio.to_thread(rdv.entered.wait, 2)  # waiter taken, done held
        task.cancel()
        for _ in range(3):
            await asyncio.sleep(0)  # let the task see the cancellation and lose the race
        rdv.gate.set()
        got = await asyncio.wait_for(task, 2)
        return got, task.cancelled()

    got, cancelled = asyncio.run(main())
    assert got.value[0] == 9 and cancelled is False
    rdv.close()


def test_rendezvous_arecv_aborted(rdv: LocalRendezvous) -> None:
    async def main() -> None:
        task = asyncio.ensure_future(rdv.arecv(KEY, timeout=5))
        await asyncio.sleep(0.01)
        rdv.start_abort(AbortedError("gone"))
        with pytest.raises(AbortedError, match="gone"):
            await asyncio.wait_for(task, 1)

    asyncio.run(main())


# -- keys and allocate ---------------------------------------------------------------------


def test_rendezvous_recv_accepts_parsed_key(rdv: LocalRendezvous) -> None:
    rdv.send(KEY, np.array([1]))
    assert rdv.recv(parse_key(KEY), timeout=1).value[0] == 1


def test_rendezvous_recv_bad_key_raises(rdv: LocalRendezvous) -> None:
    with pytest.raises(InvalidArgumentError):
        rdv.recv("bad", timeout=0)
    with pytest.raises(InvalidArgumentError):
        asyncio.run(rdv.arecv(None, timeout=0))  # type: ignore[arg-type]


def test_rendezvous_allocate_default(rdv: LocalRendezvous) -> None:
    buf = rdv.allocate(KEY, (2, 3), np.float32)
    assert buf.shape == (2, 3) and buf.dtype == np.float32 and buf.flags.writeable
    buf[:] = 1
    rdv.send(KEY, buf)
    assert rdv.recv(KEY, timeout=1).value is buf
    with pytest.raises(InvalidArgumentError):
        rdv.allocate(KEY, (2,), "not a dtype")
    with pytest.raises(InvalidArgumentError):
        rdv.allocate("bad", (2,), np.float32)


def test_rendezvous_abstract_methods_are_public_and_recv_is_written_once() -> None:
    """A user's subclass implements public methods only; every flavour lives in the base."""
    assert Rendezvous.__abstractmethods__ == {"send", "start_recv", "start_abort"}
    flavours = ("recv", "recv_async", "recv_future", "arecv")
    for cls in (LocalRendezvous, StepRendezvous):
        assert not [name for name in flavours if name in vars(cls)], cls


def test_rendezvous_received_fast_constructor_builds_the_same_value() -> None:
    import dataclasses

    from shmrdv._rendezvous import received

    a = np.arange(3)
    r = received(a, True)
    assert type(r) is Received and r == Received(a, True) and r.value is a and r.is_dead
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.is_dead = False  # type: ignore[misc]
    value, dead = r
    assert value is a and dead is True


def test_rendezvous_recv_slot_wakes_a_waiter_whenever_done_runs() -> None:
    """The slot's lock is made only by a receiver that waits: ``done`` before, while and
    after it is made all wake it (or find it not waiting)."""
    from shmrdv._rendezvous import RecvSlot

    early = RecvSlot()
    early.done(None, Received(np.zeros(1)))
    assert early.wait(0) and early.wait(None) and early.result().value.shape == (1,)
    for delay in (0.0, 0.001, 0.02):
        slot = RecvSlot()
        t = threading.Timer(delay, slot.done, (None, Received(np.ones(2))))
        t.start()
        assert slot.wait(10)
        assert slot.result().value.shape == (2,)
        t.join(10)
    late = RecvSlot()
    assert not late.wait(0.01)  # nothing: times out
    late.done(KeyError("x"), None)
    assert late.wait(0)
    with pytest.raises(KeyError):
        late.result()
