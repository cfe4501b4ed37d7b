"""The conformance battery (shmrdv.testing) over the in-process reference, LocalRendezvous.

Every check runs as its own test on a fresh pair whose producer and consumer are one
LocalRendezvous. The checks must also be able to fail: each deliberately broken
rendezvous below is caught by the check written for that behaviour.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from helpers import PRODUCER, make_key

from shmrdv._channels import MISSING
from shmrdv._keys import ParsedKey
from shmrdv._rendezvous import Canceller, DoneCallback, LocalRendezvous, Received
from shmrdv.testing import CHECKS, RendezvousPair, run_conformance


def local_key(edge: str) -> str:
    """A key from the producer task's CPU to itself: one LocalRendezvous is both ends."""
    return make_key(edge, dst=PRODUCER, incarnation=1)


@contextmanager
def local_pair(rdv: LocalRendezvous | None = None) -> Iterator[RendezvousPair]:
    with rdv or LocalRendezvous() as r:
        yield RendezvousPair(producer=r, consumer=r, make_key=local_key)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance_local_check(check: Callable[[RendezvousPair], None]) -> None:
    with local_pair() as pair:
        check(pair)


def test_conformance_run_all_passes() -> None:
    run_conformance(local_pair)


def test_conformance_names_are_unique_checks() -> None:
    names = [c.__name__ for c in CHECKS]
    assert len(set(names)) == len(names)
    assert all(n.startswith("check_") and c.__doc__ for n, c in zip(names, CHECKS))


# -- mutants: each breaks one behaviour, and the check for it must notice -----------------


class _Lifo(LocalRendezvous):
    """Hands out the newest value instead of the oldest."""

    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        super().send(key, value, is_dead=is_dead)
        with self._lock:
            values = []
            while (got := self._table.take(str(key))) is not MISSING:
                values.append(got)
            for value_dead in values[-1:] + values[:-1]:
                self._table.put(str(key), value_dead)


class _DropsDead(LocalRendezvous):
    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        super().send(key, value, is_dead=False)


class _KeepsTimedOutWaiters(LocalRendezvous):
    """TensorFlow's trap: the canceller claims success but leaves the waiter queued."""

    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        super().start_recv(key, done, copy=copy, blocking=blocking)
        return lambda: True


class _KeepsDone(LocalRendezvous):
    """Keeps every ``done`` it was given (and so each future with its value)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[DoneCallback] = []

    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        self.kept.append(done)
        return super().start_recv(key, done, copy=copy, blocking=blocking)


class _IgnoresCopy(LocalRendezvous):
    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        return super().start_recv(key, done, copy=False, blocking=blocking)


class _AcceptsObjects(LocalRendezvous):
    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        if isinstance(value, np.ndarray) and value.dtype.hasobject:
            with self._lock:
                self._table.put(str(key), (value, is_dead))
            return
        super().send(key, value, is_dead=is_dead)


class _AcceptsMasked(LocalRendezvous):
    """Sends a masked array's data, as shmrdv did before (issue 20 §4)."""

    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        super().send(key, np.ma.getdata(value), is_dead=is_dead)


class _KeepsSubclass(LocalRendezvous):
    """Hands the sent object itself to the receiver, subclass and all."""

    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        with self._lock:
            self._table.put(str(key), (value, is_dead))


class _AbortForgetsWaiters(LocalRendezvous):
    def start_abort(self, error: BaseException) -> None:
        with self._lock:
            self._table.abort()
        super().start_abort(error)


class _LastErrorWins(LocalRendezvous):
    def start_abort(self, error: BaseException) -> None:
        self._error = None
        super().start_abort(error)


class _SlowAfterAbort(LocalRendezvous):
    """Fails a receive of an aborted rendezvous only once its timeout has passed."""

    def recv(
        self, key: str | ParsedKey, *, timeout: float | None = None, copy: bool = False
    ) -> Received:
        if self._error is not None and timeout is not None:
            time.sleep(timeout)
        return super().recv(key, timeout=timeout, copy=copy)


class _CorruptsLarge(LocalRendezvous):
    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        if isinstance(value, np.ndarray) and value.nbytes > 1 << 20:
            value = value.copy()
            value.flat[-1] += 1
        super().send(key, value, is_dead=is_dead)


class _LosesStructure(LocalRendezvous):
    """Sends raw bytes, as a careless transport might."""

    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        if isinstance(value, np.ndarray) and value.dtype.names is not None:
            value = np.frombuffer(value.tobytes(), dtype=np.uint8)
        super().send(key, value, is_dead=is_dead)


def _check(name: str) -> Callable[[RendezvousPair], None]:
    return next(c for c in CHECKS if c.__name__ == name)


@pytest.mark.parametrize(
    ("mutant", "check_name"),
    [
        (_Lifo, "check_fifo_channel"),
        (_DropsDead, "check_fifo_channel"),
        (_KeepsTimedOutWaiters, "check_abandoned_waiter_removed"),
        (_KeepsDone, "check_recv_future_lets_go"),
        (_IgnoresCopy, "check_copy_true"),
        (_AcceptsObjects, "check_unsendable_refused"),
        (_AcceptsMasked, "check_unsendable_refused"),
        (_KeepsSubclass, "check_values_round_trip"),
        (_AbortForgetsWaiters, "check_abort_fails_pending"),
        (_LastErrorWins, "check_abort_first_error_wins"),
        (_SlowAfterAbort, "check_abort_first_error_wins"),
        (_CorruptsLarge, "check_values_round_trip"),
        (_LosesStructure, "check_values_round_trip"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else v,
)
def test_conformance_check_catches_mutant(
    mutant: type[LocalRendezvous], check_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shorter waits: a mutant makes the checks wait for things that never come.
    monkeypatch.setattr("shmrdv.testing.WAIT_S", 0.5)
    monkeypatch.setattr("shmrdv.testing.PROMPT_S", 0.5)
    with pytest.raises(AssertionError, match=check_name):
        run_conformance(lambda: local_pair(mutant()), [_check(check_name)])
