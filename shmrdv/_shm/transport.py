"""The same-host transport: tensors through POSIX shared memory named by key.

A thin façade implementing ``shmrdv._transport.Transport`` over three parts:

* ``producer.py`` — sequence numbers, publish, pool lending, outgoing rings, doorbells;
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

from .._callbacks import DoneCallback, invoke_done
from .._devices import DeviceName
from .._keys import ParsedKey
from .._received import Received
from .._rendezvous import Canceller, RecvSlot
from .._transport import PeerRecord, TransportContext
from .bell import Bell
from .book import Waiter
from .consumer import Consumer
from .delivery import deliver, deliver_one
from .dispatcher import Dispatcher
from .inflight import Inflight
from .naming import Names
from .producer import Producer

__all__ = ["ShmTransport"]

_log = logging.getLogger("shmrdv.shm")


def _already_done() -> bool:
    return False


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
                self._peer_alive,
            )
            self._consumer = Consumer(ctx, names, self._kick)
            self._dispatcher = Dispatcher(self._bell, self._consumer, ctx.task_name, busy_poll)
            #: ``Transport.wait``: the dispatcher's own (a blocked receiver polls the
            #: doorbell as leader, or follows), bound once: no forwarding call per wait.
            self.wait: Callable[[RecvSlot, float], None] = self._dispatcher.wait
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

    # -- consumer side ----------------------------------------------------------------

    def start_recv(
        self,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        consumer = self._consumer
        got = consumer.start(step_id, key, done, copy, blocking)
        if type(got) is Received and not copy:
            # The value was there: no item, no list. A blocking receive's ``done`` is its
            # slot's, which never raises (``Rendezvous.start_recv``): called directly.
            if blocking:
                done(None, got)
            else:
                invoke_done(done, None, got)
        elif type(got) is Waiter:
            return lambda: consumer.cancel(got)
        else:
            deliver_one(done, copy, got)  # type: ignore[arg-type]  # not a Waiter
        return _already_done

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        items = self._consumer.abort_step(step_id, error)
        deliver(items)
        self._dispatcher.wake_all()  # blocked receivers waiting for the poller role

    def cleanup_step(self, step_id: int) -> None:
        """Forget the step; free the unreceived messages addressed to this worker in it."""
        self._producer.cleanup_step(step_id)
        self._consumer.cleanup_step(step_id)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        items = self._consumer.close()
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
