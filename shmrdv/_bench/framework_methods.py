"""What machine-learning frameworks ship for moving arrays between processes, as
``shmrdv bench`` methods: ``torch_mp`` (a ``torch.multiprocessing`` Queue of shared
tensors) and ``ray`` (its object store). ``contract.py`` is the contract they follow.
"""

from __future__ import annotations

import importlib
import os
from multiprocessing.context import BaseContext
from typing import Any

import numpy.typing as npt

from .contract import (
    F32,
    Ack,
    Handler,
    MethodSpec,
    PullPonger,
    RoleContext,
    module_missing,
    role_link,
    unpack_ack,
)

__all__ = ["RAY", "TORCH_MP"]


# -- torch_mp: torch.multiprocessing Queue with share_memory_(); acks on the link Pipe ---


def _torch_shared(mp_context: BaseContext) -> dict[str, Any]:
    # Importing torch.multiprocessing registers its tensor reducers with
    # multiprocessing's ForkingPickler; the roles import it too before they touch
    # tensors. The queue is a plain multiprocessing queue and passes at spawn.
    importlib.import_module("torch.multiprocessing")
    return {"queue": mp_context.Queue()}


class _TorchPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._torch: Any = importlib.import_module("torch")
        importlib.import_module("torch.multiprocessing")
        self._queue = ctx.shared["queue"]
        self._conn = role_link(ctx)

    def handoff(self, src: F32) -> Ack:
        t = self._torch.from_numpy(src)
        t.share_memory_()  # copies into a new shared segment (file_descriptor strategy)
        self._queue.put(t)
        del t
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        self._queue.close()
        self._queue.join_thread()


class _TorchPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        importlib.import_module("torch.multiprocessing")
        self._queue = ctx.shared["queue"]
        self._conn = role_link(ctx)
        self._tensor: Any = None

    def receive(self) -> npt.NDArray[Any]:
        self._tensor = self._queue.get()
        a: npt.NDArray[Any] = self._tensor.numpy()
        return a

    def release(self) -> None:
        self._tensor = None

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)


# -- ray: ray.put in the driver, an actor method gets the (zero-copy, read-only) array ----
# Single process from the runner's view: the pinger is the Ray driver and Ray starts
# the actor's worker. The local cluster gets num_cpus=2, no dashboard, an object store
# big enough for the largest size, and is shut down on close.


def _make_ray_actor(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class _Consumer:
        def __init__(self, touch: bool) -> None:
            self._handler = Handler(touch)

        def ready(self) -> bool:
            return True

        def handle(self, a: npt.NDArray[Any]) -> Ack:
            return self._handler(a)

    return _Consumer


class _RayPinger:
    def __init__(self, ctx: RoleContext) -> None:
        ray: Any = importlib.import_module("ray")
        self._ray = ray
        # The actor's worker unpickles Handler, so it must import shmrdv from here too.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=max(2 << 30, 4 * ctx.max_nbytes),
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        self._actor = _make_ray_actor(ray).remote(ctx.handler is not None and ctx.handler.touch)
        ray.get(self._actor.ready.remote(), timeout=120)

    def handoff(self, src: F32) -> Ack:
        ref = self._ray.put(src)
        ack: Ack = self._ray.get(self._actor.handle.remote(ref), timeout=600)
        del ref
        return ack

    def close(self) -> None:
        self._ray.shutdown()


# -- the specs -----------------------------------------------------------------------------

TORCH_MP = MethodSpec(
    "torch_mp",
    "torch.multiprocessing Queue, from_numpy().share_memory_(), .numpy() (ack on a Pipe)",
    _TorchPinger,
    _TorchPonger,
    available=module_missing("torch", "torch"),
    make_shared=_torch_shared,
    receiver_array="writable (shared storage)",
)

RAY = MethodSpec(
    "ray",
    "Ray: ray.put in the driver, an actor method gets it (zero-copy view)",
    _RayPinger,
    available=module_missing("ray", "ray"),
    idle_cpu=False,
    receiver_array="read-only (object store)",
)
