"""Helpers for testing code built on shmrdv, and the conformance battery every transport passes.

Each ``check_<behaviour>(pair)`` of ``CHECKS`` runs on a ``RendezvousPair``, bounds every
wait and raises ``AssertionError`` where the behaviour differs from ``LocalRendezvous``'s.
Run them with ``run_conformance`` or one test per check (``parametrize("check", CHECKS)``).
Thread model (``docs/threads.md``): a blocked receiver runs in a ``shmrdv-conformance``
daemon thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import logging
import logging.handlers
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from ._errors import AbortedError, DeadlineExceededError, InvalidArgumentError
from ._procs import ChildError, ChildWorker
from ._rendezvous import Received, Rendezvous

__all__ = ["CHECKS", "ChildError", "ChildWorker", "EXPIRE_S", "PROMPT_S", "Producer"]
__all__ += ["RendezvousPair", "WAIT_S", "assert_same", "run_conformance", "run_in_worker"]
__all__ += ["sample_values"]

#: Longest wait for something that must happen (a value arriving, a callback firing).
WAIT_S = 5.0
#: Timeout given to receives that are meant to expire.
EXPIRE_S = 0.2
#: How soon "at once" must be: an expired timeout raising, an abort reaching a waiter.
PROMPT_S = 2.0
#: Pause that makes "recv before send" likely; a check passes either way round.
SETTLE_S = 0.05

_T = TypeVar("_T")


class Producer(Protocol):
    """The sending side of a pair; may be a proxy for a rendezvous in another process."""

    def send(self, key: str, value: npt.NDArray[Any], *, is_dead: bool = False) -> None: ...


@dataclass
class RendezvousPair:
    """A producer, a consumer in this process, ``make_key(edge_name)`` for a key from one to
    the other, and ``settle()``, which returns once every send so far reached the consumer."""

    producer: Producer
    consumer: Rendezvous
    make_key: Callable[[str], str]
    settle: Callable[[], None] = lambda: None


def _expect(condition: bool, message: str) -> None:
    # Not ``assert``: users' code imports this module, and may run with -O.
    if not condition:
        raise AssertionError(message)


def assert_same(actual: object, expected: npt.NDArray[Any], what: str = "value") -> None:
    """``AssertionError`` unless ``actual`` is an ndarray of the same dtype, shape and bytes
    in C order (NaN payloads and signed zeros compare exactly)."""
    if not isinstance(actual, np.ndarray):
        raise AssertionError(f"{what}: expected a numpy.ndarray, got {type(actual).__name__}")
    _expect(actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype!r} != {expected.dtype!r}")
    _expect(actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}")
    got = np.frombuffer(np.ascontiguousarray(actual).tobytes(), np.uint8)
    want = np.frombuffer(np.ascontiguousarray(expected).tobytes(), np.uint8)
    if not np.array_equal(got, want):  # equal dtypes and shapes: equal sizes
        first = int(np.flatnonzero(got != want)[0])
        raise AssertionError(
            f"{what}: {expected.dtype} {expected.shape} contents differ "
            f"(first differing byte at offset {first} of {len(want)})"
        )


def sample_values() -> dict[str, npt.NDArray[Any]]:
    """One array per kind of value a transport must carry exactly (bfloat16 with ``ml_dtypes``)."""
    values: dict[str, npt.NDArray[Any]] = {}
    for name in ("float16", "float32", "float64"):
        values[name] = np.array([0.0, -0.0, 1.5, np.nan, np.inf, -np.inf, 1e-7], dtype=name)
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        info = np.iinfo(name)
        values[name] = np.array([info.min, 0, 1, info.max], dtype=name).reshape(2, 2)
    values["bool"] = np.array([[True, False, True]])
    for name in ("complex64", "complex128"):
        values[name] = np.array([1 + 2j, complex(np.nan, -0.0), -3j], dtype=name)
    values["bytes_S7"] = np.array([b"abc", b"\x00\xff\x01xyz7", b""], dtype="S7")
    values["unicode_U5"] = np.array(["héllo", "", "\U0001f642ab"], dtype="U5")
    values["structured"] = np.array(
        [(1, (0.5, -2.0), b"ab"), (-7, (np.nan, 3.25), b"xyz")],
        dtype=[("a", "<i4"), ("b", "<f8", (2,)), ("c", "S3")],
    )
    values["strided_view"] = np.arange(60, dtype=np.int32).reshape(6, 10)[::2, 1::3]
    values["fortran_order"] = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    values["zero_d"] = np.array(3.25, dtype=np.float32)
    values["empty_0x3"] = np.zeros((0, 3), dtype=np.float32)
    with contextlib.suppress(ImportError):
        import ml_dtypes

        values["bfloat16"] = np.array([1.0, -2.5, np.inf, 0.0], dtype=ml_dtypes.bfloat16)
    return values


def _key(pair: RendezvousPair, label: str) -> str:
    """A key of a fresh edge name, so no check ever sees another's leftovers."""
    return pair.make_key(f"conformance_{label}_{uuid.uuid4().hex[:12]}")


