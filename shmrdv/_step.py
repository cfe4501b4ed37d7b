"""The rendezvous of one step of one Worker: the calls of ``Rendezvous``, routed.

Each call checks what the worker allows (``Router.refused``: a closed or forked Worker),
asks the router for the key's route (cached per key string) and hands the value or the
receive to the step's in-process table or to the route's transport. A receive started
before its producer's pick of transport is known listens on its own pick and on the
producer's once known (``_race.py``). The step's abort error lives here only.

Thread model (``docs/threads.md``): thread-safe; a step's lock guards its abort error and
is never held across a transport call. Receives complete in the threads the transports
say; a blocked ``recv`` waits in its caller's thread, helping its transport.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import DeadlineExceededError, InvalidArgumentError
from ._keys import ParsedKey
from ._race import RaceRecv
from ._rendezvous import (
    Canceller,
    DoneCallback,
    LocalRendezvous,
    Received,
    RecvSlot,
    Rendezvous,
    check_timeout,
    timeout_error,
    wait_received,
)
from ._router import KeyRoute, Router
from ._transport import Transport

__all__ = ["StepRendezvous"]

_log = logging.getLogger("shmrdv.router")

_INF = float("inf")
_ndarray = np.ndarray  # (one global lookup on ``send``'s hot path, not two)


class StepRendezvous(Rendezvous):
    """The rendezvous of one step of one Worker (``Worker.rendezvous(step_id)``).

    ``send`` never blocks on the consumer; it copies the array once into shared memory
    for a consumer on this host (none for an array from ``allocate``, none for a
    consumer in this worker) and buffers it for a consumer on another host, which
    pulls it. Receives block, call back, or complete a Future / awaitable as described
    on ``Rendezvous``. ``start_abort`` (or ``Worker.cleanup``) fails everything pending
    in this step and every later call; the step's abort error lives here only.
    """

    def __init__(self, router: Router, step_id: int) -> None:
        self._router = router
        self._route = router.route
        # The route cache itself, for a key given as a string (the hot path's one lookup).
        self._route_str = router.route_str
        self.step_id = step_id
        self._local = LocalRendezvous()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = f"aborted: {self._error!r}" if self._error is not None else "open"
        return f"<StepRendezvous step={self.step_id} of {self._router.task_name} ({state})>"

    def _check_usable(self) -> None:
        refused = self._router.refused
        if refused is not None:
            raise refused()

    def _send_route(self, key: str | ParsedKey) -> KeyRoute:
        self._check_usable()
        r = self._router.route(key)
        if not (r.src_own and r.inc_ok):
            raise self._router.send_error(r)
        if self._error is not None:
            raise self._error
        return r

    def _recv_route(self, key: str | ParsedKey) -> KeyRoute:
        self._check_usable()
        r = self._router.route(key)
        if not r.dst_own or not r.inc_ok:
            raise self._router.recv_error(r)
        if self._error is not None:
            raise self._error
        return r

    # -- Rendezvous --------------------------------------------------------------------

    def send(
        self,
        key: str | ParsedKey,
        value: Any,
        *,
        is_dead: bool = False,
        timeout: float | None = None,
    ) -> None:
        # ``_send_route`` and ``KeyRoute.checked`` written out: the hot path of every send.
        if self._router.refused is not None:
            raise self._router.refused()
        r = self._route_str(key) if type(key) is str else self._route(key)
        if not (r.src_own and r.inc_ok) or self._error is not None:
            self._send_route(key)  # raises what is wrong
        if timeout is not None and (type(timeout) is not float or not 0.0 <= timeout < _INF):
            timeout = check_timeout(timeout)  # not a plain finite float >= 0: convert or refuse
        dtype, shape = r.accepted
        if type(value) is _ndarray and value.dtype is dtype and value.shape == shape:
            arr = value
        else:
            arr = r.checked(value)
        dead = is_dead if type(is_dead) is bool else bool(is_dead)  # (no call for a bool)
        if r.local:
            self._local.put(r.pk, arr, dead)
        else:
            t = r.transport or self._router.transport(r)
            t.send(self.step_id, r.pk, arr, dead, timeout)

    send.__doc__ = Rendezvous.send.__doc__

    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        if self._router.refused is not None:  # ``_recv_route`` written out: the hot path
            raise self._router.refused()
        r = self._route_str(key) if type(key) is str else self._route(key)
        if not (r.dst_own and r.inc_ok) or self._error is not None:
            self._recv_route(key)  # raises what is wrong
        if r.local:
            return self._local.start_recv(r.pk, done, copy=copy, blocking=blocking)
        t = r.transport
        if t is None:
            t = self._router.transport(r)
            if r.transport is None and self._router.others_reaching(r, t):
                return self._early_recv(r, t, done, copy)
        return t.start_recv(self.step_id, r.pk, done, copy=copy, blocking=blocking)

    start_recv.__doc__ = Rendezvous.start_recv.__doc__

    def _early_recv(
        self, r: KeyRoute, first: Transport, done: DoneCallback, copy: bool
    ) -> RaceRecv:
        """A receive started before its producer's pick is known: on ``first`` (this
        worker's own pick) now, and on the producer's once its record says (``_race.py``)."""
        leg = functools.partial(_start_leg, step_id=self.step_id, pk=r.pk, copy=copy)
        race = RaceRecv(done, [functools.partial(leg, first)], f"key {r.pk.full_key!r}")
        self._router.watch_pick(r, race, first, leg)
        return race

    def _wait_blocked(
        self, slot: RecvSlot, cancel: Canceller, key: str | ParsedKey, timeout: float | None
    ) -> Received:
        """A blocked receiver helps its transport while it waits (``Transport.wait``: the
        shared-memory one polls the doorbell as leader) and reports a wait that lasts."""
        r = self._route_str(key) if type(key) is str else self._route(key)
        if r.local:
            return wait_received(slot, cancel, r.pk, timeout)
        if isinstance(cancel, RaceRecv):  # its legs are callback receives: nothing to help
            return wait_received(slot, cancel, r.pk, timeout, observer=self)
        # The route's transport, as start_recv chose it (asked again only while the
        # peer's record is provisional, i.e. before the peer has started).
        helper = r.wait or self._router.transport(r).wait
        return wait_received(slot, cancel, r.pk, timeout, helper, self)

    def allocate(self, key: str | ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """An array to fill and then ``send(key, array)``.

        For a consumer on this host it lies in a shared-memory segment, so ``send`` only
        publishes it: no copy at all. It may be sent once, under this key only.
        """
        r = self._send_route(key)
        if r.local:
            return super().allocate(r.pk, shape, dtype)
        t = r.transport or self._router.transport(r)
        return t.allocate(self.step_id, r.pk, shape, dtype)

    def start_abort(self, error: BaseException) -> None:
        if not isinstance(error, BaseException):
            raise InvalidArgumentError(f"start_abort needs an exception, not {error!r}")
        with self._lock:
            if self._error is not None:
                return
            self._error = error
        self._local.start_abort(error)
        self._router.abort_step(self.step_id, error)

    @property
    def aborted(self) -> BaseException | None:
        """The abort error, or ``None`` while the step is open."""
        return self._error

    # -- WaitObserver: what a cross-process receive that waits says ---------------------

    def _timeout_error(self, key: ParsedKey, timeout: float | None) -> DeadlineExceededError:
        error = timeout_error(key, timeout)
        if self._router.route(key).local:
            return error
        hint = self._router.diagnose(key, probe=True)
        return error if hint is None else DeadlineExceededError(f"{error}; {hint}")

    def timeout_error(self, key: ParsedKey, timeout: float | None) -> DeadlineExceededError:
        return self._timeout_error(key, timeout)

    def waiting_long(self, slot: RecvSlot, key: ParsedKey, waited: float) -> None:
        self._router.long_wait_started(slot, self.step_id, key, time.monotonic() - waited)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "recv of %r in step %d has waited %.0fs: %s",
                key.full_key,
                self.step_id,
                waited,
                self._router.diagnose(key) or f"its producer {key.src} is alive in this namespace",
            )

    def stopped_waiting(self, slot: RecvSlot) -> None:
        self._router.long_wait_ended(slot)

    def stats(self) -> dict[str, int]:
        return self._local.stats()


def _start_leg(
    t: Transport, done: DoneCallback, *, step_id: int, pk: ParsedKey, copy: bool
) -> Canceller:
    """One leg of a ``RaceRecv``: a callback receive on ``t``."""
    return t.start_recv(step_id, pk, done, copy=copy, blocking=False)
