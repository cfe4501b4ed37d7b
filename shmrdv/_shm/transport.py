"""The same-host transport: tensors through POSIX shared memory named by key.

``ShmTransport`` implements ``shmrdv._transport.Transport`` over its three parts: the
``Producer`` (``producer.py``: send, allocate, rings and doorbells of the consumers it sends
to), the ``Consumer`` (``consumer.py``: the channel table the rings feed) and the
``Poller`` (``bell.py``: who polls this worker's doorbell), and owns the doorbell.

Thread model (``docs/threads.md``): every method may be called from any thread. ``done``
callbacks run through ``invoke_done``, outside every lock: in the calling thread when the
value is there already, else in the thread that polled the doorbell (a blocked receiver or
the dispatcher thread).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy.typing as npt

from .._keys import ParsedKey
from .._transport import PeerRecord, TransportContext
from .bell import Bell, Poller
from .consumer import Consumer, run_alive
from .naming import Names
from .producer import Inflight, Producer

__all__ = ["ShmTransport"]


class ShmTransport:
    """Shared-memory transport of one Worker (see the module docstring)."""

    name = "shm"

    def __init__(self, ctx: TransportContext, *, pool_bytes: int, busy_poll: float = 0.0) -> None:
        self._ctx = ctx
        self._task = ctx.task_name
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

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<ShmTransport {self._task} pending={self._consumer.pending} closed={self._closed}>"

    def can_reach(self, peer: PeerRecord) -> bool:
        return peer.same_host and self.name in peer.transports

    def explain_wait(self, peer: PeerRecord) -> str | None:
        """Nothing beyond what its presence record tells (``_diagnose``)."""
        return None

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

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; free the unreceived messages sent to this worker in it."""
        self._producer.cleanup_step(step_id)
        self._consumer.cleanup_step(step_id, self._bell.pending > 0)

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
