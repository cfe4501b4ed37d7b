"""A receive started before its producer's pick: its legs are real in-process tables."""

from __future__ import annotations

import functools
import gc
import logging
import threading
import weakref

import numpy as np
import pytest
from helpers import make_key

import shmrdv
from shmrdv._keys import parse_key
from shmrdv._rendezvous import Canceller, DoneCallback, LocalRendezvous
from shmrdv._routes import LegStarter, PickWatch, RaceRecv

KEY = make_key("raced")


class DoneRecorder:
    """A ``done`` that records its calls (in-process legs complete in the caller's thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple[BaseException | None, shmrdv.Received | None]] = []

    def done(self, error: BaseException | None, received: shmrdv.Received | None) -> None:
        self.calls.append((error, received))

    def only_call(self, what: str) -> tuple[BaseException | None, shmrdv.Received | None]:
        assert len(self.calls) == 1, f"{what}: done was called {len(self.calls)} times"
        return self.calls[0]


def leg(table: LocalRendezvous, done: DoneCallback) -> Canceller:
    return table.start_recv(parse_key(KEY), done)


def race_of(n: int) -> tuple[list[LocalRendezvous], DoneRecorder, RaceRecv]:
    tables = [LocalRendezvous() for _ in range(n)]
    rec = DoneRecorder()
    race = RaceRecv(rec.done, [functools.partial(leg, t) for t in tables], "key 'raced'")
    return tables, rec, race


def test_race_the_first_value_wins_and_the_other_legs_are_withdrawn() -> None:
    tables, rec, race = race_of(3)
    tables[1].send(KEY, np.arange(3))
    error, got = rec.only_call("the race")
    assert error is None and got is not None and got.value.tolist() == [0, 1, 2]
    # The other legs' waiters are gone: a later value there is kept, not swallowed.
    tables[0].send(KEY, np.arange(2))
    assert tables[0].recv(KEY, timeout=1).value.tolist() == [0, 1]
    assert not race()  # over: nothing to cancel
    for t in tables:
        t.close()


def test_race_a_value_already_there_starts_no_more_legs() -> None:
    first, second = LocalRendezvous(), LocalRendezvous()
    first.send(KEY, np.array([7]))
    rec = DoneRecorder()
    RaceRecv(rec.done, [functools.partial(leg, first), functools.partial(leg, second)], "k")
    assert rec.only_call("the race")[1].value.tolist() == [7]  # type: ignore[union-attr]
    assert second.stats()["pending_waiters"] == 0
    second.send(KEY, np.array([8]))
    assert second.recv(KEY, timeout=1).value.tolist() == [8]


def test_race_an_error_ends_it_only_when_every_leg_failed() -> None:
    tables, rec, race = race_of(2)
    tables[0].start_abort(shmrdv.AbortedError("first leg gone"))
    assert rec.calls == []  # the other leg may still deliver
    tables[1].start_abort(shmrdv.CancelledError("second leg gone"))
    error, got = rec.only_call("the race")
    assert isinstance(error, shmrdv.AbortedError) and "first leg gone" in str(error)
    assert got is None
    assert not race()


def test_race_an_error_then_a_value_delivers_the_value() -> None:
    tables, rec, _ = race_of(2)
    tables[0].start_abort(shmrdv.AbortedError("not up yet"))
    tables[1].send(KEY, np.array([5]))
    error, got = rec.only_call("the race")
    assert error is None and got is not None and got.value.tolist() == [5]


def test_race_cancel_withdraws_every_leg() -> None:
    tables, rec, race = race_of(2)
    assert race()
    assert not race()  # once
    for t in tables:
        t.send(KEY, np.array([1]))  # kept for a later receive, not swallowed
        assert t.recv(KEY, timeout=1).value.tolist() == [1]
    assert rec.calls == []


def test_race_a_second_value_is_reported_not_delivered(caplog: pytest.LogCaptureFixture) -> None:
    """A producer sends each value on one transport, so a second value cannot come from
    it; if a leg that could not be withdrawn delivers anyway, it is logged."""
    legs: list[DoneCallback] = []

    def start_keep(done: DoneCallback) -> Canceller:
        legs.append(done)
        return lambda: False  # a leg that cannot be withdrawn

    rec2 = DoneRecorder()
    RaceRecv(rec2.done, [start_keep, start_keep], "key 'twice'")
    with caplog.at_level(logging.ERROR, logger="shmrdv"):
        legs[0](None, shmrdv.Received(np.array([1]), False))
        legs[1](None, shmrdv.Received(np.array([2]), False))
    assert rec2.only_call("the race")[1].value.tolist() == [1]  # type: ignore[union-attr]
    assert "second value" in caplog.text


def test_race_a_leg_added_later_delivers() -> None:
    tables, rec, race = race_of(1)
    late = LocalRendezvous()
    assert race.add(functools.partial(leg, late))
    late.send(KEY, np.array([3]))
    assert rec.only_call("the race")[1].value.tolist() == [3]  # type: ignore[union-attr]
    assert tables[0].stats()["pending_waiters"] == 0  # the first leg was withdrawn
    assert not race.add(functools.partial(leg, LocalRendezvous()))  # over: nothing starts


def test_race_an_error_on_the_only_leg_ends_it() -> None:
    tables, rec, race = race_of(1)
    tables[0].start_abort(shmrdv.AbortedError("step gone"))
    error, got = rec.only_call("the race")
    assert isinstance(error, shmrdv.AbortedError) and got is None
    assert race.ended and not race.add(functools.partial(leg, LocalRendezvous()))


def test_race_fail_ends_it_and_withdraws_the_legs() -> None:
    tables, rec, race = race_of(1)
    race.fail(shmrdv.InvalidArgumentError("no transport reaches it"))
    error, got = rec.only_call("the race")
    assert isinstance(error, shmrdv.InvalidArgumentError) and got is None
    tables[0].send(KEY, np.array([1]))  # kept for a later receive, not swallowed
    assert tables[0].recv(KEY, timeout=1).value.tolist() == [1]


@pytest.mark.timeout(30)
def test_pick_watch_adds_the_pick_once_known_and_then_stops() -> None:
    """``pick`` says "not known" twice, then names a leg: the watch starts it, and its
    thread ends with nothing left to watch."""
    _, rec, race = race_of(1)
    late = LocalRendezvous()
    answers: list[tuple[LegStarter | None] | None] = [None, None, (functools.partial(leg, late),)]
    asked = threading.Event()

    def pick() -> tuple[LegStarter | None] | None:
        answer = answers.pop(0)
        if not answers:
            asked.set()
        return answer

    watch = PickWatch()
    watch.watch(race, pick)
    assert asked.wait(10)
    assert _pick_thread_ends()
    assert watch.watching() == 0
    late.send(KEY, np.array([9]))
    assert rec.only_call("the race")[1].value.tolist() == [9]  # type: ignore[union-attr]


def _pick_thread_ends() -> bool:
    for t in threading.enumerate():
        if t.name == "shmrdv-pick":
            t.join(5)
    return not any(t.name == "shmrdv-pick" for t in threading.enumerate())


@pytest.mark.timeout(30)
def test_pick_watch_fails_the_receive_when_the_pick_cannot_be_made() -> None:
    tables, rec, race = race_of(1)

    def pick() -> tuple[LegStarter | None] | None:
        raise shmrdv.InvalidArgumentError("none of this worker's transports reaches it")

    PickWatch().watch(race, pick)
    assert _pick_thread_ends()
    error, _ = rec.only_call("the race")
    assert isinstance(error, shmrdv.InvalidArgumentError)
    assert tables[0].stats()["pending_waiters"] == 0


@pytest.mark.timeout(30)
def test_pick_watch_drops_a_receive_that_ended() -> None:
    _, rec, race = race_of(1)
    asked: list[int] = []

    def pick() -> tuple[LegStarter | None] | None:
        asked.append(1)
        return None  # never known

    watch = PickWatch()
    watch.watch(race, pick)
    assert race()  # cancelled: the watch lets it go
    assert _pick_thread_ends()
    assert watch.watching() == 0
    assert rec.calls == []


class _SlotWithRace:
    """A receive's slot as the router makes one: it keeps its race (to cancel it) and the
    race calls its ``done``: a reference cycle while the race runs."""

    def __init__(self) -> None:
        self.race: RaceRecv | None = None
        self.got: shmrdv.Received | None = None

    def done(self, error: BaseException | None, received: shmrdv.Received | None) -> None:
        self.got = received


def test_race_ended_holds_no_cycle_that_keeps_its_value() -> None:
    # A value holds its producer's pool slot until it is dropped: once the race has ended,
    # dropping the slot must free the value at once, not at the next full collection.
    gc.disable()
    try:
        tables = [LocalRendezvous() for _ in range(2)]
        slot = _SlotWithRace()
        slot.race = RaceRecv(slot.done, [functools.partial(leg, t) for t in tables], "k")
        tables[1].send(KEY, np.arange(3.0))
        assert slot.got is not None
        value = weakref.ref(slot.got.value)
        del slot
        assert value() is None, "the ended race keeps its value in a reference cycle"
        for t in tables:
            t.close()
    finally:
        gc.enable()
