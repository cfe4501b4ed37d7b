"""What a shared-memory producer has in flight to each consumer, for backpressure.

The shared-memory path sends no message back: the producer learns that the consumer took
a message only by looking. Per consumer worker this module keeps the messages in flight
and how to tell each one was received, and the ``InflightWindow`` they fill
(``_window.py``):

* a segment message by its published file being gone from its name (the consumer renames
  or unlinks it when it takes it, or when its step is cleaned up): an ``os.lstat`` — never
  an open, so a planted name cannot make it block or follow a link. The file is known by
  its inode, taken when it is published: whatever else stands at the name later (another
  user re-creating each consumed name, issue 20 §3) is not the message, so it does not
  hold the window;
* an inline ring record by the ring's consumer position (``Ring.tail``) having passed
  the record's end;
* a consumer that died (``ConsumerWatch``: its presence record "dead" or "absent", or
  another incarnation, after it was seen alive) frees its whole window.

The producer calls ``Flight.reserve`` before it copies anything and gets a ``Ticket``;
once the message is published it says where (``Ticket.segment`` or ``Ticket.record``),
and if it fails before that, ``Ticket.cancel`` gives the bytes back. Looking costs nothing on
the way: only a reservation that does not fit calls ``refresh`` (the window's refresh,
every ``REFRESH_S`` while it waits), which reads the ring's position and ``lstat``\\ s at
most ``LSTATS_PER_REFRESH`` names, oldest first, round robin.

Thread model (``docs/threads.md``): any thread may call any method. One lock per consumer guards its lists,
never held across a filesystem call.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import TYPE_CHECKING

from .._window import ConsumerWatch, InflightWindow, Windows
from .files import is_ours
from .naming import Names

if TYPE_CHECKING:
    from .._keys import DeviceName, ParsedKey
    from .._transport import PeerDirectory
    from .ring import Ring

__all__ = ["LSTATS_PER_REFRESH", "Flight", "Inflight", "Ticket"]

#: How many published names one refresh looks at, at most.
LSTATS_PER_REFRESH = 32


def _our_file(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file of ours at ``path`` (``lstat``), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if is_ours(st) else None


class Flight:
    """One consumer's messages in flight and its window (made by ``Inflight.of``)."""

    __slots__ = ("_closed", "_lock", "_records", "_ring", "_segments", "_watch", "window")

    def __init__(self, window: InflightWindow, watch: ConsumerWatch) -> None:
        self.window = window
        self._watch = watch
        self._lock = threading.Lock()
        # (published name, (st_dev, st_ino) of the message's file, bytes)
        self._segments: deque[tuple[str, tuple[int, int], int]] = deque()
        self._records: deque[tuple[int, int]] = deque()  # (end in the ring, bytes)
        self._ring: Ring | None = None
        self._closed: BaseException | None = None

    def reserve(self, nbytes: int, timeout: float | None, what: str) -> Ticket:
        """Reserve ``nbytes`` before sending them (see ``InflightWindow.reserve``).

        Raises the closing error if the producer closed meanwhile (closing frees the window,
        which wakes every reservation waiting for room: none may publish any more)."""
        self.window.reserve(nbytes, timeout, self.refresh, what)
        if self._closed is not None:
            self.window.release(nbytes)
            raise self._closed
        return Ticket(self, nbytes)

    def _segment(self, name: str, nbytes: int) -> None:
        if not nbytes:
            return  # frees nothing when taken: not worth a look
        ino = _our_file(Names.path(name))
        if ino is None:  # taken already (or never ours): nothing in flight
            self.window.release(nbytes)
            return
        with self._lock:
            self._segments.append((name, ino, nbytes))

    def _record(self, ring: Ring, end: int, nbytes: int) -> None:
        if not nbytes:
            return
        with self._lock:
            self._ring = ring
            self._records.append((end, nbytes))

    def in_flight(self) -> int:
        """Messages tracked as not received yet."""
        with self._lock:
            return len(self._segments) + len(self._records)

    def refresh(self) -> None:
        """Give back what the consumer took meanwhile (or everything, if it died)."""
        if self._watch.died():
            self.forget()
            return
        freed = 0
        with self._lock:
            ring = self._ring
            if self._records and ring is not None:
                tail = ring.tail
                records = self._records
                while records and records[0][0] <= tail:
                    freed += records.popleft()[1]
            n = min(len(self._segments), LSTATS_PER_REFRESH)
            looking = [self._segments.popleft() for _ in range(n)]
        if freed:
            self.window.release(freed)
        if not looking:
            return
        still = []
        freed = 0
        for name, ino, nbytes in looking:
            try:
                st = os.lstat(Names.path(name))
            except FileNotFoundError:
                freed += nbytes  # taken (renamed or unlinked) by the consumer
                continue
            except OSError:
                pass  # cannot tell: count it as in flight
            else:
                if (st.st_dev, st.st_ino) != ino or not is_ours(st):
                    freed += nbytes  # taken; what stands there now is another file
                    continue
            still.append((name, ino, nbytes))
        with self._lock:
            self._segments.extend(still)  # to the back: the next refresh looks at others
        if freed:
            self.window.release(freed)

    def forget(self) -> None:
        """The consumer died (or this producer closes): nothing of it counts any more."""
        with self._lock:
            self._segments.clear()
            self._records.clear()
            self._ring = None
        self.window.reset()


