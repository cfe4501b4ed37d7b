"""The same-host transport: tensors through POSIX shared memory named by key.

A thin façade implementing ``shmrdv._transport.Transport`` over three parts:

* ``producer.py`` — sequence numbers, publish, pool lending, over ``route.py`` (per
  consumer worker: the outgoing ring, the doorbell);
* ``consumer.py`` — the receiving half, a coordinator of ``book.py`` (channels, stash,
  waiters), ``inbox.py`` (incoming rings), ``named.py`` (messages taken by name),
  ``liveness.py`` (producer presence), ``recovery.py`` (listings) and ``orphans.py``
  (freeing what nobody received);
* ``dispatcher.py`` — who polls this worker's doorbell: a blocked receiver as leader
  (``wait``), else the one dispatcher thread, for callback receives.

Thread model (``docs/threads.md``): every method may be called from any thread. ``done`` callbacks run through
``invoke_done``, outside every lock: in the calling thread when the value is already
there, else in the thread that polled the doorbell (a blocked receiver or the
dispatcher thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy.typing as npt

from .._keys import DeviceName, ParsedKey
from .._rendezvous import RecvSlot
from .._transport import PeerRecord, TransportContext
from .bell import Bell
from .consumer import Consumer
from .delivery import deliver
from .dispatcher import Dispatcher
from .inflight import Inflight
from .naming import Names
from .producer import Producer

__all__ = ["ShmTransport"]

_log = logging.getLogger("shmrdv.shm")


class ShmTransport:
    """Shared-memory transport of one Worker (see the module docstring)."""

    name = "shm"

    def __init__(self, ctx: TransportContext, *, pool_bytes: int, busy_poll: float = 0.0) -> None:
        self._ctx = ctx
        self._task = ctx.task_name
        self._close_lock = threading.Lock()
        self._send_lock = threading.Lock()
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
                self._peer_alive,
            )
            self._consumer = Consumer(ctx, names, self._kick)
            self._dispatcher = Dispatcher(self._bell, self._consumer, ctx.task_name, busy_poll)
            #: ``Transport.wait``: the dispatcher's own (a blocked receiver polls the
            #: doorbell as leader, or follows), bound once: no forwarding call per wait.
            self.wait: Callable[[RecvSlot, float], None] = self._dispatcher.wait
            #: ``Transport.start_recv``: the consumer's own (a value that is there is
            #: delivered in the calling thread), bound once as ``wait`` is.
            self.start_recv = self._consumer.start_recv
            #: ``Transport.send``: the producer's own, or ``_send_checked`` (``_choose_send``).
            self.send = self._producer.send
        except BaseException:
            self._bell.unlink()
            self._bell.close()
            raise

    def _peer_alive(self, task: str, incarnation: int) -> bool:
        """Whether ``task``'s live worker is run ``incarnation`` (one look at its record)."""
        state, record = self._ctx.peers.liveness(DeviceName.parse(task))
        return state == "alive" and (record is None or record.incarnation in (0, incarnation))

    def _kick(self) -> None:
        self._dispatcher.kick()

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

    # -- producer side ----------------------------------------------------------------

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        self._consumer.check_open(step_id)
        return self._producer.allocate(step_id, key, shape, dtype)

    def _send_checked(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None = None,
    ) -> None:
        """``send`` while the consumer refuses some calls (closed, or a step aborted)."""
        if self._consumer.refusing:
            self._consumer.check_open(step_id)
        self._producer.send(step_id, key, value, is_dead, timeout)

    def _choose_send(self) -> None:
        """``send``: the producer's own while the consumer refuses nothing (no forwarding
        call per message), else ``_send_checked``. After each change of ``refusing``."""
        with self._send_lock:
            self.send = self._send_checked if self._consumer.refusing else self._producer.send

    # -- consumer side ----------------------------------------------------------------

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        items = self._consumer.abort_step(step_id, error)
        self._choose_send()
        deliver(items)
        self._dispatcher.wake_all()  # blocked receivers waiting for the poller role

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; free the unreceived messages addressed to this worker in it."""
        self._producer.cleanup_step(step_id)
        self._consumer.cleanup_step(step_id)
        self._choose_send()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        items = self._consumer.close()
        self._choose_send()
        self._dispatcher.close()
        deliver(items)
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
        out.update(self._dispatcher.stats())
        return out
