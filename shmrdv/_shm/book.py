"""The shared-memory consumer's book: what it knows per key, per producer, per ring.

Each (step, key) is a ``Channel`` with the next sequence number it expects; each producer
task is a ``Source``; each attached ring a ``InRing``. What arrived for a channel and was
not taken yet waits in the stash, ``(key, incarnation, seq) -> value`` per step: a
``Received``, a ``Notice`` (the message is the segment of its name) or an error to
deliver like a message. The channels with waiters are the keys of one ``WaiterTable``
(``shmrdv/_channels.py``), each channel's waiters oldest first.

An idle channel, one that a ring brought message 0 for and that nobody waits on, is no
``Channel`` yet: its place in the step's table of channels holds the ``InRing`` that
message came through (its producer and incarnation), and ``first`` holds the message
until it is taken; the ring stays in the table once it is (the channel then expects
message 1). So draining a record of a new key makes no object but its value. Anything
else that needs the channel (a receive that cannot simply take message 0, a second
record of its key, a listing) gets a ``Channel`` in the state the idle entry stands for
(``channel``, ``find``: ``promote``).

The book holds no lock and does no I/O: the parts of the consumer (``inbox``,
``liveness``, ``recovery``, ``named``, ``orphans``) read and change it under the
coordinator's lock (``consumer.py``).

Thread model (docs/threads.md): none of its own; every call is made under
``Consumer.lock``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .._channels import WaiterTable
from .._errors import InternalError
from .._keys import DeviceName, ParsedKey
from .._rendezvous import DoneCallback, Received, received
from .files import Segment
from .pool import RunWatch
from .producer import task_name
from .ring import Ring

__all__ = ["Book", "Channel", "InRing", "Notice", "NoticeArray", "Source", "Stash", "Waiter"]


#: What a ring notice says of its array: dtype, shape, data offset, nbytes, is_dead.
NoticeArray = tuple[np.dtype[Any], tuple[int, ...], int, int, bool]


class Notice:
    """A stashed notice: the message is the segment of its name (``slot``: pool slot or -1).

    ``array``: what the producer's ring record said of the array (its header, checked by
    the inbox), or None for a notice found by listing names.
    """

    __slots__ = ("array", "slot")

    def __init__(self, slot: int, array: NoticeArray | None = None) -> None:
        self.slot = slot
        self.array = array


#: What the stash holds for one message. A plain ndarray is a live value (``is_dead``
#: false) that came inline: its ``Received`` is made when it is taken, so that a pending
#: record keeps no object the garbage collector must look at (an ndarray is not tracked).
Stashed = npt.NDArray[Any] | Received | Notice | BaseException
#: One step's stash: ``(key, incarnation, seq) -> what came``.
Stash = dict[tuple[str, int, int], Stashed]


class Channel:
    """One (step, key): the next sequence number and how many of its messages are stashed.

    Hashes by identity: it is its own key in the waiter table. One is made per (step, key)
    as its first record is drained, so the fields every new channel starts with are class
    defaults (no ``__slots__``): ``__init__`` sets only what differs.
    """

    pk: ParsedKey | None = None  # set by the first receive
    seq = 0
    nready = 0  # stashed messages (any sequence number)
    seen_alive = False

    def __init__(self, step: int, key: str, src: Source, inc: int) -> None:
        self.step = step
        self.key = key
        self.src = src
        self.inc = inc  # producer incarnation (0 = not known yet)


class Waiter:
    """One queued receive of a channel."""

    __slots__ = ("blocking", "channel", "copy", "done")

    def __init__(self, done: DoneCallback, copy: bool, channel: Channel, blocking: bool) -> None:
        self.done = done
        self.copy = copy
        self.channel = channel
        # A blocked receiver polls the doorbell itself (``Transport.wait``); only callback
        # waiters (recv_async, futures, asyncio) need the dispatcher thread.
        self.blocking = blocking


class InRing:
    """A producer's ring for this consumer, attached (its name already unlinked).

    ``src`` and ``inc``: its producer and that producer's incarnation. ``watch`` is live
    while the ring is attached: this consumer will then collect what the producer run
    leaves when it is over (``pool.RunWatch``)."""

    __slots__ = (
        "buf",
        "fd",
        "inc",
        "lost",
        "lost_seen",
        "ring",
        "segment",
        "size",
        "src",
        "watch",
        "words",
    )

    def __init__(self, segment: Segment, ring: Ring, src: Source, inc: int) -> None:
        self.segment, self.ring, self.src, self.inc = segment, ring, src, inc
        self.buf = ring.buf  # (``Ring.buf``, without its property call per drain)
        self.words = ring.words  # (likewise ``Ring.words``)
        # The ring file's descriptor (``Segment.fd``) and size, for the size check before
        # each look at the ring: ``os.lseek(fd, 0, SEEK_END)``, one system call lighter than
        # ``Segment.check_size``'s ``fstat``, without its Python calls on a spinning
        # poller's path. -1 once the ring is let go (an ``lseek`` of it fails).
        self.fd = segment.fd
        self.size = segment.size
        self.watch = RunWatch()
        self.lost_seen = 0
        self.lost = 0  # the ring's lost count at the last (size-checked) drain


class Source:
    """One producer task, as this consumer sees it."""

    __slots__ = (
        "alive_at",
        "broken",
        "dev",
        "inc",
        "look_at",
        "restarted",
        "ring_incs",
        "rings",
        "task",
        "tried",
        "unseen",
        "waiting",
        "was_alive",
    )

    def __init__(self, task: str, dev: DeviceName) -> None:
        self.task = task
        self.dev = dev
        self.inc = 0  # of its live worker, or of the last one seen
        self.rings: list[InRing] = []
        self.ring_incs: set[int] = set()  # incarnations whose ring is attached
        self.tried: set[int] = set()  # earlier incarnations whose ring was looked for
        self.look_at = 0.0  # when to look for its ring again
        self.alive_at = -1.0  # when it was last seen alive (with incarnation ``inc``)
        self.waiting: dict[Channel, None] = {}  # its channels with waiters (ordered set)
        self.unseen: list[Channel] = []  # waiting channels not yet marked seen_alive
        self.was_alive = False  # some waiting channel has seen it alive
        self.restarted = False  # a new incarnation was seen: its channels need a look
        self.broken: InternalError | None = None  # why its ring was failed, once


class Book:
    """Channels, producers, stash and waiters of one consumer (see the module docstring)."""

    __slots__ = (
        "channels",
        "first",
        "received",
        "received_bytes",
        "src_by_device",
        "srcs",
        "stash",
        "touched",
        "waiters",
    )

    def __init__(self) -> None:
        # step -> key -> channel, or the ring of an idle channel's message 0; a step's
        # table goes in one piece at cleanup.
        self.channels: dict[int, dict[str, Channel | InRing]] = {}
        # step -> (key, incarnation, seq) -> what came for it.
        self.stash: dict[int, Stash] = {}
        # step -> key -> message 0 of an idle channel, until it is taken.
        self.first: dict[int, dict[str, Stashed]] = {}
        self.srcs: dict[str, Source] = {}  # by task name
        self.src_by_device: dict[str, Source] = {}  # by the key's src device, as written
        self.touched: list[Channel] = []  # channels with waiters and new stash entries
        # Channels with waiters, each one's waiters oldest first (values stay in the stash).
        self.waiters: WaiterTable[Channel, object, Waiter] = WaiterTable()
        self.received = 0
        self.received_bytes = 0

    def source(self, key: ParsedKey) -> Source:
        """The producer of ``key``, known from now on."""
        src = self.src_by_device.get(key.src_device)
        if src is None:
            src = self.source_named(task_name(key.src))
            self.src_by_device[key.src_device] = src
        return src

    def source_named(self, task: str) -> Source:
        src = self.srcs.get(task)
        if src is None:
            src = self.srcs[task] = Source(task, DeviceName.parse(task))
        return src

    def channel(self, step: int, key: str, src: Source, inc: int) -> Channel:
        """The channel of (step, key), made if new (for producer ``src``, incarnation ``inc``)."""
        chans = self.channels.get(step)
        if chans is None:
            chans = self.channels[step] = {}
        ch = chans.get(key)
        if ch is None:
            ch = chans[key] = Channel(step, key, src, inc)
            return ch
        if type(ch) is InRing:
            return self.promote(step, key, ch)
        return ch  # type: ignore[return-value]  # not an InRing: a Channel

    def find(self, step: int, key: str) -> Channel | None:
        """The channel of (step, key) if it is known (made from its idle entry if need be)."""
        chans = self.channels.get(step)
        ch = chans.get(key) if chans is not None else None
        if type(ch) is InRing:
            return self.promote(step, key, ch)
        return ch  # type: ignore[return-value]  # not an InRing: a Channel or None

    def promote(self, step: int, key: str, r: InRing) -> Channel:
        """The ``Channel`` of the idle (step, key) whose message 0 came through ``r``, in the
        state its idle entry stands for: that message stashed, or taken."""
        ch = self.channels[step][key] = Channel(step, key, r.src, r.inc)
        first = self.first.get(step)
        got = first.pop(key, None) if first is not None else None
        if got is None:
            ch.seq = 1  # message 0 was taken
        else:
            stash = self.stash.get(step)
            if stash is None:
                stash = self.stash[step] = {}
            stash[(key, r.inc, 0)] = got
            ch.nready = 1
        return ch

    def forget_step(self, step: int) -> tuple[Stash | None, dict[str, Stashed] | None]:
        """Drop the step's channels; returns what nobody received (to let go of after the
        lock: the stash and the idle channels' messages)."""
        self.channels.pop(step, None)
        return self.stash.pop(step, None), self.first.pop(step, None)

    def put(self, ch: Channel, inc: int, seq: int, value: Stashed) -> bool:
        """Stash ``value`` as message (``inc``, ``seq``) of ``ch`` unless one is there already."""
        stash = self.stash.get(ch.step)
        if stash is None:
            stash = self.stash[ch.step] = {}
        at = (ch.key, inc, seq)
        added = at not in stash
        if added:
            stash[at] = value
            ch.nready += 1
        if ch in self.waiters:
            self.touched.append(ch)
        return added

    def adopt_incarnation(self, ch: Channel) -> None:
        """Give ``ch`` the incarnation of a message stashed for its key, if any."""
        for key, inc, _seq in self.stash.get(ch.step, {}):
            if key == ch.key:
                ch.inc = inc
                return

    def next_stashed(self, ch: Channel) -> int | None:
        """The lowest sequence number above ``ch.seq`` stashed for ``ch``, if any."""
        stash = self.stash.get(ch.step, {})
        seqs = [s for (k, i, s) in stash if k == ch.key and i == ch.inc and s > ch.seq]
        return min(seqs) if seqs else None

    def drop_stashed(self, ch: Channel) -> None:
        """Forget a stashed entry of ``ch``'s next message (it was taken by its name)."""
        stash = self.stash.get(ch.step)
        if stash is not None and stash.pop((ch.key, ch.inc, ch.seq), None) is not None:
            ch.nready -= 1

    def count(self, nbytes: int) -> None:
        self.received += 1
        self.received_bytes += nbytes

    def taken(self, got: Stashed) -> Received | BaseException:
        """What a receive gets for the stashed ``got`` (not a ``Notice``), counted: a bare
        live array gets its ``Received`` now (``Stashed``); an error is delivered as is."""
        if type(got) is np.ndarray:
            self.received += 1
            self.received_bytes += got.nbytes
            return received(got, False)
        if type(got) is Received:
            self.received += 1
            self.received_bytes += got.value.nbytes
        return got  # type: ignore[return-value]  # not a Notice (the callers' check)
