"""The one registry of ``shmrdv bench``'s methods: every method by name (``METHODS``),
in the order the report lists them.

The peers' specs live beside their code (``floor_methods``, ``mp_methods``,
``zmq_methods``, ``framework_methods``, ``grpc_methods``) and are registered here;
shmrdv's own (``shmrdv_methods``) and iceoryx2's (``iceoryx_methods``) register
themselves with ``register_method`` when the runner loads them. ``contract.py`` is what
a method is.
"""

from __future__ import annotations

from . import floor_methods, framework_methods, grpc_methods, mp_methods, zmq_methods
from .contract import MethodSpec

__all__ = ["ALIASES", "METHODS", "register_method"]

METHODS: dict[str, MethodSpec] = {}
ALIASES = {"grpc_unary": "grpc_push"}  # the push's name before grpc_pull existed


def register_method(spec: MethodSpec) -> None:
    """Add (or replace) a method in ``METHODS``."""
    METHODS[spec.name] = spec


for _spec in (
    floor_methods.MEMCPY,
    floor_methods.MEMCPY_SHM,
    floor_methods.SEM_PINGPONG,
    floor_methods.SEM_COPY,
    floor_methods.SEM_FILL,
    floor_methods.SPIN_COPY,
    floor_methods.SPIN_FILL,
    mp_methods.MP_PIPE_OOB,
    mp_methods.MP_QUEUE,
    mp_methods.SHM_PER_MSG,
    zmq_methods.ZMQ_IPC,
    framework_methods.TORCH_MP,
    grpc_methods.GRPC_PULL,
    grpc_methods.GRPC_PULL_PIGGYBACK,
    grpc_methods.GRPC_PUSH,
    framework_methods.RAY,
):
    register_method(_spec)
del _spec
# shmrdv's own methods come after these, registered by shmrdv_methods through
# register_method() with group="shmrdv": shmrdv_send (Worker rendezvous send/recv over
# shared memory), shmrdv_allocate (rdv.allocate + fill + send, zero-copy send) and
# shmrdv_grpc (the same keys forced over transports=("grpc",)); then iceoryx2's.
