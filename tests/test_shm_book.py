"""The shared-memory consumer's book: stash counts, touched channels, waiters per channel,
idle channels (message 0 of a key with no ``Channel``, end to end)."""

from __future__ import annotations

import numpy as np
import pytest

import shmrdv
from shmrdv._keys import parse_key
from shmrdv._rendezvous import Received
from shmrdv._shm.book import Book, Notice, Waiter

_SRC = "/job:a/replica:0/task:0/device:CPU:0"
_DST = "/job:a/replica:0/task:1/device:CPU:0"


def _key(name: str) -> str:
    return shmrdv.create_key(_SRC, 1, _DST, name)


def _value() -> Received:
    return Received(np.arange(3, dtype=np.float32))


def _done(error: BaseException | None, received: Received | None) -> None:
    raise AssertionError("never called by the book")


def test_book_source_is_one_per_producer_task() -> None:
    book = Book()
    a = book.source(parse_key(_key("x")))
    b = book.source(parse_key(_key("y")))
    assert a is b and a.task == "/job:a/replica:0/task:0" and a is book.source_named(a.task)


def test_book_put_counts_once_and_touches_only_waiting_channels() -> None:
    book = Book()
    src = book.source(parse_key(_key("x")))
    ch = book.channel(1, _key("x"), src, 7)
    assert book.channel(1, _key("x"), src, 7) is ch
    assert book.put(ch, 7, 0, _value()) is True
    assert book.put(ch, 7, 0, Notice(-1)) is False  # the first arrival stays
    assert ch.nready == 1 and book.touched == []
    waiter = Waiter(_done, False, ch, True)
    assert book.waiters.wait(ch, waiter)
    src.waiting[ch] = None
    assert book.put(ch, 7, 1, _value()) is True
    assert ch.nready == 2 and book.touched == [ch]
    assert isinstance(book.stash[1][(_key("x"), 7, 0)], Received)


def test_book_next_stashed_skips_to_the_lowest_later_sequence() -> None:
    book = Book()
    src = book.source(parse_key(_key("x")))
    ch = book.channel(2, _key("x"), src, 7)
    for seq in (5, 3, 9):
        book.put(ch, 7, seq, _value())
    book.put(book.channel(2, _key("y"), src, 7), 7, 1, _value())  # another key
    assert book.next_stashed(ch) == 3
    ch.seq = 3
    assert book.next_stashed(ch) == 5
    ch.seq = 9
    assert book.next_stashed(ch) is None


def test_book_drop_stashed_and_adopt_incarnation() -> None:
    book = Book()
    src = book.source(parse_key(_key("x")))
    ch = book.channel(3, _key("x"), src, 0)
    book.put(ch, 11, 0, Notice(4))
    book.adopt_incarnation(ch)
    assert ch.inc == 11
    book.drop_stashed(ch)  # taken by its name meanwhile
    assert ch.nready == 0 and book.stash[3] == {}
    book.drop_stashed(ch)  # nothing left: no change
    assert ch.nready == 0


def test_book_waiters_are_per_channel_oldest_first() -> None:
    book = Book()
    src = book.source(parse_key(_key("x")))
    ch, other = book.channel(1, _key("x"), src, 7), book.channel(1, _key("y"), src, 7)
    first, second = Waiter(_done, False, ch, True), Waiter(_done, True, ch, False)
    assert book.waiters.wait(ch, first) and not book.waiters.wait(ch, second)
    assert book.waiters.wait(other, Waiter(_done, False, other, True))
    assert book.waiters.cancel(ch, first) and not book.waiters.cancel(ch, first)
    assert book.waiters.put(ch, _value()) is second
    assert ch not in book.waiters and other in book.waiters


# -- idle channels, end to end: two workers of this process, a real ring between them ------


def _live_key(name: str) -> str:
    """A key of ``name`` that does not pin the producer's incarnation."""
    return shmrdv.create_key(_SRC, 0, _DST, name)


def _pair(ns: str) -> tuple[shmrdv.Worker, shmrdv.Worker]:
    return shmrdv.Worker(_SRC.rsplit("/", 1)[0], namespace=ns), shmrdv.Worker(
        _DST.rsplit("/", 1)[0], namespace=ns
    )


def test_book_idle_channel_takes_message_0_then_follows_its_key(ns: str) -> None:
    """Message 0 of a key is taken from its idle entry; the key's later messages, sent
    after it was taken or before, arrive in order, and a second key's two messages sent
    before any receive too. The consumer counts one channel per (step, key) whatever its
    form, none after cleanup."""
    wp, wc = _pair(ns)
    with wp, wc:
        rp, rc = wp.rendezvous(5), wc.rendezvous(5)
        rp.send(_live_key("x"), np.arange(3, dtype=np.int32))
        assert rc.recv(_live_key("x"), timeout=10).value.tolist() == [0, 1, 2]
        for i in (1, 2):
            rp.send(_live_key("x"), np.full(3, i, dtype=np.int32))
        rp.send(_live_key("y"), np.full(2, 7, dtype=np.int16))
        rp.send(_live_key("y"), np.full(2, 8, dtype=np.int16))
        assert rc.recv(_live_key("x"), timeout=10).value.tolist() == [1, 1, 1]
        assert rc.recv(_live_key("y"), timeout=10).value.tolist() == [7, 7]
        assert rc.recv(_live_key("x"), timeout=10).value.tolist() == [2, 2, 2]
        assert rc.recv(_live_key("y"), timeout=10).value.tolist() == [8, 8]
        with pytest.raises(shmrdv.DeadlineExceededError):
            rc.recv(_live_key("x"), timeout=0.05)
        stats = wc.stats()["shm"]
        assert stats["channels"] == 2 and stats["received"] == 5, stats
        wp.cleanup(5)
        wc.cleanup(5)
        assert wc.stats()["shm"]["channels"] == 0


def test_book_idle_channel_serves_a_key_pinned_to_its_producer_run(ns: str) -> None:
    """A key that names its producer's incarnation takes message 0 from the idle entry;
    one that waits first is served when the record comes; dead values stay dead."""
    wp, wc = _pair(ns)
    with wp, wc:
        rp, rc = wp.rendezvous(6), wc.rendezvous(6)
        pinned = shmrdv.create_key(_SRC, wp.incarnation, _DST, "pinned")
        rp.send(pinned, np.arange(4, dtype=np.float64))
        assert rc.recv(pinned, timeout=10).value.tolist() == [0.0, 1.0, 2.0, 3.0]
        fut = rc.recv_future(_live_key("later"))
        rp.send(_live_key("later"), np.ones(2, dtype=np.uint8), is_dead=True)
        got = fut.result(10)
        assert got.is_dead and got.value.tolist() == [1, 1]
        rp.send(_live_key("dead"), np.zeros(1, dtype=np.uint8), is_dead=True)
        assert rc.recv(_live_key("dead"), timeout=10).is_dead
        wp.cleanup(6)
        wc.cleanup(6)
