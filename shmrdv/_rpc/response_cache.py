"""The server's response cache by request_id (TensorFlow: ``GrpcResponseCache``).

A call with a non-zero ``request_id`` registers its ``Waiter`` here under
``(request_id, step_id, key)``. A duplicate that arrives while the first is waiting joins
it; one that arrives after the value was delivered gets the same value again for ``ttl``
seconds (bounded in count and bytes), so a response lost on the wire is not a lost
tensor. TensorFlow answers such a retry with ``ABORTED`` (``RecentRequestIds``), and
pytorch/xla#4084 shows that kills jobs; a request_id answered and no longer cached gets
``ABORTED`` here too. Acks (``finished``), releases (a client gave an id up) and ``drop_step`` remove entries
early; an ack or release costs O(1) (a request_id index), expiry walks the delivered
entries oldest first and stops at the first that is not due.

Thread model (docs/threads.md): none of its own. It belongs to the server's event loop and is touched only
from there, so it needs no lock. An entry it drops is handed to ``give_back`` (the
``Waits``': a value no call delivered goes back to its key), called synchronously.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable

from .._errors import AbortedError
from .._keys import ParsedKey
from .._rendezvous import Canceller, Received

__all__ = ["CacheKey", "ResponseCache", "Waiter"]

CacheKey = tuple[int, int, str]  # (request_id, step_id, full key)

# TensorFlow: RecentRequestIds remembers the last 100,000 request ids.
_ANSWERED_IDS = 100_000


@dataclasses.dataclass(eq=False)
class Waiter:
    """One ``serve_recv`` in progress or delivered, shared by calls with its request_id."""

    cache_key: CacheKey | None  # None: request_id 0, never shared or cached
    future: asyncio.Future[Received]
    step_id: int
    key: ParsedKey
    canceller: Canceller | None = None
    joiners: int = 0
    send_start_micros: int = 0
    nbytes: int = 0
    expires: float = 0.0
    serving: int = 0  # calls sending this value now
    writing: int = 0  # unary calls that handed it to gRPC and have not ended yet
    sent: bool = False  # a call handed the whole response to gRPC
    given_back: bool = False  # returned to the source with requeue
    reported: bool = False  # the source was told the service is done with it (done_with)
    # The client cancelled before taking any data (a release): whatever the stream
    # wrote went nowhere, so the value goes back even if every chunk was written.
    released: bool = False
    # RecvTensor found it larger than the client's inline_max and left it for the
    # client's RecvTensorStream: never evicted for room (only expiry or a release give
    # it back).
    deferred: bool = False
    # The calls waiting for the value, each on a future of its own (``waits``).
    calls: set[asyncio.Future[bool]] = dataclasses.field(default_factory=set)


class ResponseCache:
    """Waiters by request_id, and the delivered values kept for retries.

    Args:
        ttl: seconds a delivered value stays for a retry.
        entries, max_bytes: most delivered values kept, and their bytes (oldest go first).
        give_back: called with each dropped entry whose value may need to go back.
        where: the task name, for error messages.
    """

    def __init__(
        self,
        *,
        ttl: float,
        entries: int,
        max_bytes: int,
        give_back: Callable[[Waiter], None],
        where: str,
    ) -> None:
        self.ttl = float(ttl)
        self._entries = int(entries)
        self._max_bytes = int(max_bytes)
        self._give_back = give_back
        self._where = where
        self._cache: OrderedDict[CacheKey, Waiter] = OrderedDict()  # by request_id, oldest first
        self._by_rid: dict[int, list[CacheKey]] = {}  # request_id -> its cache keys (O(1) acks)
        # Entries holding a delivered value, oldest first (= first to expire).
        self._delivered: OrderedDict[CacheKey, None] = OrderedDict()
        self._cached_bytes = 0
        self._answered: OrderedDict[int, None] = OrderedDict()  # request_ids given a value
        self._released: OrderedDict[int, None] = OrderedDict()  # request_ids given up

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, cache_key: CacheKey) -> bool:
        return cache_key in self._cache

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def find(self, request_id: int, step_id: int, key: ParsedKey) -> Waiter | CacheKey | None:
        """The waiter of this request, or the cache key a new one is to be added under,
        or None (request_id 0, or one the client gave up: never cached).

        Raises ``AbortedError`` for a request_id already answered and no longer cached.
        """
        if request_id == 0:
            return None
        cache_key = (request_id, step_id, key.full_key)
        self.expire()
        found = self._cache.get(cache_key)
        if found is not None:
            return found
        if request_id in self._released:
            return None  # the client gave this id up: never cache under it
        if request_id in self._answered:
            # TensorFlow (RecentRequestIds) answers every repeated id so: without it a
            # retry would wait for, and steal, the key's next value.
            raise AbortedError(
                f"RecvTensor request_id {request_id} for key {key.full_key!r} (step "
                f"{step_id}) was already answered on {self._where} and its "
                "response is no longer cached; the value cannot be sent again"
            )
        return cache_key

    def add(self, waiter: Waiter) -> None:
        """Register a new ``waiter`` (with a cache key) for calls that repeat its id."""
        cache_key = waiter.cache_key
        assert cache_key is not None
        self._cache[cache_key] = waiter
        self._by_rid.setdefault(cache_key[0], []).append(cache_key)

    def delivered(self, waiter: Waiter, nbytes: int, now: float) -> bool:
        """``waiter`` has its value: keep it for retries for ``ttl``. True if it is kept
        (the caller then schedules an ``expire`` for a cache that sees no lookups)."""
        cache_key = waiter.cache_key
        if cache_key is None:
            return False
        self._answered[cache_key[0]] = None
        if len(self._answered) > _ANSWERED_IDS:
            self._answered.popitem(last=False)
        if cache_key not in self._cache:
            return False
        waiter.nbytes = nbytes
        waiter.expires = now + self.ttl
        self._cache.move_to_end(cache_key)
        self._delivered[cache_key] = None
        self._cached_bytes += nbytes
        self.evict(now)
        return True

    def finished(self, rid: int) -> None:
        """The client has the response of request ``rid``: drop it from the cache."""
        if rid:
            for ck in self._cached_for(rid):
                self._cache[ck].sent = True
                self.uncache(ck)

    def release(self, rid: int) -> None:
        """The client gave request ``rid`` up: a value taken for it and not delivered goes
        back to its key (now, or when the call serving it ends)."""
        if rid:
            self._released[rid] = None
            if len(self._released) > _ANSWERED_IDS:
                self._released.popitem(last=False)
            for ck in self._cached_for(rid):
                self._cache[ck].released = True
                self.uncache(ck)

    def drop_step(self, step_id: int) -> None:
        """Forget the entries of ``step_id`` (TensorFlow: on CleanupGraph)."""
        for ck in [ck for ck in self._cache if ck[1] == step_id]:
            self.uncache(ck, give_back=False)  # the step is gone: nothing to give back to

    def clear(self) -> None:
        """Forget every entry (the server is stopping; nothing is given back)."""
        self._cache.clear()
        self._by_rid.clear()
        self._delivered.clear()
        self._cached_bytes = 0

    def uncache(self, cache_key: CacheKey, *, give_back: bool = True) -> None:
        waiter = self.pop(cache_key)
        if waiter is not None and waiter.future.done():
            self._cached_bytes -= waiter.nbytes
            waiter.nbytes = 0
            if give_back:
                self._give_back(waiter)

    def pop(self, cache_key: CacheKey) -> Waiter | None:
        """Remove ``cache_key``'s entry without giving its value back; the entry or None."""
        waiter = self._cache.pop(cache_key, None)
        self._delivered.pop(cache_key, None)
        if waiter is not None:
            keys = self._by_rid.get(cache_key[0])
            if keys is not None:
                keys.remove(cache_key)
                if not keys:
                    del self._by_rid[cache_key[0]]
        return waiter

    def _cached_for(self, rid: int) -> list[CacheKey]:
        """The cache keys of request ``rid`` (a copy; O(1), not a scan of the cache)."""
        return list(self._by_rid.get(rid, ()))

    def expire(self, now: float | None = None) -> None:
        """Drop delivered entries whose time is up: the oldest first, stopping at the first
        that is not (they expire in the order they were delivered): O(1) per call."""
        now = time.monotonic() if now is None else now
        while self._delivered:
            ck = next(iter(self._delivered))
            waiter = self._cache.get(ck)
            if waiter is None:
                del self._delivered[ck]
            elif waiter.expires > now:
                return
            else:
                self.uncache(ck)

    def evict(self, now: float | None = None) -> None:
        """Drop the oldest delivered entries beyond the count or byte budget (waiting calls
        are bounded on their own: ``max_waiting``)."""
        self.expire(now)
        if len(self._delivered) <= self._entries and self._cached_bytes <= self._max_bytes:
            return
        # Not one a call is still answering, nor one left for the client's stream.
        for ck in list(self._delivered):
            if len(self._delivered) <= self._entries and self._cached_bytes <= self._max_bytes:
                break
            w = self._cache.get(ck)
            if w is not None and not (w.deferred or w.joiners or w.serving or w.writing):
                self.uncache(ck)
