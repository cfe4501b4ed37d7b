"""The cross-host transport: TensorFlow's pull model over gRPC.

Producer side: ``send`` to a consumer on another host buffers the value in this worker's
*outbox* for the step (an in-process ``LocalRendezvous``); the consumer's RecvTensor
call, served by ``RpcServer``, takes it from there, waiting up to the call's deadline.
The outbox is created on the first send or request of a step and dropped by
``cleanup_step``; a request for a step already cleaned up fails at once with ``ABORTED``
(TensorFlow's FindOrCreate would wait forever).

Consumer side: ``start_recv`` pulls the next value of the key from the producer's
address (the cluster's, else the producer's presence record) through ``RpcClient``;
aborting or cleaning up the step cancels the calls in flight.

Thread model: the server runs its own event loop thread; the client runs one thread per
receive in flight; ``done`` callbacks run in those threads, never under a lock of ours.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._callbacks import DoneCallback, invoke_done
from .._errors import AbortedError, InvalidArgumentError
from .._keys import ParsedKey
from .._local import LocalRendezvous
from .._received import Received
from .._rendezvous import Canceller
from .client import RpcClient
from .server import RpcServer

if TYPE_CHECKING:
    from .._worker import Worker
    from .security import TLSConfig

__all__ = ["GrpcTransport"]

_log = logging.getLogger("shmrdv.rpc")


class GrpcTransport:
    """gRPC transport of one Worker; also the ``TensorSource`` its server serves from."""

    name = "grpc"

    def __init__(
        self, worker: Worker, bind: str | None, *, tls: TLSConfig | None, token: str | None
    ) -> None:
        self._w = worker
        self.task: str = worker.task
        self.incarnation: int = worker.incarnation
        self._lock = threading.Lock()
        self._outboxes: dict[int, LocalRendezvous] = {}
        self._aborted: dict[int, BaseException] = {}
        self._inflight: dict[int, dict[int, tuple[Canceller, DoneCallback]]] = {}
        self._next_call = 0
        self._owned: dict[int, weakref.ref[npt.NDArray[Any]]] = {}
        self._closed = False
        self._counters = {"sent": 0, "sent_bytes": 0, "received": 0, "received_bytes": 0}
        self._client = RpcClient(tls=tls, token=token)
        self._server: RpcServer | None = None
        self.address: str | None = None
        if bind is not None:
            self._server = RpcServer(bind, self, tls=tls, token=token).start()
            self.address = self._server.address

    def __repr__(self) -> str:
        return f"<GrpcTransport {self.task} address={self.address} closed={self._closed}>"

    # -- producer side --------------------------------------------------------------

    def _outbox(self, step_id: int) -> LocalRendezvous:
        with self._lock:
            if self._closed:
                raise AbortedError(f"Worker {self.task} is closed")
            err = self._aborted.get(step_id)
            if err is not None:
                raise err
            box = self._outboxes.get(step_id)
            if box is None:
                box = self._outboxes[step_id] = LocalRendezvous()
            return box

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        try:
            arr: npt.NDArray[Any] = np.empty(shape, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"allocate({key.full_key!r}): bad shape {shape!r} or dtype {dtype!r}: {e}"
            ) from e
        with self._lock:
            self._owned[id(arr)] = weakref.ref(arr)
        weakref.finalize(arr, self._owned.pop, id(arr), None)
        return arr

    def send(self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool) -> None:
        box = self._outbox(step_id)
        ref = self._owned.pop(id(value), None)
        if ref is not None and ref() is value:
            # From allocate(): hand it over as is, and stop the producer writing into it.
            value.flags.writeable = False
        else:
            # The caller keeps its array and may reuse it at once: buffer a copy (the
            # same one copy the shared-memory path makes).
            value = np.array(value, copy=True, order="C")
        box.send(key, value, is_dead=is_dead)
        self._counters["sent"] += 1
        self._counters["sent_bytes"] += value.nbytes

    # TensorSource, called by the server for every RecvTensor.
    def serve_recv(self, step_id: int, key: ParsedKey, done: DoneCallback) -> Canceller:
        if self._w.is_cleaned_up(step_id):
            raise AbortedError(
                f"Cleanup {step_id}: step {step_id} of {self.task} was already cleaned up"
            )
        return self._outbox(step_id)._start_recv(key, done, False)

    def requeue(self, step_id: int, key: ParsedKey, received: Received) -> None:
        """A value taken for a call that then failed goes back to the head of its key."""
        with self._lock:
            box = self._outboxes.get(step_id)
        if box is not None:
            box.requeue(key, received)

    # -- consumer side --------------------------------------------------------------

    def start_recv(self, step_id: int, key: ParsedKey, done: DoneCallback, copy: bool) -> Canceller:
        address = self._w.peer_address(key.src, key)
        with self._lock:
            if self._closed:
                raise AbortedError(f"Worker {self.task} is closed")
            err = self._aborted.get(step_id)
            if err is not None:
                raise err
            call_id = self._next_call
            self._next_call += 1
            calls = self._inflight.setdefault(step_id, {})

        def finish(error: BaseException | None, received: Received | None) -> None:
            with self._lock:
                step_calls = self._inflight.get(step_id)
                if step_calls is None or step_calls.pop(call_id, None) is None:
                    return  # aborted meanwhile: abort_step already answered
            if received is not None:
                self._counters["received"] += 1
                self._counters["received_bytes"] += received.value.nbytes
                if copy or not received.value.flags.writeable:
                    received = Received(np.array(received.value, copy=True), received.is_dead)
            invoke_done(done, error, received)

        cancel = self._client.start_recv(address, step_id, key, finish)
        with self._lock:
            calls[call_id] = (cancel, done)

        def canceller() -> bool:
            with self._lock:
                step_calls = self._inflight.get(step_id)
                if step_calls is None or call_id not in step_calls:
                    return False
            if not cancel():
                return False
            with self._lock:
                step_calls = self._inflight.get(step_id)
                return step_calls is not None and step_calls.pop(call_id, None) is not None

        return canceller

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        with self._lock:
            self._aborted.setdefault(step_id, error)
            error = self._aborted[step_id]
            box = self._outboxes.get(step_id)
            calls = self._inflight.pop(step_id, {})
        if box is not None:
            box.start_abort(error)
        for cancel, done in calls.values():
            # Stop the call in flight; if its value already arrived, finish() drops it
            # (the step is aborted) and this is the answer the caller gets.
            cancel()
            invoke_done(done, error, None)

    def cleanup_step(self, step_id: int) -> None:
        with self._lock:
            self._outboxes.pop(step_id, None)
            self._aborted.pop(step_id, None)
            self._inflight.pop(step_id, None)
        if self._server is not None:
            self._server.drop_step(step_id)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            boxes = list(self._outboxes.values())
            self._outboxes.clear()
            steps = list(self._inflight)
        error = AbortedError(f"Worker {self.task} closed")
        for step in steps:
            self.abort_step(step, error)
        for box in boxes:
            box.start_abort(error)
        if self._server is not None:
            self._server.stop()
        self._client.close()

    def stats(self) -> dict[str, int]:
        out = dict(self._counters)
        with self._lock:
            out["outbox_steps"] = len(self._outboxes)
            out["outbox_values"] = sum(b.stats()["pending_values"] for b in self._outboxes.values())
            out["calls_in_flight"] = sum(len(c) for c in self._inflight.values())
        if self._server is not None:
            out.update({f"server_{k}": v for k, v in self._server.stats().items()})
        return out
