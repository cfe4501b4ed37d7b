"""WaiterTable: per key a FIFO of values or of waiters, never both (shmrdv/_channels.py)."""

from __future__ import annotations

import random

import pytest

from shmrdv._channels import MISSING, WaiterTable


class W:
    """A waiter hashed by identity, as the table's users make them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"W({self.name})"


def counts(t: WaiterTable[str, object, W]) -> tuple[int, int, int]:
    return len(t), t.pending_values, t.pending_waiters


def test_waiters_values_queue_in_order_and_empty_keys_leave() -> None:
    t: WaiterTable[str, object, W] = WaiterTable()
    assert t.put("a", 1) is None
    assert t.put("a", 2) is None
    assert t.put("b", None) is None  # None is a value like any other
    assert counts(t) == (2, 3, 0)
    assert list(t) == ["a", "b"] and "a" in t
    assert t.values_of("a") == 2 and t.waiters_of("a") == 0
    assert t.take("a") == 1
    assert t.take("b") is None
    assert t.take("b") is MISSING and "b" not in t
    assert t.take("a") == 2
    assert t.take("a") is MISSING
    assert counts(t) == (0, 0, 0) and list(t) == []


def test_waiters_put_front_goes_before_older_values() -> None:
    t: WaiterTable[str, int, W] = WaiterTable()
    t.put("k", 2)
    t.put("k", 3)
    t.put("k", 1, front=True)
    assert [t.take("k") for _ in range(3)] == [1, 2, 3]
    t.put("k", 9, front=True)  # front on an empty key just queues
    assert t.take("k") == 9


def test_waiters_put_hands_value_to_oldest_waiter() -> None:
    t: WaiterTable[str, int, W] = WaiterTable()
    w1, w2 = W("1"), W("2")
    assert t.wait("k", w1) is True  # the only one: e.g. the one to start an RPC for
    assert t.wait("k", w2) is False
    assert counts(t) == (1, 0, 2) and t.waiters_of("k") == 2 and t.values_of("k") == 0
    assert t.head("k") is w1
    assert t.take("k") is MISSING  # waiters, no value
    assert t.put("k", 10) is w1
    assert t.head("k") is w2
    assert t.put("k", 11, front=True) is w2  # a waiter takes it wherever it would go
    assert counts(t) == (0, 0, 0) and t.head("k") is None


def test_waiters_cancel_reports_whether_it_removed() -> None:
    t: WaiterTable[str, int, W] = WaiterTable()
    w1, w2, w3 = W("1"), W("2"), W("3")
    for w in (w1, w2, w3):
        t.wait("k", w)
    assert t.cancel("k", w2) is True
    assert t.cancel("k", w2) is False  # already removed
    assert t.cancel("other", w1) is False  # not queued under that key
    assert t.put("k", 1) is w1
    assert t.cancel("k", w1) is False  # already served
    assert t.put("k", 2) is w3  # the cancelled one never gets a value
    assert t.put("k", 3) is None and t.take("k") == 3
    assert counts(t) == (0, 0, 0)
    assert t.cancel("k", w3) is False


def test_waiters_abort_returns_waiters_and_drops_values() -> None:
    t: WaiterTable[tuple[int, str], int, W] = WaiterTable()
    ws = [W(str(i)) for i in range(4)]
    t.wait((1, "a"), ws[0])
    t.wait((2, "b"), ws[1])
    t.wait((1, "a"), ws[2])
    t.put((1, "c"), 5)
    t.put((2, "d"), 6)
    t.wait((2, "e"), ws[3])
    assert counts(t) == (5, 2, 4)
    # One step only (a transport's abort_step).
    assert t.abort(lambda k: k[0] == 1) == [ws[0], ws[2]]
    assert counts(t) == (3, 1, 2) and list(t) == [(2, "b"), (2, "d"), (2, "e")]
    assert t.abort() == [ws[1], ws[3]]
    assert counts(t) == (0, 0, 0) and t.abort() == []
    assert t.cancel((2, "b"), ws[1]) is False  # handed out by abort


def test_waiters_wait_refuses_a_key_with_values_or_a_queued_waiter() -> None:
    t: WaiterTable[str, int, W] = WaiterTable()
    w = W("w")
    t.put("v", 1)
    with pytest.raises(ValueError, match="values are queued"):
        t.wait("v", w)
    t.wait("k", w)
    with pytest.raises(ValueError, match="already queued"):
        t.wait("k", w)
    assert counts(t) == (2, 1, 1)


def test_waiters_a_lone_waiter_and_the_second_one_keep_their_order() -> None:
    """A key's only waiter (kept bare), then a second one (both queued in order): served,
    cancelled, looked at and aborted like any others."""
    t: WaiterTable[str, int, W] = WaiterTable()
    a, b, c = W("a"), W("b"), W("c")
    assert t.wait("k", a) is True
    assert t.head("k") is a and t.waiters_of("k") == 1 and t.values_of("k") == 0
    assert t.take("k") is MISSING
    assert t.cancel("k", b) is False  # not queued: the lone waiter stays
    assert t.head("k") is a and counts(t) == (1, 0, 1)
    assert t.wait("k", b) is False
    assert t.head("k") is a and t.waiters_of("k") == 2
    assert t.put("k", 1) is a
    assert t.put("k", 2) is b
    assert "k" not in t and counts(t) == (0, 0, 0)
    t.wait("k", a)
    assert t.cancel("k", a) is True and t.cancel("k", a) is False
    assert "k" not in t and counts(t) == (0, 0, 0)
    t.wait("k", a)
    t.wait("k", b)
    assert t.cancel("k", a) is True
    assert t.head("k") is b and t.put("k", 3) is b and "k" not in t
    t.wait("k", c)
    t.wait("j", a)
    t.wait("j", b)
    assert t.abort(lambda key: key == "k") == [c] and counts(t) == (1, 0, 2)
    assert t.abort() == [a, b] and counts(t) == (0, 0, 0)


def test_waiters_match_a_reference_model() -> None:
    """Random operations against a list-based model: same answers, same counts."""
    rng = random.Random(18)
    t: WaiterTable[int, int, W] = WaiterTable()
    model: dict[int, tuple[list[int], list[W]]] = {}
    live: list[tuple[int, W]] = []
    for step in range(5_000):
        key = rng.randrange(5)
        values, waiters = model.setdefault(key, ([], []))
        op = rng.randrange(5)
        if op == 0:
            front = rng.random() < 0.2
            got = t.put(key, step, front=front)
            if waiters:
                assert got is waiters.pop(0)
            else:
                assert got is None
                values.insert(0 if front else len(values), step)
        elif op == 1:
            expected = values.pop(0) if values else MISSING
            assert t.take(key) == expected
        elif op == 2 and not values:
            w = W(str(step))
            assert t.wait(key, w) is (not waiters)
            waiters.append(w)
            live.append((key, w))
        elif op == 3 and live:
            k, w = live.pop(rng.randrange(len(live)))
            kv, kw = model.setdefault(k, ([], []))
            assert t.cancel(k, w) is (w in kw)
            if w in kw:
                kw.remove(w)
        elif op == 4 and rng.random() < 0.01:
            expected_w = [w for k in model for w in model[k][1] if k % 2 == 0]
            got_w = t.abort(lambda k: k % 2 == 0)
            assert sorted(map(id, got_w)) == sorted(map(id, expected_w))
            for k in model:
                if k % 2 == 0:
                    model[k] = ([], [])
        for k, (kv, kw) in model.items():
            assert not (kv and kw)
            assert t.values_of(k) == len(kv) and t.waiters_of(k) == len(kw)
            assert t.head(k) is (kw[0] if kw else None)
            assert (k in t) == bool(kv or kw)
        assert t.pending_values == sum(len(v) for v, _ in model.values())
        assert t.pending_waiters == sum(len(w) for _, w in model.values())
