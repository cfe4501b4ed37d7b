"""Whether the producers a consumer waits on can still send.

Once per tick, per producer task with waiters (not per channel), its presence record is
checked (``PeerDirectory.liveness``: a lock-free look at the record and its flock). A
receive whose producer was alive and then died fails with ``UnavailableError`` within a
second; the flock is released by the kernel at death, a stopped process keeps it. A
producer seen with a new incarnation fails the receives of keys pinned to the old one
(``AbortedError``, as TensorFlow words it) and moves the others to the new run.

Thread model (docs/threads.md): every method runs under ``Consumer.lock``, except
``producer_alive`` (any thread: the pool's give-back asks it).
"""

from __future__ import annotations

import time
from typing import Any

from .._errors import AbortedError, RendezvousError, UnavailableError
from .._keys import DeviceName
from .._transport import TransportContext
from .consumer import Channel, Source

__all__ = ["Liveness", "Live"]

#: ``(state, record)``: a state of ``PeerDirectory.liveness`` (or "broken") and its record
#: (or the error that made it "broken").
Live = tuple[str, Any]


class Liveness:
    """Producer presence checks of one consumer (see the module docstring)."""

    def __init__(self, ctx: TransportContext, tick: float) -> None:
        self._peers = ctx.peers
        self._tick = tick

    def producer_alive(self, task: str, incarnation: int) -> bool:
        """``pool.ProducerAlive``: one lock-free look at the producer's presence record."""
        state, record = self._peers.liveness(DeviceName.parse(task))
        return state == "alive" and record is not None and record.incarnation == incarnation

    def state(self, src: Source) -> Live:
        """``(state, record)`` of the producer; a look at most once per tick while alive."""
        now = time.monotonic()
        if src.alive_at >= 0 and now - src.alive_at <= self._tick:
            return "alive", None
        try:
            state, record = self._peers.liveness(src.dev)
        except RendezvousError as e:
            return "broken", e
        if state == "alive" and record is not None:
            if record.incarnation != src.inc:
                src.restarted = bool(src.inc)
                src.inc = record.incarnation
                src.look_at = 0.0  # a restarted producer: look for its new ring
            src.alive_at = now
        else:
            src.alive_at = -1.0
        return state, record

    def failure(self, ch: Channel, live: Live) -> BaseException | None:
        """Why the channel's producer can no longer send, or None while it may."""
        state, record = live
        key = ch.pk.full_key if ch.pk is not None else ch.key
        src = ch.src.task
        if state == "broken":
            return UnavailableError(f"producer {src} of key {key!r} cannot be trusted: {record}")
        if state == "alive":
            inc = ch.src.inc
            pinned = ch.pk.src_incarnation if ch.pk is not None else 0
            if pinned and inc != pinned:
                return AbortedError(
                    "RecvTensor expects a different device incarnation: "
                    f"{pinned:016x} vs. {inc:016x}. "
                    f'Your worker job ("{src}") was probably restarted; key {key!r}'
                )
            if not pinned and ch.inc and inc != ch.inc and not ch.nready:
                # Restarted producer and a key that does not pin an incarnation: follow the
                # new run from its first message.
                ch.inc, ch.seq = inc, 0
                return None
            ch.seen_alive = True
            return None
        if ch.seen_alive:
            how = "exited" if state == "absent" else "died"
            pid = f" (pid {record.pid})" if record is not None and record.pid else ""
            return UnavailableError(
                f"producer {src}{pid} {how} while key {key!r} was awaited in step {ch.step}"
            )
        return None

    def run_over(self, src: Source, inc: int) -> bool:
        """Whether run ``inc`` of the producer can send nothing more: its record is gone or
        dead, or names another run (a look at most once per tick while alive)."""
        state, record = self.state(src)
        if state == "alive":
            live = record.incarnation if record is not None else src.inc
            return bool(live) and live != inc
        return state in ("absent", "dead")

    def verdicts(self, src: Source) -> tuple[bool, list[tuple[Channel, BaseException]]]:
        """The tick's look at a producer with waiting channels.

        Returns ``(dead, failures)``: the channels to fail, each with its error; ``dead``
        when the producer is gone (what it published before is to be delivered first).
        """
        live = self.state(src)
        out: list[tuple[Channel, BaseException]] = []
        if live[0] == "alive":
            if src.restarted:
                src.restarted = False
                for ch in list(src.waiting):
                    failure = self.failure(ch, live)  # follows it, or fails
                    if failure is not None:
                        out.append((ch, failure))
            for ch in src.unseen:
                ch.seen_alive = True
            src.was_alive = src.was_alive or bool(src.unseen)
            src.unseen.clear()
            return False, out
        if live[0] != "broken" and not src.was_alive:
            return False, out  # not started yet (or gone before anyone here saw it): wait
        src.was_alive = False
        for ch in list(src.waiting):
            failure = self.failure(ch, live)
            if failure is not None:
                out.append((ch, failure))
        return True, out
