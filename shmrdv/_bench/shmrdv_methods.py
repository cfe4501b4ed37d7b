"""shmrdv's own methods for ``shmrdv bench``: the same handoff through Worker rendezvous.

* ``shmrdv_send``: ``rdv.send(key, src)`` over shared memory (one copy into a warm pool
  slot); the ponger's ``recv`` returns a zero-copy view.
* ``shmrdv_allocate``: the producer writes into ``rdv.allocate(...)`` (untimed
  ``prepare``, as a real producer makes its data in place) and ``send`` only publishes
  it: the handoff costs no copy at all.
* ``shmrdv_grpc``: the same keys forced over gRPC on loopback (``transports=("grpc",)``).
* ``shmrdv_busy`` / ``shmrdv_busy_allocate``: ``shmrdv_send`` / ``shmrdv_allocate`` with
  ``Worker(busy_poll=BUSY_POLL_S)`` on both sides: a blocked receive polls shared memory
  that long before it blocks (the low-latency option), against iceoryx2's busy-polling
  (``iceoryx_methods``).

The ack travels back through shmrdv too (a 4-int64 array on a reverse key), so a round
trip is two shmrdv handoffs. Every method runs each key pattern (``common.KEY_PATTERNS``,
``--keys``); ``_Keys`` is what a role does per message under its pattern, as a user's loop
does it: ``same`` one data key and one ack key in step 0; ``fresh`` a data key and an ack
key of new edge names per message (``create_key``), in step 0; ``step`` the same two edge
names in step 1, 2, ... (``rendezvous(step)`` of the next, ``cleanup`` of the last). That
work is timed: the pinger does it after the ack, for the next message (``prepare`` then
allocates under the next key), the ponger before it sends the ack.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import numpy.typing as npt

from .common import KEY_PATTERNS
from .contract import Ack, Handler, MethodSpec, RoleContext
from .methods import register_method

PINGER_TASK = "/job:bench/replica:0/task:0"
PONGER_TASK = "/job:bench/replica:0/task:1"
_PINGER_DEV = PINGER_TASK + "/device:CPU:0"
_PONGER_DEV = PONGER_TASK + "/device:CPU:0"
_TIMEOUT = 120.0
# shmrdv_busy*: how long a blocked receive polls before it blocks. Far above the bench's
# gap (50 µs) and a 16 MiB handoff, so every timed handoff is found by polling; the idle
# probe (seconds) shows that the poll then stops.
BUSY_POLL_S = 0.1


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
        return "this shmrdv's Worker has no busy_poll option"
    return None


def _options(method: str) -> dict[str, Any]:
    """The ``Worker`` keywords that set ``method`` apart from ``shmrdv_send``."""
    if not method.startswith("shmrdv_busy"):
        return {}
    why = _busy_poll_missing()
    if why is not None:
        raise RuntimeError(f"{method}: {why}")
    return {"busy_poll": BUSY_POLL_S}


class _Keys:
    """Where a role's current message goes under its key pattern: ``rdv``, ``data`` (the
    pinger's key to the ponger) and ``ack`` (back); ``advance()`` moves on to the next
    message as a user's loop does (see the module docstring).

    ``step``: ``advance`` opens the next step and cleans up a step of the past: the pinger
    the one it leaves (its data was received, its ack taken), the ponger the one before
    (its last ack may still be in this worker, to be pulled over gRPC, until the pinger's
    next data shows it was taken). Step 0 stays open: ``--pending`` receives wait there.
    """

    def __init__(self, w: Any, pattern: str | None, role: str) -> None:
        import shmrdv

        self._w = w
        self._create_key = shmrdv.create_key
        self._pattern = pattern or "same"
        self._lag = 0 if role == "pinger" else 1
        self._n = 0  # the message: fresh, in its edge names; step, its step id
        self.rdv = w.rendezvous(0)
        self.data = self._create_key(_PINGER_DEV, 0, _PONGER_DEV, "bench_data")
        self.ack = self._create_key(_PONGER_DEV, 0, _PINGER_DEV, "bench_ack")
        if self._pattern != "same":
            self.advance()

    def advance(self) -> None:
        if self._pattern == "fresh":
            self._n += 1
            self.data = self._create_key(_PINGER_DEV, 0, _PONGER_DEV, f"bench_data_{self._n}")
            self.ack = self._create_key(_PONGER_DEV, 0, _PINGER_DEV, f"bench_ack_{self._n}")
        elif self._pattern == "step":
            self._n += 1
            self.rdv = self._w.rendezvous(self._n)
            last = self._n - 1 - self._lag
            if last >= 1:
                self._w.cleanup(last)

    def close(self) -> None:
        """Clean up every step still open (the worker is closed after)."""
        for step in {0, *range(max(1, self._n - self._lag), self._n + 1)}:
            self._w.cleanup(step)


def _worker(ctx: RoleContext, task: str, **kw: Any) -> Any:
    import shmrdv

    return shmrdv.Worker(
        task,
        namespace=ctx.shared["namespace"],
        transports=_transports(ctx.method),
        **_options(ctx.method),
        **kw,
    )


class _Pinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._w = _worker(ctx, PINGER_TASK, shm_pool_bytes=max(512 << 20, 4 * ctx.max_nbytes))
        self._keys = _Keys(self._w, ctx.keys, "pinger")
        self._allocate = ctx.method.endswith("allocate")
        self._buf: npt.NDArray[Any] | None = None

    def prepare(self, src: npt.NDArray[np.float32]) -> None:
        if self._allocate:
            buf = self._keys.rdv.allocate(self._keys.data, src.shape, src.dtype)
            np.copyto(buf, src)
            self._buf = buf

    def handoff(self, src: npt.NDArray[np.float32]) -> Ack:
        k = self._keys
        if self._allocate:
            buf, self._buf = self._buf, None
            assert buf is not None
            k.rdv.send(k.data, buf)
            del buf
        else:
            k.rdv.send(k.data, src)
        a = k.rdv.recv(k.ack, timeout=_TIMEOUT).value
        k.advance()
        return Ack(int(a[0]), int(a[1]), int(a[2]), int(a[3]))

    def close(self) -> None:
        self._buf = None
        self._keys.close()
        self._w.close()


class _Ponger:
    def __init__(self, ctx: RoleContext) -> None:
        import shmrdv

        self._w = _worker(ctx, PONGER_TASK)
        self._keys = _Keys(self._w, ctx.keys, "ponger")
        if ctx.method.endswith("_pending"):
            # A consumer with many receives posted on keys not sent yet (a step with many
            # edges): each handoff must not cost more for them.
            rdv = self._w.rendezvous(0)
            for i in range(ctx.pending):
                rdv.recv_future(
                    shmrdv.create_key(_PINGER_DEV, 0, _PONGER_DEV, f"bench_pending_{i}")
                )

    def serve(self, handler: Handler) -> None:
        k = self._keys
        while not handler.done:
            rdv, ack_key = k.rdv, k.ack
            a = rdv.recv(k.data, timeout=None).value
            ack = handler(a)
            del a  # the slot goes back to the producer's pool
            k.advance()
            rdv.send(ack_key, np.array(ack, dtype=np.int64))

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
        self._keys.close()
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
        key_patterns=tuple(KEY_PATTERNS),
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
        key_patterns=tuple(KEY_PATTERNS),
        receiver_array="writable view, the consumer's own",
    ),
    MethodSpec(
        "shmrdv_grpc",
        'shmrdv Worker rendezvous forced over gRPC on loopback (transports=("grpc",)): '
        "the consumer pulls, as TensorFlow's RecvTensor",
        shmrdv_pinger,
        shmrdv_ponger,
        make_shared=_shared,
        sweep=_sweep,
        group="shmrdv",
        key_patterns=tuple(KEY_PATTERNS),
        baseline="grpc_pull",  # RecvTensor is a pull: compared with a raw pull
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
        key_patterns=tuple(KEY_PATTERNS),
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
        key_patterns=tuple(KEY_PATTERNS),
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
        key_patterns=tuple(KEY_PATTERNS),
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
        key_patterns=tuple(KEY_PATTERNS),
        baseline="shmrdv_grpc",
        mode="pending",
        receiver_array="writable, the consumer's own",
    ),
):
    register_method(_spec)
del _spec
