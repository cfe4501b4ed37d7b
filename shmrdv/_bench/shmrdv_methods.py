"""shmrdv's own methods for ``shmrdv bench``: the same handoff through Worker rendezvous.

* ``shmrdv_send``: ``rdv.send(key, src)`` over shared memory (one copy into a warm pool
  slot); the ponger's ``recv`` returns a zero-copy view.
* ``shmrdv_allocate``: the producer writes into ``rdv.allocate(...)`` (untimed
  ``prepare``, as a real producer makes its data in place) and ``send`` only publishes
  it: the handoff costs no copy at all.
* ``shmrdv_grpc``: the same keys forced over gRPC on loopback (``transports=("grpc",)``).
* ``shmrdv_grpc_step``: ``shmrdv_grpc`` in TensorFlow's pattern: every round trip's
  data is received in a step of its own (``rendezvous(step)``, ``recv``,
  ``cleanup(step)``), so each receive is one ``RecvTensor`` call; the ack comes back as
  in ``shmrdv_grpc`` (step 0, one key).
* ``shmrdv_busy`` / ``shmrdv_busy_allocate``: ``shmrdv_send`` / ``shmrdv_allocate`` with
  ``Worker(busy_poll=BUSY_POLL_S)`` on both sides: a blocked receive polls shared memory
  that long before it blocks (issue 18 §1, the low-latency option), against iceoryx2's
  busy-polling (``iceoryx_methods``).

The ack travels back through shmrdv too (a 4-int64 array on a reverse key), so a round
trip is two shmrdv handoffs.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import numpy.typing as npt

from .contract import Ack, Handler, MethodSpec, RoleContext
from .methods import register_method

PINGER_TASK = "/job:bench/replica:0/task:0"
PONGER_TASK = "/job:bench/replica:0/task:1"
_DATA = None  # keys are built lazily (importing shmrdv in the runner is not needed)
_TIMEOUT = 120.0
# shmrdv_busy*: how long a blocked receive polls before it blocks. Far above the bench's
# gap (50 µs) and a 16 MiB handoff, so every timed handoff is found by polling; the idle
# probe (seconds) shows that the poll then stops.
BUSY_POLL_S = 0.1


def _keys() -> tuple[str, str]:
    import shmrdv

    a, b = PINGER_TASK + "/device:CPU:0", PONGER_TASK + "/device:CPU:0"
    return shmrdv.create_key(a, 0, b, "bench_data"), shmrdv.create_key(b, 0, a, "bench_ack")


def _shared(ctx: BaseContext) -> dict[str, Any]:
    import shmrdv

    return {"namespace": shmrdv.new_namespace()}


def _sweep(prefix: str, shared: Mapping[str, Any]) -> None:
    from .._shm.registry import collect

    collect(shared["namespace"])


def _transports(method: str) -> tuple[str, ...] | None:
    return ("grpc",) if method.startswith("shmrdv_grpc") else None


def _busy_poll_missing() -> str | None:
    """Why ``shmrdv_busy*`` cannot run: this shmrdv's ``Worker`` has no ``busy_poll``."""
    import shmrdv

    if "busy_poll" not in inspect.signature(shmrdv.Worker).parameters:
        return "this shmrdv's Worker has no busy_poll option (issue 18 §1)"
    return None


def _options(method: str) -> dict[str, Any]:
    """The ``Worker`` keywords that set ``method`` apart from ``shmrdv_send``."""
    if not method.startswith("shmrdv_busy"):
        return {}
    why = _busy_poll_missing()
    if why is not None:
        raise RuntimeError(f"{method}: {why}")
    return {"busy_poll": BUSY_POLL_S}


class _Pinger:
    def __init__(self, ctx: RoleContext) -> None:
        import shmrdv

        self._w = shmrdv.Worker(
            PINGER_TASK,
            namespace=ctx.shared["namespace"],
            transports=_transports(ctx.method),
            shm_pool_bytes=max(512 << 20, 4 * ctx.max_nbytes),
            **_options(ctx.method),
        )
        self._rdv = self._w.rendezvous(0)
        self._data, self._ack = _keys()
        self._allocate = ctx.method.endswith("allocate")
        self._buf: npt.NDArray[Any] | None = None
        self._per_step = ctx.method.endswith("_step")
        self._step = 0  # the last data step (shmrdv_grpc_step; the ack stays in step 0)

    def prepare(self, src: npt.NDArray[np.float32]) -> None:
        if self._allocate:
            buf = self._rdv.allocate(self._data, src.shape, src.dtype)
            np.copyto(buf, src)
            self._buf = buf

    def handoff(self, src: npt.NDArray[np.float32]) -> Ack:
        if self._allocate:
            buf, self._buf = self._buf, None
            assert buf is not None
            self._rdv.send(self._data, buf)
            del buf
        elif self._per_step:
            self._step += 1
            self._w.rendezvous(self._step).send(self._data, src)
        else:
            self._rdv.send(self._data, src)
        a = self._rdv.recv(self._ack, timeout=_TIMEOUT).value
        if self._per_step:
            self._w.cleanup(self._step)  # the ack says the data was taken
        return Ack(int(a[0]), int(a[1]), int(a[2]), int(a[3]))

    def close(self) -> None:
        self._buf = None
        self._w.cleanup(0)
        self._w.close()


