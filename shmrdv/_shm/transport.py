"""A Worker's shared-memory side: ``ShmTransport`` (a ``_transport.Transport`` over the
``Producer``, the ``Consumer`` and the ``Poller`` of its own doorbell) and ``ShmBoard`` (its
``_transport.PresenceBoard``: its record, its peers' states, and the reaper's sweeps when it
publishes and closes).

Thread model (docs/threads.md): any thread. ``done`` callbacks run outside every lock, in
the caller's thread or the one that polled the doorbell; ``ShmBoard.state`` may run inside
the garbage collector.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy.typing as npt

from .._keys import ParsedKey
from .._transport import PeerRecord, Sighting, TaskState, TransportContext
from . import reaper
from .bell import Bell, Poller
from .consumer import Consumer
from .naming import SHM_DIR, Names
from .pool import run_alive
from .presence import Monitor, Presence, PresenceInfo, boot_id
from .producer import Inflight, Producer

__all__ = ["ShmBoard", "ShmTransport", "usable"]


class ShmTransport:
    name = "shm"

    def __init__(self, ctx: TransportContext, *, pool_bytes: int, busy_poll: float = 0.0) -> None:
        self._ctx = ctx
        self._close_lock = threading.Lock()
        self._closed = False
        names = Names(ctx.namespace)
        self._bell = Bell.create(names, ctx.task_name, replace_stale=True)
        try:
            limit = ctx.max_inflight_bytes
            inflight = None if limit is None else Inflight(limit, ctx.peers)
            self._producer = Producer(
                names, ctx.task_name, ctx.incarnation, pool_bytes, inflight, run_alive(ctx.peers)
            )
            self._consumer = consumer = Consumer(ctx, names, self._kick, self._bell.semaphore)
            self._poller = Poller(self._bell, consumer, ctx.task_name, busy_poll)
        except BaseException:
            self._bell.unlink()
            self._bell.close()
            raise
        self.start_recv = consumer.start_recv
        self.wait = self._poller.wait

    def _kick(self) -> None:
        self._poller.kick()

    def __repr__(self) -> str:
        return f"<ShmTransport {self._ctx.task_name} pending={self._consumer.pending} closed={self._closed}>"

    def can_reach(self, peer: PeerRecord) -> bool:
        return peer.same_host and self.name in peer.transports

    def explain_wait(self, peer: PeerRecord) -> str | None:
        return None  # nothing beyond what its presence record tells

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None = None,
    ) -> None:
        if self._consumer.refusing:
            self._consumer.check_open(step_id)
        self._producer.send(step_id, key, value, is_dead, timeout)

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        self._consumer.check_open(step_id)
        return self._producer.allocate(step_id, key, shape, dtype)

    def abort_step(self, step_id: int, error: BaseException) -> None:
        if self._consumer.abort_step(step_id, error):
            self._poller.wake_all()  # followers, and a leader blocked on the doorbell

    def cleanup_step(self, step_id: int, error: BaseException) -> None:
        self._producer.cleanup_step(step_id)
        if self._consumer.cleanup_step(step_id, error):
            self._poller.wake_all()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._consumer.close()
        self._poller.close()
        # The doorbell goes before the pool's last sweep: consumers giving a slot back look
        # for it to know that this producer will still take the slot (``pool.give_back``).
        self._bell.unlink()
        self._producer.close()
        self._consumer.release()
        self._bell.close()

    def stats(self) -> dict[str, int]:
        out = self._producer.stats()
        out.update(self._consumer.stats())
        out["rings"] = out.pop("rings_in") + out.pop("rings_out")
        out.update(self._poller.stats())
        return out


def usable() -> bool:
    """Whether this process can create objects in /dev/shm (a writable directory)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


class ShmBoard:
    """The presence records of the namespace of token ``namespace`` on this host. Raises
    ``InvalidArgumentError`` for a bad token."""

    def __init__(self, namespace: str) -> None:
        self._names = Names(namespace)
        self._monitor = Monitor(self._names)
        self._presence: Presence | None = None
        self._task = ""
        self._sweeping = False  # what ``reaper.at_start`` said, for ``at_close``

    def __repr__(self) -> str:
        return f"<ShmBoard {self._names.namespace_id} {self._monitor!r}>"

    def publish(
        self, task: str, incarnation: int, address: str | None, transports: tuple[str, ...]
    ) -> None:
        assert self._presence is None, "a board publishes one worker's record"
        self._task = task
        info = PresenceInfo(
            task, os.getpid(), boot_id(), incarnation, time.time(), "", address, transports
        )
        self._presence = Presence.publish(self._names, info)
        self._sweeping = reaper.at_start(self._names, task, incarnation)

    def state(self, task: str) -> TaskState:
        return self._monitor.state(task)

    def sightings(self, task: str) -> list[Sighting] | None:
        return reaper.sightings(task, self._names.namespace_id)

    def close(self) -> None:
        self._monitor.close()
        presence, self._presence = self._presence, None
        if presence is not None:
            presence.close()
            reaper.at_close(self._names, self._task, self._sweeping)
