"""The step-scoped rendezvous a Worker hands out: it routes each key to a transport.

Both ends in this worker: the step's in-process ``LocalRendezvous`` (no copy). The other
end in another worker: the transport the Worker picked for that peer (shared memory on
this host, gRPC across hosts). Like TensorFlow's ``BaseRemoteRendezvous``, a step's
rendezvous only sends keys whose src task is its worker and only receives keys whose
dst task is its worker; tasks are compared as parsed names (``task:1`` is not
``task:10``, the string-prefix trap of TF's ``IsLocalDevice``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from ._callbacks import DoneCallback
from ._errors import AbortedError, InvalidArgumentError
from ._keys import ParsedKey
from ._local import LocalRendezvous
from ._received import Received
from ._rendezvous import Canceller, Rendezvous, as_parsed_key, check_timeout
from ._values import check_value

if TYPE_CHECKING:
    from ._worker import Worker

__all__ = ["StepRendezvous"]


class StepRendezvous(Rendezvous):
    """The rendezvous of one step of one Worker (``Worker.rendezvous(step_id)``).

    ``send`` never blocks on the consumer; it copies the array once into shared memory
    for a consumer on this host (none for an array from ``allocate``, none for a
    consumer in this worker) and buffers it for a consumer on another host, which
    pulls it. Receives block, call back, or complete a Future / awaitable as described
    on ``Rendezvous``. ``start_abort`` (or ``Worker.cleanup``) fails everything pending
    in this step and every later call.
    """

    def __init__(self, worker: Worker, step_id: int) -> None:
        self._worker = worker
        self.step_id = step_id
        self._local = LocalRendezvous()
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = f"aborted: {self._error!r}" if self._error is not None else "open"
        return f"<StepRendezvous step={self.step_id} of {self._worker.task} ({state})>"

    # -- checks ------------------------------------------------------------------------

    def _check_src(self, pk: ParsedKey) -> bool:
        """True if the consumer is this worker too. Raises for a key this worker cannot send."""
        w = self._worker
        w._check_usable()
        if not w._is_own_task(pk.src):
            raise InvalidArgumentError(f"Invalid rendezvous key (src): {pk.full_key} @ {w.task}")
        if pk.src_incarnation not in (0, w.incarnation):
            raise AbortedError(
                f"key {pk.full_key!r} names incarnation {pk.src_incarnation:016x} of {w.task}, "
                f"but this worker is incarnation {w.incarnation:016x}: the key is from a previous "
                "run of this worker"
            )
        return w._is_own_task(pk.dst)

    def _check_dst(self, pk: ParsedKey) -> bool:
        """True if the producer is this worker too. Raises for a key this worker cannot receive."""
        w = self._worker
        w._check_usable()
        if not w._is_own_task(pk.dst):
            raise InvalidArgumentError(f"Invalid rendezvous key (dst): {pk.full_key} @ {w.task}")
        if not w._is_own_task(pk.src):
            return False
        if pk.src_incarnation not in (0, w.incarnation):
            raise AbortedError(
                f"RecvTensor expects a different device incarnation: {pk.src_incarnation:016x} vs. "
                f'{w.incarnation:016x}. Your worker job ("{w.task}") was probably restarted; '
                f"key {pk.full_key!r}"
            )
        return True

    def _raise_if_aborted(self) -> None:
        if self._error is not None:
            raise self._error

    # -- Rendezvous --------------------------------------------------------------------

    def send(self, key: str | ParsedKey, value: Any, *, is_dead: bool = False) -> None:
        pk = as_parsed_key(key)
        local = self._check_src(pk)
        self._raise_if_aborted()
        arr = check_value(value, pk.full_key)
        if local:
            self._local.send(pk, arr, is_dead=is_dead)
        else:
            self._worker._transport_to(pk.dst, pk).send(self.step_id, pk, arr, bool(is_dead))

    def recv(
        self, key: str | ParsedKey, *, timeout: float | None = None, copy: bool = False
    ) -> Received:
        pk = as_parsed_key(key)
        if not self._check_dst(pk):
            self._raise_if_aborted()
            blocking = getattr(self._worker._transport_from(pk.src, pk), "recv_blocking", None)
            if blocking is not None:
                # Shared memory: the receiving thread waits on the doorbell itself.
                result: Received = blocking(self.step_id, pk, check_timeout(timeout), copy)
                return result
        return super().recv(pk, timeout=timeout, copy=copy)

    recv.__doc__ = Rendezvous.recv.__doc__

    def _start_recv(self, key: ParsedKey, done: DoneCallback, copy: bool) -> Canceller:
        local = self._check_dst(key)
        self._raise_if_aborted()
        if local:
            return self._local._start_recv(key, done, copy)
        return self._worker._transport_from(key.src, key).start_recv(self.step_id, key, done, copy)

    def allocate(self, key: str | ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """An array to fill and then ``send(key, array)``.

        For a consumer on this host it lies in a shared-memory segment, so ``send`` only
        publishes it: no copy at all. It may be sent once, under this key only.
        """
        pk = as_parsed_key(key)
        local = self._check_src(pk)
        self._raise_if_aborted()
        if local:
            return super().allocate(pk, shape, dtype)
        return self._worker._transport_to(pk.dst, pk).allocate(self.step_id, pk, shape, dtype)

    def start_abort(self, error: BaseException) -> None:
        if not isinstance(error, BaseException):
            raise InvalidArgumentError(f"start_abort needs an exception, not {error!r}")
        with self._lock:
            if self._error is not None:
                return
            self._error = error
        self._local.start_abort(error)
        for t in self._worker._active_transports():
            t.abort_step(self.step_id, error)

    @property
    def aborted(self) -> BaseException | None:
        """The abort error, or ``None`` while the step is open."""
        return self._error

    def stats(self) -> dict[str, int]:
        return self._local.stats()