def _token(label: str) -> str:  # a text to find again in an error or a log record
    return f"conformance-{label}-{uuid.uuid4().hex[:8]}"


def _recv_now(pair: RendezvousPair, key: str, *, copy: bool = False) -> Received:
    try:
        got = pair.consumer.recv(key, timeout=WAIT_S, copy=copy)
    except DeadlineExceededError as e:
        raise AssertionError(f"no value arrived for {key!r} within {WAIT_S}s") from e
    _expect(isinstance(got, Received), f"recv returned {type(got).__name__}, not Received")
    return got


def _send_then_recv(pair: RendezvousPair, key: str, sent: npt.NDArray[Any], what: str) -> None:
    """The next send of ``key`` reaches the next receive (no waiter left over swallows it)."""
    pair.producer.send(key, sent)
    pair.settle()
    assert_same(_recv_now(pair, key).value, sent, what)


def _expect_nothing(pair: RendezvousPair, key: str, why: str) -> None:
    """After ``settle()``, a receive of ``key`` must time out: nothing is queued."""
    pair.settle()
    try:
        got = pair.consumer.recv(key, timeout=EXPIRE_S)
    except DeadlineExceededError:
        return
    raise AssertionError(f"{why}: expected nothing queued for {key!r}, but received {got!r}")


def _expect_timeout(call: Callable[[], object], what: str) -> None:
    """``call()`` must raise ``DeadlineExceededError``, promptly."""
    t0 = time.monotonic()
    try:
        got = call()
    except DeadlineExceededError:
        took = time.monotonic() - t0
        _expect(took < EXPIRE_S + PROMPT_S, f"{what}: a {EXPIRE_S}s timeout took {took:.2f}s")
        return
    raise AssertionError(f"{what}: expected DeadlineExceededError, got {got!r}")


def _spawn(fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
    """``fn()`` in a daemon thread (a broken rendezvous may block it for ever); its outcome."""
    fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name="shmrdv-conformance", daemon=True).start()
    return fut


