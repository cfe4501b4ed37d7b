"""A Worker's shared-memory side: its transport and its presence board.

``ShmTransport`` implements ``_transport.Transport`` over the ``Producer`` (``producer.py``:
send, allocate, the rings and doorbells of the consumers it sends to), the ``Consumer``
(``consumer.py``: the channel table the rings feed) and the ``Poller`` (``bell.py``: who
polls this worker's doorbell), and owns the doorbell. ``ShmBoard`` is the worker's
``_transport.PresenceBoard``: it publishes the worker's record (``presence.Presence``),
answers its peers' states from one ``presence.Monitor``, and collects what dead workers of
this user left when it publishes and closes (``reaper.at_start`` / ``reaper.at_close``).

Thread model (``docs/threads.md``): every method may be called from any thread. ``done``
callbacks run through ``invoke_done``, outside every lock: in the calling thread when the
value is there already, else in the thread that polled the doorbell (a blocked receiver or
the dispatcher thread). ``ShmBoard.state`` may run inside the garbage collector.
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
    """Shared-memory transport of one Worker (see the module docstring)."""

    name = "shm"

    def __init__(self, ctx: TransportContext, *, pool_bytes: int, busy_poll: float = 0.0) -> None:
        self._ctx = ctx
        self._close_lock = threading.Lock()
        self._closed = False
        names = Names(ctx.namespace)
        self._bell = Bell.create(names, ctx.task_name, replace_stale=True)
        try:
            limit = ctx.max_inflight_bytes
            self._producer = Producer(
                names,
                ctx.task_name,
                ctx.incarnation,
                pool_bytes,
                None if limit is None else Inflight(limit, ctx.peers),
                run_alive(ctx.peers),  # whether a consumer run holding a slot lives
            )
            self._consumer = consumer = Consumer(ctx, names, self._kick)
            self._poller = Poller(self._bell, consumer, ctx.task_name, busy_poll)
        except BaseException:
            self._bell.unlink()
            self._bell.close()
            raise
        #: ``Transport.start_recv`` and ``Transport.wait``: the consumer's and the poller's.
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
        """Fail the step's waiters, forget the step, free the unreceived messages sent to
        this worker in it."""
        self._producer.cleanup_step(step_id)
        if self._consumer.cleanup_step(step_id, error, self._bell.pending > 0):
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
    """The presence records of one namespace on this host (see the module docstring).

    ``namespace``: the job's token (``Names``). Raises ``InvalidArgumentError`` for a bad one.
    """

    def __init__(self, namespace: str) -> None:
        self._names = Names(namespace)
        self._monitor = Monitor(self._names)
        self._presence: Presence | None = None
        self._task = ""
        self._sweeping = False  # ``reaper.at_start`` ran the sweeps (``at_close`` then too)

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