class Ticket:
    """One reservation of a ``Flight``: published once (as a segment or a ring record), or
    cancelled; whatever comes after the first of these is ignored."""

    __slots__ = ("_flight", "_open", "nbytes")

    def __init__(self, flight: Flight, nbytes: int) -> None:
        self._flight = flight
        self.nbytes = nbytes
        self._open = True

    def segment(self, name: str) -> None:
        """The message was published as segment ``name``: in flight until its file (known by
        its inode from now on: one ``lstat``) is no longer at that name."""
        if self._open:
            self._open = False
            self._flight._segment(name, self.nbytes)

    def record(self, ring: Ring, end: int) -> None:
        """The message was appended to ``ring``, its record ending at ``end`` (``Ring.head``
        just after the append): in flight until the consumer's ``Ring.tail`` passes it."""
        if self._open:
            self._open = False
            self._flight._record(ring, end, self.nbytes)

    def cancel(self) -> None:
        """Nothing of the message was published: give its bytes back."""
        if self._open:
            self._open = False
            self._flight.window.release(self.nbytes)


class Inflight:
    """A producer's flights, one per consumer task, all under one ``max_inflight_bytes``."""

    def __init__(self, limit: int, peers: PeerDirectory) -> None:
        self._windows = Windows(limit)
        self._peers = peers
        self._flights: dict[InflightWindow, Flight] = {}
        self._by_device: dict[str, Flight] = {}  # by a key's dst device, as written
        self._lock = threading.Lock()
        self._closed: BaseException | None = None

    def for_key(self, key: ParsedKey) -> Flight:
        """The flight to ``key``'s consumer (one dict look-up once known: the send path)."""
        flight = self._by_device.get(key.dst_device)
        if flight is None:
            flight = self._by_device.setdefault(key.dst_device, self.of(key.dst))
        return flight

    def of(self, consumer: DeviceName) -> Flight:
        """The flight to the task of device ``consumer`` (made on first use)."""
        window = self._windows.of(consumer)
        flight = self._flights.get(window)
        if flight is None:
            watch = ConsumerWatch(self._peers, consumer)  # looks once: outside the lock
            with self._lock:
                flight = self._flights.setdefault(window, Flight(window, watch))
                flight._closed = self._closed
        return flight

    def used(self) -> int:
        """Bytes in flight to all consumers together."""
        return self._windows.used()

    def waits(self) -> int:
        """Reservations that had to wait, all consumers together."""
        return self._windows.waits()

    def close(self, error: BaseException) -> None:
        """Forget every flight (before the rings are unmapped); a reservation made from now
        on, or waiting now, raises ``error``."""
        with self._lock:
            self._closed = error
            flights = list(self._flights.values())
        for f in flights:
            f._closed = error
            f.forget()
