"""What the conformance checks are made of: fresh keys, bounded receives and waits, a
thread per blocked receive, a recorder of ``done`` calls, a log catcher.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from .._errors import DeadlineExceededError
from .._rendezvous import Received
from .pair import EXPIRE_S, PROMPT_S, SETTLE_S, WAIT_S, RendezvousPair
from .values import expect

__all__ = [
    "ListHandler",
    "Recorder",
    "expect_nothing",
    "expect_timeout",
    "is_error",
    "new_key",
    "recv_now",
    "spawn",
]

_T = TypeVar("_T")


def _edge(label: str) -> str:
    """A fresh edge name, so no check ever sees another's leftovers."""
    return f"conformance_{label}_{uuid.uuid4().hex[:12]}"


def new_key(pair: RendezvousPair, label: str) -> str:
    return pair.make_key(_edge(label))


def recv_now(pair: RendezvousPair, key: str, *, copy: bool = False) -> Received:
    """Receive a value that must arrive within ``WAIT_S``."""
    try:
        got = pair.consumer.recv(key, timeout=WAIT_S, copy=copy)
    except DeadlineExceededError as e:
        raise AssertionError(f"no value arrived for {key!r} within {WAIT_S}s") from e
    expect(isinstance(got, Received), f"recv returned {type(got).__name__}, not Received")
    return got


def expect_nothing(pair: RendezvousPair, key: str, why: str) -> None:
    """After ``settle()``, a receive of ``key`` must time out: nothing is queued."""
    pair.settle()
    try:
        got = pair.consumer.recv(key, timeout=EXPIRE_S)
    except DeadlineExceededError:
        return
    raise AssertionError(f"{why}: expected nothing queued for {key!r}, but received {got!r}")


def expect_timeout(call: Callable[[], object], what: str) -> None:
    """``call()`` must raise ``DeadlineExceededError`` (a ``TimeoutError``), promptly."""
    t0 = time.monotonic()
    try:
        got = call()
    except DeadlineExceededError as e:
        elapsed = time.monotonic() - t0
        expect(isinstance(e, TimeoutError), f"{what}: DeadlineExceededError is not a TimeoutError")
        expect(
            elapsed < EXPIRE_S + PROMPT_S,
            f"{what}: a {EXPIRE_S}s timeout took {elapsed:.2f}s to expire",
        )
        return
    raise AssertionError(f"{what}: expected DeadlineExceededError, got {got!r}")


def spawn(fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
    """Run ``fn`` in a daemon thread; its outcome in a Future (waits on it are bounded)."""
    fut: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name="shmrdv-conformance", daemon=True).start()
    return fut


class Recorder:
    """A ``done`` callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[BaseException | None, Received | None]] = []
        self.event = threading.Event()
        self._lock = threading.Lock()

    def done(self, error: BaseException | None, received: Received | None) -> None:
        with self._lock:
            self.calls.append((error, received))
        self.event.set()

    def only_call(self, what: str) -> tuple[BaseException | None, Received | None]:
        """Wait for the call, then make sure no second one follows shortly."""
        expect(self.event.wait(WAIT_S), f"{what}: done was not called within {WAIT_S}s")
        time.sleep(SETTLE_S)
        with self._lock:
            calls = list(self.calls)
        expect(len(calls) == 1, f"{what}: done was called {len(calls)} times, not once")
        return calls[0]


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def is_error(error: BaseException | None, cls: type[BaseException], token: str) -> bool:
    """``error`` is the one given to ``start_abort``: its class, its message."""
    return isinstance(error, cls) and token in str(error)
