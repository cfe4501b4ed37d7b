"""Backpressure: the bytes a producer has sent to one consumer that it has not received yet.

``Worker(..., max_inflight_bytes=N)`` gives each consumer worker one ``InflightWindow`` per
transport: ``send`` reserves a tensor's bytes before sending any of it, and the transport
gives them back once the consumer took it (or died, or the step was cleaned up). Bytes, not
items (``multiprocessing.Queue(maxsize)``), because bytes are what fill /dev/shm. A tensor
larger than the window goes once nothing else is in flight. ``ConsumerWatch`` frees the
window of a consumer that died.

Thread model (``docs/threads.md``): a reservation blocks only its caller, and ``refresh``
runs without the window's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ._errors import InvalidArgumentError, RendezvousError, ResourceExhaustedError
from ._keys import DeviceName

if TYPE_CHECKING:
    from ._keys import ParsedKey
    from ._transport import PeerDirectory

__all__ = ["VALUE_FLOOR", "ConsumerWatch", "InflightWindow", "Windows", "check_window"]
__all__ += ["counted_bytes"]

#: How often a waiting reservation asks the transport what the consumer has taken.
REFRESH_S = 0.002
#: How often a waiting reservation looks whether its consumer died.
LIVENESS_S = 0.05
#: What a value counts for at least in every bound kept in bytes: an empty one still costs a
#: header, a record and objects, so a flood of them stops at the bound too.
VALUE_FLOOR = 256


def counted_bytes(nbytes: int) -> int:
    """What a value of ``nbytes`` bytes counts for; reserve and release each value's, never a sum's."""
    return nbytes if nbytes > VALUE_FLOOR else VALUE_FLOOR


def check_window(limit: object) -> int | None:
    """``max_inflight_bytes`` as given to ``Worker``: None, or an int >= 1."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgumentError(
            f"max_inflight_bytes must be None (no window) or an int >= 1, not {limit!r}"
        )
    return limit


class InflightWindow:
    """The window of one producer towards one consumer worker."""

    __slots__ = ("_cond", "_limit", "_lock", "_used", "consumer", "waits")

    def __init__(self, consumer: str, limit: int) -> None:
        self.consumer = consumer
        self._limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.waits = 0

    @property
    def used(self) -> int:
        """Bytes reserved and not given back."""
        return self._used

    def reserve(
        self,
        nbytes: int,
        timeout: float | None,
        refresh: Callable[[], None] | None = None,
        what: str = "tensor",
    ) -> None:
        """Reserve ``nbytes``, blocking up to ``timeout`` s (None: forever) for room and
        calling ``refresh()`` (to learn of receives) meanwhile; then ``ResourceExhaustedError``."""
        with self._lock:  # the fast path: the lock itself, not the Condition's wrapper
            used = self._used
            if used + nbytes <= self._limit or used == 0:
                self._used = used + nbytes
                return
            self.waits += 1
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if refresh is not None:
                refresh()
            with self._cond:
                if self._used + nbytes <= self._limit or self._used == 0:
                    self._used += nbytes
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ResourceExhaustedError(
                        f"cannot send {what} ({nbytes} bytes) to {self.consumer}: "
                        f"max_inflight_bytes={self._limit} and {self._used} bytes sent to it are "
                        f"not received yet; waited {timeout:g}s (nothing of it was sent)"
                    )
                wait = REFRESH_S if refresh is not None else None
                if left is not None:
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` again without waiting (a value put back in flight)."""
        with self._cond:
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        """Give back bytes the consumer took (or that will never reach it)."""
        with self._cond:
            self._used = max(0, self._used - nbytes)
            self._cond.notify_all()

    def reset(self) -> None:
        """Give back everything (the consumer died or restarted)."""
        with self._cond:
            self._used = 0
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"<InflightWindow to {self.consumer} {self._used}/{self._limit} bytes>"


class Windows:
    """A producer's windows, one per consumer task (made on first use)."""

    __slots__ = ("_by_device", "_by_task", "_limit", "_lock")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._by_task: dict[tuple[str, int, int], InflightWindow] = {}
        self._by_device: dict[str, InflightWindow] = {}  # by a key's dst device, as written
        self._lock = threading.Lock()

    def of(self, consumer: DeviceName) -> InflightWindow:
        """The window towards the task of device ``consumer``."""
        tk = consumer.task_key()
        w = self._by_task.get(tk)
        if w is None:
            with self._lock:
                w = self._by_task.get(tk)
                if w is None:
                    job, replica, task = tk
                    w = InflightWindow(f"/job:{job}/replica:{replica}/task:{task}", self._limit)
                    self._by_task[tk] = w
        return w

    def for_key(self, key: ParsedKey) -> InflightWindow:
        """The window towards ``key``'s consumer (one look-up once known: the send path)."""
        w = self._by_device.get(key.dst_device)
        if w is None:
            w = self._by_device.setdefault(key.dst_device, self.of(key.dst))
        return w

    def __iter__(self) -> Iterator[InflightWindow]:
        with self._lock:
            return iter(list(self._by_task.values()))

    def used(self) -> int:
        return sum(w.used for w in self)

    def waits(self) -> int:
        return sum(w.waits for w in self)

    def reset(self) -> None:
        for w in self:
            w.reset()


class ConsumerWatch:
    """``died()``: True once for a consumer task seen alive and then dead, absent or alive
    in another incarnation (its window is then freed); looks every ``LIVENESS_S`` at most."""

    __slots__ = ("_alive", "_next", "_peers", "_task")

    def __init__(self, peers: PeerDirectory, task: DeviceName) -> None:
        self._peers = peers
        self._task = task
        self._alive: int | None = None  # the incarnation seen alive
        self._next = 0.0
        self.died()

    def died(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + LIVENESS_S
        try:
            seen = self._peers.state(self._task)
        except RendezvousError:  # a record that is not ours: not a death we can vouch for
            return False
        alive = seen.record.incarnation if seen.state == "alive" and seen.record else None
        before, self._alive = self._alive, alive
        return before is not None and alive != before
