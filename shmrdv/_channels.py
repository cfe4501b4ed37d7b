"""WaiterTable: per key, a FIFO of values not yet taken or of waiters not yet served.

The one rendezvous table of the library, after TensorFlow's ``LocalRendezvous``
(``core/framework/local_rendezvous.cc``): a key holds values or waiters, never both, and a
key with neither is not in the table. Unlike TensorFlow, a waiter is removed in O(1) and
then never takes a value, and keys are compared whole (not by ``Hash64``). The owner
completes what the table hands back after releasing its lock (STYLE.md rule 5). Waiters
hash by identity, are never ``None``, a ``deque`` or an ``OrderedDict``, and are queued
at most once at a time.

Thread model (``docs/threads.md``): no lock of its own; every call is made under its
owner's lock. Nothing here blocks or calls back.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from typing import Final, Generic, Literal, TypeVar

__all__ = ["MISSING", "Missing", "WaiterTable"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
W = TypeVar("W", bound=Hashable)


class Missing(enum.Enum):
    """The type of ``MISSING`` (an enum: ``is MISSING`` narrows for mypy)."""

    MISSING = "MISSING"

    def __repr__(self) -> str:
        return "MISSING"


#: What ``take`` returns when a key has no value queued (a value may itself be ``None``).
MISSING: Final = Missing.MISSING


class WaiterTable(Generic[K, V, W]):
    """Per key, a FIFO of values (``V``) or of waiters (``W``); O(1) but ``abort``."""

    __slots__ = ("_nvalues", "_nwaiters", "_table")

    def __init__(self) -> None:
        # A key maps to a deque of values, to its only waiter (bare: the common case, one
        # receive per key, makes no container), or to an OrderedDict of waiters used as an
        # ordered set (a cancelled waiter leaves in O(1), unlike ``deque.remove``); never to
        # an empty container. One dict for both keeps the keys in arrival order.
        self._table: dict[K, deque[V] | OrderedDict[W, None] | W] = {}
        self._nvalues = 0
        self._nwaiters = 0

    def put(self, key: K, value: V, *, front: bool = False) -> W | None:
        """The oldest waiter of ``key``, removed, for the caller to complete with ``value``;
        or ``None``, ``value`` queued at the back (``front``: at the head, for a value taken
        and given back, which keeps its place before later ones)."""
        queue = self._table.get(key)
        if queue is None:
            self._table[key] = deque((value,))
        elif isinstance(queue, deque):
            if front:
                queue.appendleft(value)
            else:
                queue.append(value)
        elif isinstance(queue, OrderedDict):
            waiter, _ = queue.popitem(last=False)
            if not queue:
                del self._table[key]
            self._nwaiters -= 1
            return waiter
        else:  # the key's only waiter
            del self._table[key]
            self._nwaiters -= 1
            return queue
        self._nvalues += 1
        return None

    def take(self, key: K) -> V | Literal[Missing.MISSING]:
        """Remove and return the oldest value of ``key``, or ``MISSING`` if none is queued."""
        queue = self._table.get(key)
        if not isinstance(queue, deque):
            return MISSING
        value = queue.popleft()
        if not queue:
            del self._table[key]
        self._nvalues -= 1
        return value

    def wait(self, key: K, waiter: W) -> bool:
        """Queue ``waiter`` (after ``take`` found nothing); True if it is the only one.
        ``ValueError`` if ``key`` has values queued or ``waiter`` is queued already."""
        queue = self._table.get(key)
        if queue is None:
            self._table[key] = waiter  # the only waiter: bare
            self._nwaiters += 1
            return True
        if isinstance(queue, deque):
            raise ValueError(f"wait({key!r}): values are queued; take one instead")
        if isinstance(queue, OrderedDict):
            if waiter in queue:
                raise ValueError(f"wait({key!r}): {waiter!r} is already queued")
            queue[waiter] = None
        else:  # a second waiter: both in an OrderedDict, the first one first
            if queue == waiter:
                raise ValueError(f"wait({key!r}): {waiter!r} is already queued")
            self._table[key] = OrderedDict(((queue, None), (waiter, None)))
        self._nwaiters += 1
        return False

    def cancel(self, key: K, waiter: W) -> bool:
        """Remove ``waiter`` from ``key``: True if it was queued (it will get nothing),
        False if ``put`` or ``abort`` handed it out already."""
        queue = self._table.get(key)
        if isinstance(queue, OrderedDict):
            if waiter not in queue:
                return False
            del queue[waiter]
            if not queue:
                del self._table[key]
        elif queue is None or isinstance(queue, deque) or queue != waiter:
            return False
        else:  # the key's only waiter
            del self._table[key]
        self._nwaiters -= 1
        return True

    def head(self, key: K) -> W | None:
        """The oldest waiter of ``key``, left in place, or ``None``."""
        queue = self._table.get(key)
        if queue is None or isinstance(queue, deque):
            return None
        if isinstance(queue, OrderedDict):
            return next(iter(queue))
        return queue

    def abort(self, where: Callable[[K], bool] | None = None) -> list[W]:
        """Empty the table, or the keys for which ``where(key)`` is true; their waiters,
        each key's oldest first, for the caller to fail; their values are dropped."""
        keys = list(self._table) if where is None else [k for k in self._table if where(k)]
        waiters: list[W] = []
        for key in keys:
            queue = self._table.pop(key)
            if isinstance(queue, deque):
                self._nvalues -= len(queue)
            elif isinstance(queue, OrderedDict):
                waiters.extend(queue)
                self._nwaiters -= len(queue)
            else:
                waiters.append(queue)
                self._nwaiters -= 1
        return waiters

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        return key in self._table

    def __iter__(self) -> Iterator[K]:
        """Keys with a value or a waiter queued, oldest first."""
        return iter(self._table)

    def values_of(self, key: K) -> int:
        queue = self._table.get(key)
        return len(queue) if isinstance(queue, deque) else 0

    def waiters_of(self, key: K) -> int:
        queue = self._table.get(key)
        if queue is None or isinstance(queue, deque):
            return 0
        return len(queue) if isinstance(queue, OrderedDict) else 1

    @property
    def pending_values(self) -> int:
        return self._nvalues

    @property
    def pending_waiters(self) -> int:
        return self._nwaiters

    def __repr__(self) -> str:
        return (
            f"<WaiterTable keys={len(self._table)} values={self._nvalues} waiters={self._nwaiters}>"
        )
