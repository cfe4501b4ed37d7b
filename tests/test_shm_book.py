"""The shared-memory consumer's book: stash counts, touched channels, waiters per channel."""

from __future__ import annotations

import numpy as np

import shmrdv
from shmrdv._keys import parse_key
from shmrdv._received import Received
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