class _Ponger:
    def __init__(self, ctx: RoleContext) -> None:
        import shmrdv

        self._w = shmrdv.Worker(
            PONGER_TASK,
            namespace=ctx.shared["namespace"],
            transports=_transports(ctx.method),
            **_options(ctx.method),
        )
        self._rdv = self._w.rendezvous(0)
        self._data, self._ack = _keys()
        self._per_step = ctx.method.endswith("_step")
        if ctx.method.endswith("_pending"):
            # Issue 15 §1: a consumer with many receives posted on keys not sent yet
            # (a step with many edges); each handoff must not cost more for them.
            a, b = PINGER_TASK + "/device:CPU:0", PONGER_TASK + "/device:CPU:0"
            for i in range(ctx.pending):
                self._rdv.recv_future(shmrdv.create_key(a, 0, b, f"bench_pending_{i}"))

    def serve(self, handler: Handler) -> None:
        step = 0
        while not handler.done:
            if self._per_step:  # TensorFlow's pattern: the data key once per step
                step += 1
                a = self._w.rendezvous(step).recv(self._data, timeout=None).value
            else:
                a = self._rdv.recv(self._data, timeout=None).value
            ack = handler(a)
            del a  # the slot goes back to the producer's pool
            self._rdv.send(self._ack, np.array(ack, dtype=np.int64))
            if step:
                self._w.cleanup(step)  # the step's end, as TensorFlow's worker ends it

    def close(self) -> None:
        # Over gRPC the pinger pulls the last ack from this worker's outbox: stay until it
        # has (TensorFlow's pull model: a producer serves what it sent).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            g = self._w.stats().get("grpc", {})
            if g.get("sent", 0) <= g.get("server_values_served", 0):
                break
            time.sleep(0.01)
        time.sleep(0.05)  # the call's closing status
        self._w.cleanup(0)
        self._w.close()


def shmrdv_pinger(ctx: RoleContext) -> _Pinger:
    return _Pinger(ctx)


def shmrdv_ponger(ctx: RoleContext) -> _Ponger:
    return _Ponger(ctx)


for _spec in (
    MethodSpec(
        "shmrdv_send",
        "shmrdv Worker rendezvous over shared memory: send(ndarray), zero-copy recv",
        shmrdv_pinger,
        shmrdv_ponger,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        receiver_array="writable view, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_allocate",
        "shmrdv: producer fills rdv.allocate() (untimed), send publishes it, zero-copy recv",
        shmrdv_pinger,
        shmrdv_ponger,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        receiver_array="writable view, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_grpc",
        "shmrdv Worker rendezvous forced over gRPC on loopback (RecvTensor, then the "
        "key's values pushed over RecvTensorSeries)",
        shmrdv_pinger,
        shmrdv_ponger,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        baseline="grpc_pull",  # RecvTensor is a pull: compared with a raw pull (issue 12)
        receiver_array="writable, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_grpc_step",
        "shmrdv_grpc in TensorFlow's pattern: each round trip's data key received in a "
        "new step, one RecvTensor call per receive",
        shmrdv_pinger,
        shmrdv_ponger,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        baseline="grpc_pull",
        receiver_array="writable, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_busy",
        f"shmrdv_send with Worker(busy_poll={BUSY_POLL_S:g}): receives poll before they block",
        shmrdv_pinger,
        shmrdv_ponger,
        available=_busy_poll_missing,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        baseline="shmrdv_send",
        receiver_array="writable view, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_busy_allocate",
        f"shmrdv_allocate with Worker(busy_poll={BUSY_POLL_S:g}): receives poll before they block",
        shmrdv_pinger,
        shmrdv_ponger,
        available=_busy_poll_missing,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        baseline="shmrdv_allocate",
        receiver_array="writable view, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_send_pending",
        "shmrdv_send with --pending N other receives waiting in the consumer on unsent keys",
        shmrdv_pinger,
        shmrdv_ponger,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        baseline="shmrdv_send",
        mode="pending",
        receiver_array="writable view, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_grpc_pending",
        "shmrdv_grpc with --pending N other receives waiting in the consumer on unsent keys",
        shmrdv_pinger,
        shmrdv_ponger,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        baseline="shmrdv_grpc",
        mode="pending",
        receiver_array="writable, the consumer's own",
    ),
):
    register_method(_spec)
del _spec
