"""The conformance checks of how a receive completes: ``done`` callbacks, futures,
``arecv``, timeouts, cancels and aborts, each exactly once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
import weakref

import numpy as np

from .._errors import AbortedError, InvalidArgumentError
from .._rendezvous import Received
from .pair import EXPIRE_S, PROMPT_S, SETTLE_S, WAIT_S, RendezvousPair
from .tools import (
    ListHandler,
    Recorder,
    expect_timeout,
    is_error,
    new_key,
    recv_now,
    spawn,
)
from .values import assert_same, expect

__all__ = [
    "check_abort_fails_pending",
    "check_abort_first_error_wins",
    "check_arecv",
    "check_arecv_cancel_removes_waiter",
    "check_arecv_timeout_removes_waiter",
    "check_bad_key_reported",
    "check_done_exception_is_logged",
    "check_recv_async_done_once",
    "check_recv_future_cancel",
    "check_recv_future_lets_go",
    "check_recv_future_result",
]


def check_recv_async_done_once(pair: RendezvousPair) -> None:
    """recv_async calls ``done(None, Received)`` exactly once, waiting or not."""
    sent = np.arange(3, dtype=np.int8)
    for order in ("recv_first", "send_first"):
        key = new_key(pair, f"async_{order}")
        rec = Recorder()
        if order == "recv_first":
            pair.consumer.recv_async(key, rec.done)
            pair.producer.send(key, sent)
        else:
            pair.producer.send(key, sent)
            pair.settle()
            pair.consumer.recv_async(key, rec.done)
        error, received = rec.only_call(f"recv_async ({order})")
        expect(error is None, f"recv_async ({order}): done got error {error!r}")
        expect(
            isinstance(received, Received),
            f"recv_async ({order}): done got {received!r}, not a Received",
        )
        assert received is not None
        assert_same(received.value, sent, f"recv_async ({order})")


def check_done_exception_is_logged(pair: RendezvousPair) -> None:
    """An exception raised by ``done`` is logged under ``shmrdv``, not raised; traffic goes on."""
    key = new_key(pair, "raising_done")
    token = f"conformance-done-raised-{uuid.uuid4().hex[:8]}"
    called = threading.Event()

    def raising_done(error: BaseException | None, received: Received | None) -> None:
        called.set()
        raise RuntimeError(token)

    handler = ListHandler()
    logger = logging.getLogger("shmrdv")
    logger.addHandler(handler)
    try:
        pair.consumer.recv_async(key, raising_done)
        pair.producer.send(key, np.zeros(2))  # must not raise, whichever thread runs done
        expect(called.wait(WAIT_S), f"done was not called within {WAIT_S}s")

        def logged() -> bool:
            return any(
                r.exc_info is not None and token in str(r.exc_info[1]) for r in handler.records
            )

        deadline = time.monotonic() + WAIT_S
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.01)
        expect(logged(), "the exception raised by done was not logged under 'shmrdv'")
    finally:
        logger.removeHandler(handler)
    sent = np.ones(2)
    pair.producer.send(key, sent)
    pair.settle()
    assert_same(recv_now(pair, key).value, sent, "recv after a raising done")


def check_recv_future_result(pair: RendezvousPair) -> None:
    """recv_future resolves to a Received, whether the value came before or after."""
    key = new_key(pair, "future")
    sent = np.arange(4, dtype=np.complex64)
    pair.producer.send(key, sent)
    pair.settle()
    got = pair.consumer.recv_future(key).result(WAIT_S)
    expect(isinstance(got, Received), f"future result is {type(got).__name__}, not Received")
    assert_same(got.value, sent, "future of a queued value")
    fut = pair.consumer.recv_future(key)
    pair.producer.send(key, sent * 2)
    assert_same(fut.result(WAIT_S).value, sent * 2, "future of a later value")


def check_recv_future_lets_go(pair: RendezvousPair) -> None:
    """A future's value is freed once the caller drops it and the future, without the
    garbage collector: nothing of the receive keeps it (a shared-memory value holds its
    producer's pool slot until then)."""
    sent = np.arange(6, dtype=np.int32)
    for order in ("queued", "later"):
        key = new_key(pair, f"future_lets_go_{order}")
        enabled = gc.isenabled()
        gc.disable()  # a reference cycle would keep the value until a collection
        try:
            # A copy that only the send holds: an in-process send may hand over the array.
            if order == "queued":
                pair.producer.send(key, sent.copy())
                pair.settle()
                fut = pair.consumer.recv_future(key)
            else:
                fut = pair.consumer.recv_future(key)
                pair.producer.send(key, sent.copy())
            got = fut.result(WAIT_S)
            assert_same(got.value, sent, f"future of a {order} value")
            value = weakref.ref(got.value)
            del fut, got
            # The thread that completed the future may still be returning from it.
            deadline = time.monotonic() + PROMPT_S
            while value() is not None and time.monotonic() < deadline:
                time.sleep(0.005)
            expect(
                value() is None,
                f"the value of a {order} recv_future is still referenced after the future "
                "and its result were dropped (a reference cycle, or a thread keeps it)",
            )
        finally:
            if enabled:
                gc.enable()


def check_recv_future_cancel(pair: RendezvousPair) -> None:
    """Cancelling a waiting future removes its waiter: the next send goes to the next receiver."""
    key = new_key(pair, "future_cancel")
    fut = pair.consumer.recv_future(key)
    expect(fut.cancel() is True, "cancel() of a waiting recv_future should return True")
    expect(fut.cancelled(), "the future should report cancelled()")
    sent = np.array([7.0])
    pair.producer.send(key, sent)
    pair.settle()
    assert_same(recv_now(pair, key).value, sent, "recv after a cancelled future")


def check_arecv(pair: RendezvousPair) -> None:
    """arecv returns the value without a timeout and with one, queued or arriving later."""
    key = new_key(pair, "arecv")
    sent = np.arange(3, dtype=np.uint16)

    async def main() -> tuple[Received, Received]:
        pair.producer.send(key, sent)
        pair.settle()
        first = await asyncio.wait_for(pair.consumer.arecv(key), WAIT_S)
        task = asyncio.ensure_future(pair.consumer.arecv(key, timeout=WAIT_S))
        await asyncio.sleep(SETTLE_S)
        pair.producer.send(key, sent + 1)
        second = await asyncio.wait_for(task, WAIT_S + PROMPT_S)
        return first, second

    first, second = asyncio.run(main())
    assert_same(first.value, sent, "arecv of a queued value")
    assert_same(second.value, sent + 1, "arecv(timeout) of a later value")


def check_arecv_timeout_removes_waiter(pair: RendezvousPair) -> None:
    """An expired arecv raises DeadlineExceededError and does not swallow the next send."""
    key = new_key(pair, "arecv_timeout")

    async def expire() -> object:
        return await asyncio.wait_for(
            pair.consumer.arecv(key, timeout=EXPIRE_S), EXPIRE_S + PROMPT_S
        )

    expect_timeout(lambda: asyncio.run(expire()), "arecv(timeout)")
    sent = np.array([1, 2], dtype=np.int32)
    pair.producer.send(key, sent)
    pair.settle()
    assert_same(recv_now(pair, key).value, sent, "send after a timed-out arecv")


def check_arecv_cancel_removes_waiter(pair: RendezvousPair) -> None:
    """Cancelling the task awaiting arecv removes its waiter."""
    key = new_key(pair, "arecv_cancel")

    async def main() -> bool:
        task = asyncio.ensure_future(pair.consumer.arecv(key))
        await asyncio.sleep(SETTLE_S)  # let it start waiting
        task.cancel()
        try:
            await asyncio.wait_for(task, WAIT_S)
        except asyncio.CancelledError:
            return True
        return False

    expect(asyncio.run(main()), "the cancelled arecv task did not end cancelled")
    sent = np.array([9], dtype=np.int64)
    pair.producer.send(key, sent)
    pair.settle()
    assert_same(recv_now(pair, key).value, sent, "recv after a cancelled arecv")


def check_abort_fails_pending(pair: RendezvousPair) -> None:
    """start_abort reaches a blocked recv, a pending recv_async and a future promptly."""
    token = f"conformance-abort-{uuid.uuid4().hex[:8]}"
    error = AbortedError(f"aborted by the conformance suite ({token})")
    k1, k2, k3 = (new_key(pair, f"abort{i}") for i in range(3))
    blocked = spawn(lambda: pair.consumer.recv(k1, timeout=WAIT_S))
    rec = Recorder()
    pair.consumer.recv_async(k2, rec.done)
    fut = pair.consumer.recv_future(k3)
    time.sleep(SETTLE_S)  # let the thread block
    t0 = time.monotonic()
    pair.consumer.start_abort(error)
    got = blocked.exception(PROMPT_S)
    expect(is_error(got, AbortedError, token), f"blocked recv: got {got!r}, not the abort error")
    got, received = rec.only_call("recv_async")
    expect(is_error(got, AbortedError, token), f"recv_async: got {got!r}, not the abort error")
    expect(received is None, f"recv_async: an error came with a value {received!r}")
    got = fut.exception(PROMPT_S)
    expect(is_error(got, AbortedError, token), f"recv_future: got {got!r}, not the abort error")
    elapsed = time.monotonic() - t0
    expect(elapsed < PROMPT_S, f"the abort took {elapsed:.2f}s to reach the waiters")


def check_abort_first_error_wins(pair: RendezvousPair) -> None:
    """After start_abort, receives fail at once with the first error; a second abort is ignored."""
    first = f"conformance-first-{uuid.uuid4().hex[:8]}"
    second = f"conformance-second-{uuid.uuid4().hex[:8]}"
    key = new_key(pair, "aborted")
    pair.consumer.start_abort(AbortedError(f"first ({first})"))
    pair.consumer.start_abort(AbortedError(f"second ({second})"))
    t0 = time.monotonic()
    try:
        got: object = pair.consumer.recv(key, timeout=WAIT_S)
    except AbortedError as e:
        expect(first in str(e), f"recv after two aborts raised {e!r}, not the first error")
    else:
        raise AssertionError(f"recv after abort returned {got!r}")
    expect(time.monotonic() - t0 < PROMPT_S, "recv after abort did not fail at once")
    rec = Recorder()
    pair.consumer.recv_async(key, rec.done)
    err, _ = rec.only_call("recv_async after abort")
    expect(is_error(err, AbortedError, first), f"recv_async after abort: got {err!r}")
    err = pair.consumer.recv_future(key).exception(PROMPT_S)
    expect(is_error(err, AbortedError, first), f"recv_future after abort: got {err!r}")


def check_bad_key_reported(pair: RendezvousPair) -> None:
    """A malformed key is InvalidArgumentError: raised by recv, given to done and to the future."""
    bad = "not a rendezvous key"
    try:
        got: object = pair.consumer.recv(bad, timeout=EXPIRE_S)
    except InvalidArgumentError:
        pass
    else:
        raise AssertionError(f"recv of a malformed key returned {got!r}")
    rec = Recorder()
    pair.consumer.recv_async(bad, rec.done)
    err, received = rec.only_call("recv_async(bad key)")
    expect(isinstance(err, InvalidArgumentError), f"recv_async(bad key): done got {err!r}")
    expect(received is None, "recv_async(bad key): done got a value")
    err = pair.consumer.recv_future(bad).exception(PROMPT_S)
    expect(isinstance(err, InvalidArgumentError), f"recv_future(bad key): got {err!r}")
