"""pyzmq as a ``shmrdv bench`` method: ``zmq_ipc``, a PAIR socket on ``ipc://`` with
zero-copy frames (``contract.py`` is the contract it follows).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from .contract import (
    F32,
    NBYTES,
    Ack,
    MethodSpec,
    PullPonger,
    RoleContext,
    module_missing,
    recv_link,
    role_link,
    unpack_ack,
)

__all__ = ["ZMQ_IPC"]


# -- zmq_ipc: pyzmq PAIR over ipc://, zero-copy frames --------------------------------------


def _zmq_endpoint(ctx: RoleContext) -> str:
    return f"ipc://{os.path.join(ctx.scratch_dir, ctx.prefix + 'zmq.sock')}"


class _ZmqPinger:
    def __init__(self, ctx: RoleContext) -> None:
        zmq: Any = importlib.import_module("zmq")
        recv_link(role_link(ctx), "zmq bind message")
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(_zmq_endpoint(ctx))

    def handoff(self, src: F32) -> Ack:
        self._sock.send_multipart([NBYTES.pack(src.nbytes), src], copy=False)
        return unpack_ack(self._sock.recv())

    def close(self) -> None:
        self._sock.close()
        self._zctx.term()


class _ZmqPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        zmq: Any = importlib.import_module("zmq")
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_zmq_endpoint(ctx))
        self._frames: Any = None
        role_link(ctx).send("bound")

    def receive(self) -> npt.NDArray[Any]:
        self._frames = self._sock.recv_multipart(copy=False)
        return np.frombuffer(self._frames[1].buffer, np.float32)

    def release(self) -> None:
        self._frames = None

    def send_ack(self, data: bytes) -> None:
        self._sock.send(data)

    def close(self) -> None:
        self._frames = None
        self._sock.close()
        self._zctx.term()


ZMQ_IPC = MethodSpec(
    "zmq_ipc",
    "pyzmq PAIR on ipc://, send_multipart(copy=False), np.frombuffer(frame)",
    _ZmqPinger,
    _ZmqPonger,
    available=module_missing("zmq", "pyzmq"),
    receiver_array="read-only (zmq frame)",
)
