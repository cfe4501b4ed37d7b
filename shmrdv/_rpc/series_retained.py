"""What a resumable RecvTensorSeries handed out and its consumer has not acknowledged.

A consumer that gives its series a ``request_id`` (its own id for the series, the same on
every call of it) makes the series resumable: the producer (``series_service``) keeps
each value it takes for the series in its ``Retained`` entry, in order, until the
consumer acknowledges it with ``RecvTensorSeriesAck``, whose ``held`` says how many of
the series' values it holds (every value it assembled counts, taken by a receive or
not). Until then the value counts in the producer's window (``TensorSource.done_with``
comes at the ack), so a connection that drops loses nothing the producer sent.

When a call of the series ends (the connection dropped, the consumer went away, the key
was idle), what the entry kept goes back to the head of its key, in order (``requeue``:
a receive that comes later, by either method, gets it), and the entry remembers how many
values were acknowledged and how many went back. The call that re-opens the series says
in its request how many it holds: ``open`` takes off the key again those of the values
that went back that it already has (delivered), and the series goes on from the next.
A re-open that comes before the producer saw the previous call end waits for it
(``_TAKEOVER_WAIT``). An entry with nothing gone back is forgotten when its call ends (a
re-open then holds exactly what was acknowledged); at most ``_KEPT`` entries stay,
the oldest dropped first.

Thread model (``docs/threads.md``): the server's event loop only, no lock.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable

from .._errors import InternalError, InvalidArgumentError, UnavailableError
from .._keys import ParsedKey
from .._rendezvous import Received
from .._window import counted_bytes
from .tensor_source import TensorSource

__all__ = ["Retained", "RetainedTable"]

# Entries kept (those with values gone back to their key); each is a few hundred bytes.
_KEPT = 4096
# How long a re-opened series waits for its previous call to end (the producer may see a
# dropped connection later than its consumer): then UNAVAILABLE, and the consumer retries.
_TAKEOVER_WAIT = 5.0

_Id = tuple[int, int, str]  # (request_id, step_id, full key)


class Retained:
    """One resumable series: the values it handed out and the consumer did not
    acknowledge yet (``values``, oldest first), and its counts."""

    __slots__ = (
        "acked",
        "asked",
        "call",
        "ending",
        "gone_back",
        "ident",
        "late",
        "nbytes",
        "pk",
        "room",
        "sent",
        "step_id",
        "unasked",
        "values",
    )

    def __init__(self, ident: _Id, pk: ParsedKey) -> None:
        self.ident = ident
        self.step_id = ident[1]
        self.pk = pk
        self.values: collections.deque[Received] = collections.deque()
        self.nbytes = 0  # what ``values`` count in the window
        self.sent = 0  # values handed out on the series, all calls
        self.acked = 0  # of them, acknowledged (the first ``acked``)
        self.asked = 0  # ``sent`` when the producer last asked for an ack
        self.unasked = 0  # bytes handed out since then
        self.gone_back = 0  # values after ``acked`` that went back to the key
        self.call: asyncio.Future[None] | None = None  # the running call's end
        # Values taken for the call, on their way when it ended: ``end`` waits for them
        # to go back to the key first (they came after every value kept).
        self.late = 0
        self.ending = False  # the call ended; ``end`` comes once ``late`` is 0
        self.room = asyncio.Event()  # set by an ack

    def add(self, batch: Iterable[Received]) -> None:
        """``batch`` was taken for the series (before it is written)."""
        for received in batch:
            n = counted_bytes(received.value.nbytes)
            self.values.append(received)
            self.nbytes += n
            self.unasked += n
            self.sent += 1

    def drop_last(self, count: int) -> list[Received]:
        """The last ``count`` values taken, which cannot be sent: kept no more."""
        out = [self.values.pop() for _ in range(count)][::-1]
        self.nbytes -= sum(counted_bytes(r.value.nbytes) for r in out)
        self.sent -= count
        return out

    def ack(self, held: int) -> list[Received]:
        """The consumer holds ``held`` values of the series: those kept no more (none:
        nothing new). ``InvalidArgumentError`` for more than were handed out."""
        if held > self.sent:
            raise InvalidArgumentError(
                f"RecvTensorSeriesAck of key {self.pk.full_key!r} says {held} values are "
                f"held; the series handed out {self.sent}"
            )
        out = [self.values.popleft() for _ in range(held - self.acked)]
        if out:
            self.acked = held
            self.nbytes -= sum(counted_bytes(r.value.nbytes) for r in out)
            self.room.set()
        return out

    def asking(self) -> None:
        """An ask goes to the consumer for everything handed out so far."""
        self.asked = self.sent
        self.unasked = 0


class RetainedTable:
    """The entries of the resumable series of one server (module docstring): values of
    ``source``; ``requeue`` gives one back to its key's head."""

    def __init__(
        self,
        source: TensorSource,
        requeue: Callable[[int, ParsedKey, Received], None],
        kept: int = _KEPT,
    ) -> None:
        self._source = source
        self._requeue = requeue
        self._kept = kept
        self._entries: collections.OrderedDict[_Id, Retained] = collections.OrderedDict()
        self.resumed = 0  # re-opens of a series that had handed out values
        self.acks = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def open(
        self, request_id: int, step_id: int, pk: ParsedKey, held: int, take_now: TakeNow
    ) -> tuple[Retained, list[Received]]:
        """The entry of the series ``request_id`` names, its call now the caller's (it
        waits for a previous one to end); and the values that went back to the key that
        the consumer holds (``held``), taken off it again with ``take_now``: delivered.
        Raises ``UnavailableError`` (the previous call lives on), ``InvalidArgumentError``
        (a count the producer cannot have given) or ``InternalError``."""
        entry = self._entry(request_id, step_id, pk)
        if entry.call is not None:  # its previous call has not seen its connection drop
            try:
                await asyncio.wait_for(asyncio.shield(entry.call), _TAKEOVER_WAIT)
            except TimeoutError:
                raise UnavailableError(
                    f"RecvTensorSeries of key {pk.full_key!r} is still open on another connection"
                ) from None
            entry = self._entry(request_id, step_id, pk)
            if entry.call is not None:
                raise UnavailableError(
                    f"RecvTensorSeries of key {pk.full_key!r} is open on another connection"
                )
        if not entry.acked <= held <= entry.acked + entry.gone_back and entry.sent:
            raise InvalidArgumentError(
                f"RecvTensorSeries of key {pk.full_key!r} re-opened holding {held} values; "
                f"the producer handed out {entry.acked} acknowledged and {entry.gone_back} more"
            )
        # An entry forgotten (or new) holds what was acknowledged: nothing to skip.
        skip = held - entry.acked if entry.sent else 0
        if entry.sent:
            self.resumed += 1
        entry.sent = entry.acked = entry.asked = held
        entry.gone_back = entry.unasked = 0
        entry.call = asyncio.get_running_loop().create_future()
        delivered: list[Received] = []
        for _ in range(skip):
            received = take_now()
            if received is None:
                self.end(entry)
                raise InternalError(
                    f"RecvTensorSeries of key {pk.full_key!r}: a value the consumer holds "
                    "is no longer at the head of its key"
                )
            delivered.append(received)
        return entry, delivered

    def ack(self, request_id: int, step_id: int, pk: ParsedKey, held: int) -> list[Received]:
        """``RecvTensorSeriesAck``: the values its consumer holds now (none: its call
        ended, and a re-open says what it holds)."""
        entry = self._entries.get((request_id, step_id, pk.full_key))
        if entry is None or entry.call is None:
            return []
        self.acks += 1
        return entry.ack(held)

    def end(self, entry: Retained) -> None:
        """The call of ``entry`` ended: what it kept goes back to its key, in order (the
        entry is forgotten if there was none)."""
        values = list(entry.values)
        entry.values.clear()
        entry.nbytes = 0
        entry.gone_back = len(values)
        entry.sent = entry.asked = entry.acked + entry.gone_back
        entry.unasked = 0
        if not values and self._entries.get(entry.ident) is entry:
            del self._entries[entry.ident]
        for received in reversed(values):
            self._source.done_with(entry.step_id, entry.pk, counted_bytes(received.value.nbytes))
            self._requeue(entry.step_id, entry.pk, received)
        call, entry.call = entry.call, None
        if call is not None and not call.done():
            call.set_result(None)

    def _entry(self, request_id: int, step_id: int, pk: ParsedKey) -> Retained:
        """The series' entry, made if there is none."""
        ident = (request_id, step_id, pk.full_key)
        entry = self._entries.get(ident)
        if entry is None:
            entry = self._entries[ident] = Retained(ident, pk)
            while len(self._entries) > self._kept:
                _, old = self._entries.popitem(last=False)
                if old.call is not None:  # running: it stays
                    self._entries[old.ident] = old
                    break
        return entry


#: Takes the next value of the series' key if it is there now.
TakeNow = Callable[[], "Received | None"]