class _Recorder:
    """A ``done`` callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[BaseException | None, Received | None]] = []
        self.event = threading.Event()

    def done(self, error: BaseException | None, received: Received | None) -> None:
        self.calls.append((error, received))  # list.append is atomic
        self.event.set()

    def only_call(self, what: str) -> tuple[BaseException | None, Received | None]:
        """Wait for the call, then make sure no second one follows shortly."""
        _expect(self.event.wait(WAIT_S), f"{what}: done was not called within {WAIT_S}s")
        time.sleep(SETTLE_S)
        calls = list(self.calls)
        _expect(len(calls) == 1, f"{what}: done was called {len(calls)} times, not once")
        return calls[0]


def _failures(pair: RendezvousPair, key: str) -> list[tuple[str, BaseException | None]]:
    """What recv, recv_async and recv_future of ``key`` fail with, each within ``PROMPT_S``."""
    t0 = time.monotonic()
    try:
        got: object = pair.consumer.recv(key, timeout=WAIT_S)
    except Exception as e:
        error: BaseException = e
    else:
        raise AssertionError(f"recv of {key!r} returned {got!r}")
    took = time.monotonic() - t0
    _expect(took < PROMPT_S, f"recv took {took:.2f}s to fail with {error!r}, not at once")
    rec = _Recorder()
    pair.consumer.recv_async(key, rec.done)
    async_error, received = rec.only_call("recv_async")
    _expect(received is None, f"recv_async: done got a value {received!r} with its error")
    future_error = pair.consumer.recv_future(key).exception(PROMPT_S)
    return [("recv", error), ("recv_async", async_error), ("recv_future", future_error)]


def _aborted(error: BaseException | None, token: str) -> bool:
    """Whether ``error`` is the ``AbortedError`` given to ``start_abort`` with ``token``."""
    return isinstance(error, AbortedError) and token in str(error)


def check_fifo_channel(pair: RendezvousPair) -> None:
    """Values sent before anyone waits are queued, each with its ``is_dead``; each key is a
    FIFO channel of its own, however the sends to many keys interleave; nothing more is left."""
    keys = [_key(pair, f"fifo{k}") for k in range(16)]
    for seq in range(3):
        for k, key in enumerate(keys):
            pair.producer.send(key, np.array([k, seq], dtype=np.int64), is_dead=k == seq)
    pair.settle()
    for k in reversed(range(len(keys))):  # another order than the sends'
        for seq in range(3):
            got = _recv_now(pair, keys[k])
            dead = f"key #{k} recv #{seq}: is_dead should be {k == seq}, got {got.is_dead!r}"
            _expect(got.is_dead is (k == seq), dead)
            assert_same(got.value, np.array([k, seq], dtype=np.int64), f"key #{k} recv #{seq}")
    _expect_nothing(pair, keys[0], "3 sends, 3 recvs")


def check_waiters_fifo(pair: RendezvousPair) -> None:
    """Several receivers waiting on one key are served in the order they started."""
    key = _key(pair, "waiters")
    futures = [pair.consumer.recv_future(key) for _ in range(4)]
    for i in range(4):
        pair.producer.send(key, np.array([i], dtype=np.int16))
    for i, fut in enumerate(futures):
        assert_same(fut.result(WAIT_S).value, np.array([i], dtype=np.int16), f"waiter #{i}")


def check_values_round_trip(pair: RendezvousPair) -> None:
    """Every kind of value (``sample_values()``, 8 MiB, memmaps, matrices, record arrays)
    arrives as a plain ndarray with the same dtype, shape and bytes."""
    with tempfile.TemporaryFile() as f:
        mapped = np.memmap(f, dtype=np.float32, mode="w+", shape=(3, 5))
        mapped[:] = np.arange(15, dtype=np.float32).reshape(3, 5)
        values: dict[str, npt.NDArray[Any]] = {
            **sample_values(),
            "8 MiB float64": np.random.default_rng(20240611).standard_normal((1024, 1024)),
            "memmap": mapped,
            "memmap slice": mapped[1:, ::2],
            # A view: np.matrix() itself warns (PendingDeprecationWarning).
            "matrix": np.arange(4, dtype=np.int16).reshape(2, 2).view(np.matrix),
            "recarray": np.rec.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
        }
        keys = {what: _key(pair, "value") for what in values}
        for what, value in values.items():
            pair.producer.send(keys[what], value)
        pair.settle()
        for what, value in values.items():
            got = _recv_now(pair, keys[what]).value
            _expect(type(got) is np.ndarray, f"a {what} arrived as {type(got).__name__}")
            assert_same(got, np.asarray(value), what)


def check_unsendable_refused(pair: RendezvousPair) -> None:
    """send refuses arrays of Python objects and masked arrays (only the data would travel:
    the receiver would lose the mask silently) with InvalidArgumentError; nothing is queued."""
    key = _key(pair, "refused")
    refused = {  # what: (value, what the error must name)
        "object": (np.array([1, "two", None], dtype=object), ""),
        "object field": (np.array([(1, "x")], dtype=[("a", "<i4"), ("b", "O")]), ""),
        "masked": (np.ma.masked_array(np.arange(4.0), mask=[False, True, False, True]), "mask"),
    }
    for what, (value, named) in refused.items():
        try:
            pair.producer.send(key, value)
        except InvalidArgumentError as e:
            _expect(named in str(e), f"the refusal of an array ({what}) does not name {named}: {e}")
        else:
            raise AssertionError(f"send of an array ({what}) was accepted")
    _expect_nothing(pair, key, "refused sends")


def check_copy_true(pair: RendezvousPair) -> None:
    """``copy=True`` gives a writable array of its own, equal to what was sent."""
    key = _key(pair, "copy")
    sent = np.arange(16, dtype=np.int64)
    for _ in range(3):
        pair.producer.send(key, sent)
    pair.settle()
    a = _recv_now(pair, key, copy=True).value
    b = _recv_now(pair, key, copy=True).value
    c = pair.consumer.recv_future(key, copy=True).result(WAIT_S).value
    for name, arr in (("recv", a), ("recv (2nd)", b), ("recv_future", c)):
        assert_same(arr, sent, f"{name}(copy=True)")
        _expect(arr.flags.writeable, f"{name}(copy=True) returned a read-only array")
        _expect(not np.shares_memory(arr, sent), f"{name}(copy=True) shares the sent array")
    _expect(not np.shares_memory(a, b), "two copy=True receives share memory")
    a[:] = -1
    assert_same(b, sent, "a copy after writing to another")
    assert_same(sent, np.arange(16, dtype=np.int64), "the sent array after writing to a copy")


def check_abandoned_waiter_removed(pair: RendezvousPair) -> None:
    """A receive that timed out (DeadlineExceededError, promptly) or was cancelled leaves no
    waiter: the next send reaches the next recv. (TensorFlow leaves a timed-out waiter
    queued, and it swallows the next send.)"""

    async def expired_arecv(key: str) -> object:
        return await asyncio.wait_for(
            pair.consumer.arecv(key, timeout=EXPIRE_S), EXPIRE_S + PROMPT_S
        )

    def cancelled_future(key: str) -> None:
        fut = pair.consumer.recv_future(key)
        _expect(fut.cancel() is True, "cancel() of a waiting recv_future should return True")
        _expect(fut.cancelled(), "the future should report cancelled()")

    async def cancelled_arecv(key: str) -> None:
        task = asyncio.ensure_future(pair.consumer.arecv(key))
        await asyncio.sleep(SETTLE_S)  # let it start waiting
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        _expect(task.cancelled(), "the cancelled arecv task did not end cancelled")

    ways: list[tuple[str, Callable[[str], object], bool]] = [  # (what, abandon, expires)
        ("recv(timeout)", lambda key: pair.consumer.recv(key, timeout=EXPIRE_S), True),
        ("recv(timeout=0)", lambda key: pair.consumer.recv(key, timeout=0), True),
        ("arecv(timeout)", lambda key: asyncio.run(expired_arecv(key)), True),
        ("a cancelled recv_future", cancelled_future, False),
        ("a cancelled arecv", lambda key: asyncio.run(cancelled_arecv(key)), False),
    ]
    for n, (what, abandon, expires) in enumerate(ways):
        key = _key(pair, f"abandoned{n}")
        if expires:
            _expect_timeout(functools.partial(abandon, key), what)
        else:
            abandon(key)
        _send_then_recv(pair, key, np.array([n], dtype=np.int64), f"a send after {what}")


def check_every_way_to_receive(pair: RendezvousPair) -> None:
    """recv (blocked in a thread), recv_async (``done(None, Received)`` exactly once),
    recv_future and arecv (with and without a timeout) each get a value queued before they
    start, and one sent while they wait."""

    def by_recv(key: str, send: Callable[[], None]) -> object:
        blocked = _spawn(lambda: pair.consumer.recv(key, timeout=WAIT_S))
        time.sleep(SETTLE_S)  # let it block
        send()
        return blocked.result(WAIT_S + PROMPT_S)

    def by_done(key: str, send: Callable[[], None]) -> object:
        rec = _Recorder()
        pair.consumer.recv_async(key, rec.done)
        send()
        error, received = rec.only_call("recv_async")
        _expect(error is None, f"recv_async: done got error {error!r}")
        return received

    def by_future(key: str, send: Callable[[], None]) -> object:
        fut = pair.consumer.recv_future(key)
        send()
        return fut.result(WAIT_S)

    def by_await(key: str, send: Callable[[], None], timeout: float | None) -> object:
        async def main() -> object:
            task = asyncio.ensure_future(pair.consumer.arecv(key, timeout=timeout))
            await asyncio.sleep(SETTLE_S)  # let it start waiting
            send()
            return await asyncio.wait_for(task, WAIT_S + PROMPT_S)

        return asyncio.run(main())

    ways: dict[str, Callable[[str, Callable[[], None]], object]] = {
        "recv": by_recv,
        "recv_async": by_done,
        "recv_future": by_future,
        "arecv": functools.partial(by_await, timeout=None),
        "arecv(timeout)": functools.partial(by_await, timeout=WAIT_S),
    }
    for n, (what, receive) in enumerate(ways.items()):
        for order in ("queued", "later"):
            key, sent = _key(pair, f"way{n}_{order}"), np.arange(n + 2, dtype=np.int16)
            send = functools.partial(pair.producer.send, key, sent)
            if order == "queued":
                send()
                pair.settle()
            got = receive(key, send if order == "later" else lambda: None)
            if not isinstance(got, Received):
                raise AssertionError(f"{what} of a {order} value gave {got!r}, not a Received")
            assert_same(got.value, sent, f"{what} of a {order} value")


def check_done_exception_is_logged(pair: RendezvousPair) -> None:
    """An exception raised by ``done`` is logged under ``shmrdv``, not raised; traffic goes on."""
    key = _key(pair, "raising_done")
    token = _token("done-raised")
    called = threading.Event()

    def raising_done(error: BaseException | None, received: Received | None) -> None:
        called.set()
        raise RuntimeError(token)

    handler = logging.handlers.BufferingHandler(capacity=1 << 20)  # keeps every record
    logger = logging.getLogger("shmrdv")
    logger.addHandler(handler)
    try:
        pair.consumer.recv_async(key, raising_done)
        pair.producer.send(key, np.zeros(2))  # must not raise, whichever thread runs done
        _expect(called.wait(WAIT_S), f"done was not called within {WAIT_S}s")

        def logged() -> bool:
            return any(r.exc_info and token in str(r.exc_info[1]) for r in handler.buffer)

        deadline = time.monotonic() + WAIT_S
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.01)
        _expect(logged(), "the exception raised by done was not logged under 'shmrdv'")
    finally:
        logger.removeHandler(handler)
    _send_then_recv(pair, key, np.ones(2), "recv after a raising done")


def check_recv_future_lets_go(pair: RendezvousPair) -> None:
    """A future's value is freed once the caller drops it and the future, without the
    garbage collector: nothing of the receive keeps it (a shared-memory value holds its
    producer's pool slot until then)."""
    sent = np.arange(6, dtype=np.int32)
    enabled = gc.isenabled()
    gc.disable()  # a reference cycle would keep the value until a collection
    try:
        for order in ("queued", "later"):
            key = _key(pair, f"future_lets_go_{order}")
            # A copy that only the send holds: an in-process send may hand over the array.
            if order == "queued":
                pair.producer.send(key, sent.copy())
                pair.settle()
            fut = pair.consumer.recv_future(key)
            if order == "later":
                pair.producer.send(key, sent.copy())
            got = fut.result(WAIT_S)
            assert_same(got.value, sent, f"future of a {order} value")
            value = weakref.ref(got.value)
            del fut, got
            # The thread that completed the future may still be returning from it.
            deadline = time.monotonic() + PROMPT_S
            while value() is not None and time.monotonic() < deadline:
                time.sleep(0.005)
            _expect(
                value() is None,
                f"the value of a {order} recv_future is still referenced after the future "
                "and its result were dropped (a reference cycle, or a thread keeps it)",
            )
    finally:
        if enabled:
            gc.enable()


def check_abort_fails_pending(pair: RendezvousPair) -> None:
    """start_abort reaches a blocked recv, a pending recv_async and a future promptly."""
    token = _token("abort")
    k1, k2, k3 = (_key(pair, f"abort{i}") for i in range(3))
    blocked = _spawn(lambda: pair.consumer.recv(k1, timeout=WAIT_S))
    rec = _Recorder()
    pair.consumer.recv_async(k2, rec.done)
    fut = pair.consumer.recv_future(k3)
    time.sleep(SETTLE_S)  # let the thread block
    t0 = time.monotonic()
    pair.consumer.start_abort(AbortedError(f"aborted by the conformance suite ({token})"))
    error, received = rec.only_call("recv_async")
    _expect(received is None, f"recv_async: an error came with a value {received!r}")
    for what, got in (
        ("blocked recv", blocked.exception(PROMPT_S)),
        ("recv_async", error),
        ("recv_future", fut.exception(PROMPT_S)),
    ):
        _expect(_aborted(got, token), f"{what}: got {got!r}, not the abort error")
    took = time.monotonic() - t0
    _expect(took < PROMPT_S, f"the abort took {took:.2f}s to reach the waiters")


def check_abort_first_error_wins(pair: RendezvousPair) -> None:
    """After start_abort, receives fail at once with the first error; a second abort is ignored."""
    first, second = _token("first"), _token("second")
    pair.consumer.start_abort(AbortedError(f"first ({first})"))
    pair.consumer.start_abort(AbortedError(f"second ({second})"))
    for what, error in _failures(pair, _key(pair, "aborted")):
        _expect(_aborted(error, first), f"{what} after two aborts: {error!r}, not the first error")


def check_bad_key_reported(pair: RendezvousPair) -> None:
    """A malformed key is InvalidArgumentError: raised by recv, given to done and to the future."""
    for what, error in _failures(pair, "not a rendezvous key"):
        _expect(isinstance(error, InvalidArgumentError), f"{what} of a malformed key: {error!r}")


#: Every ``check_`` function above, in the order they are written.
CHECKS: list[Callable[[RendezvousPair], None]] = [
    check for name, check in list(globals().items()) if name.startswith("check_")
]


def run_conformance(
    make_pair: Callable[[], contextlib.AbstractContextManager[RendezvousPair]],
    checks: Iterable[Callable[[RendezvousPair], None]] | None = None,
) -> None:
    """Run every check (or those given), each on a fresh pair from ``make_pair()``; blocks.

    Then ``AssertionError`` lists the failures, chained to the first. Call it where no
    event loop runs: the asyncio checks use ``asyncio.run``.
    """
    failures: list[tuple[str, BaseException]] = []
    selected = list(CHECKS if checks is None else checks)
    for check in selected:
        try:
            with make_pair() as pair:
                check(pair)
        except Exception as e:
            failures.append((check.__name__, e))
    if failures:
        lines = "\n".join(f"  {name}: {type(e).__name__}: {e}" for name, e in failures)
        raise AssertionError(
            f"{len(failures)} of {len(selected)} conformance checks failed:\n{lines}"
        ) from failures[0][1]


def run_in_worker(
    task: str, fn: Callable[..., _T], *args: Any, timeout: float = 60.0, **worker_kwargs: Any
) -> _T:
    """``fn(worker, *args)`` run in a fresh child process holding a ``Worker(task,
    **worker_kwargs)``, which is closed before this returns; ``fn`` must be importable and
    its result pickle. Raises what ``fn`` raised."""
    with ChildWorker(task, reply_timeout=timeout, **worker_kwargs) as child:
        result: _T = child.call(fn, *args)
        return result
