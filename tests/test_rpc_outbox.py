"""The outbox's table and window accounting, without a server: a value a call took counts
until the server says it was delivered (``release``), a ``requeue`` puts it back at the
head of its key and counts it again, a cleaned-up step returns what it held, and a send
that meets a parked taker hands it the value."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from helpers import PRODUCER, make_key

from shmrdv._cluster import Peers
from shmrdv._errors import AbortedError, ResourceExhaustedError
from shmrdv._keys import parse_key
from shmrdv._rpc.messages import Assembly
from shmrdv._rpc.outbox import Outbox, Sent, Taker
from shmrdv._shm.transport import ShmBoard


class _Taker(Taker):
    def __init__(self) -> None:
        self.got: list[tuple[Sent | None, BaseException | None]] = []

    def settle(self, sent: Sent | None, error: BaseException | None) -> None:
        self.got.append((sent, error))


def _value(sent: Sent | None) -> list[int]:
    assert sent is not None
    got = Assembly().feed(sent.encoded.chunks[0])
    assert got is not None
    return list(got.value.tolist())


@pytest.fixture
def outbox(ns: str) -> Iterator[Outbox]:
    peers = Peers(ShmBoard(ns), None)
    box = Outbox(PRODUCER, 1, peers=peers, max_inflight_bytes=1000)
    yield box
    box.close()
    peers.close()


def test_outbox_window_counts_a_value_until_it_is_delivered(outbox: Outbox) -> None:
    pk = parse_key(make_key("w"))
    outbox.send(5, pk, np.zeros(600, np.uint8), False, None)
    outbox.send(5, pk, np.ones(400, np.uint8), False, None)
    assert outbox.stats()["inflight_bytes"] == 1000
    with pytest.raises(ResourceExhaustedError, match="max_inflight_bytes=1000"):
        outbox.send(5, pk, np.ones(1, np.uint8), False, 0.05)
    assert outbox.stats()["window_waits"] == 1
    taken = outbox.take(5, pk, None)
    assert taken is not None and taken.encoded.nbytes == 600
    assert outbox.stats()["inflight_bytes"] == 1000  # taken, not delivered: still counts
    outbox.release(taken)  # its call ended: delivered
    outbox.release(taken)  # once only
    assert outbox.stats()["inflight_bytes"] == 400
    outbox.requeue(taken)  # a client gave it back: in flight again, at the head, no wait
    assert outbox.stats()["inflight_bytes"] == 1000
    assert _value(outbox.take(5, pk, None)) == [0] * 600
    outbox.abort_step(5, AbortedError("Cleanup 5"))
    outbox.cleanup_step(5)
    assert outbox.stats()["inflight_bytes"] == 0
    outbox.release(taken)  # a late report of a cleaned-up step gives back nothing
    outbox.send(6, pk, np.ones(1000, np.uint8), False, 0.05)  # the whole window again
    assert outbox.stats()["inflight_bytes"] == 1000


def test_outbox_send_hands_a_value_to_a_parked_taker_in_order(outbox: Outbox) -> None:
    pk = parse_key(make_key("p"))
    first, second = _Taker(), _Taker()
    assert outbox.take(1, pk, first) is None and outbox.take(1, pk, second) is None
    assert outbox.stats()["outbox_parked"] == 2
    assert outbox.cancel(1, pk, second)  # unparked: it gets nothing
    outbox.send(1, pk, np.array([1]), False, None)
    outbox.send(1, pk, np.array([2]), False, None)
    assert len(first.got) == 1 and _value(first.got[0][0]) == [1] and second.got == []
    assert _value(outbox.take(1, pk, None)) == [2]


def test_outbox_abort_fails_parked_takers_and_refuses_later_calls(outbox: Outbox) -> None:
    pk = parse_key(make_key("a"))
    taker = _Taker()
    outbox.take(3, pk, taker)
    outbox.abort_step(3, AbortedError("Cleanup 3"))
    assert isinstance(taker.got[0][1], AbortedError)
    with pytest.raises(AbortedError):
        outbox.send(3, pk, np.array([1]), False, None)
    with pytest.raises(AbortedError):
        outbox.take(3, pk, None)


def test_outbox_request_for_a_cleaned_up_step_fails_at_once() -> None:
    box = Outbox(PRODUCER, 1, cleaned_up=lambda step: step == 9)
    with pytest.raises(AbortedError, match="Cleanup 9"):
        box.take(9, parse_key(make_key("c")), _Taker())
    box.close()
