"""The standard library's ways between processes, as ``shmrdv bench`` methods: a
``multiprocessing`` Pipe with out-of-band pickle buffers, a ``multiprocessing`` Queue, a new
``multiprocessing.shared_memory`` segment per message (``contract.py``: their contract).
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Mapping
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
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
    role_link,
    unpack_ack,
)

__all__ = ["MP_PIPE_OOB", "MP_QUEUE", "SHM_PER_MSG", "pipe_oob_recv", "pipe_oob_send"]


# -- mp_pipe_oob: multiprocessing.Pipe, pickle protocol 5, out-of-band buffers -----------
# Message: send_bytes(<uint32 buffer count> + pickle), then each buffer with send_bytes.
# The ack goes back on the same duplex Pipe.

_COUNT = struct.Struct("<I")


def pipe_oob_send(conn: Connection, a: npt.NDArray[Any]) -> None:
    """Send ``a`` on ``conn`` as pickle protocol 5 with its buffers out of band."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(a, protocol=5, buffer_callback=buffers.append)
    conn.send_bytes(_COUNT.pack(len(buffers)) + head)
    for buf in buffers:
        conn.send_bytes(buf.raw())


def pipe_oob_recv(conn: Connection) -> npt.NDArray[Any]:
    """The next array that ``pipe_oob_send`` sent on ``conn``'s other end."""
    msg = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(msg)
    buffers = [conn.recv_bytes() for _ in range(count)]
    a: npt.NDArray[Any] = pickle.loads(memoryview(msg)[_COUNT.size :], buffers=buffers)
    return a


class _PipeOobPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = role_link(ctx)

    def handoff(self, src: F32) -> Ack:
        pipe_oob_send(self._conn, src)
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        pass


class _PipeOobPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = role_link(ctx)

    def receive(self) -> npt.NDArray[Any]:
        return pipe_oob_recv(self._conn)

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)


# -- mp_queue: multiprocessing.Queue put/get; acks on the link Pipe ---------------------


def _queue_shared(mp_context: BaseContext) -> dict[str, Any]:
    return {"queue": mp_context.Queue()}


class _QueuePinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._queue = ctx.shared["queue"]
        self._conn = role_link(ctx)

    def handoff(self, src: F32) -> Ack:
        # put() pickles src later in the feeder thread; src is not touched before the ack.
        self._queue.put(src)
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        self._queue.close()
        self._queue.join_thread()


class _QueuePonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        self._queue = ctx.shared["queue"]
        self._conn = role_link(ctx)

    def receive(self) -> npt.NDArray[Any]:
        a: npt.NDArray[Any] = self._queue.get()
        return a

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)


# -- shm_per_msg: a new multiprocessing.shared_memory segment per message ----------------
# Resource tracker (research/pitfalls.md §1, cpython#82300): on 3.11 every
# SharedMemory() registers its name with the tracker, and a tracker unlinks what is
# still registered when its last user exits. Both roles are spawned by the runner and
# so share the runner's tracker, whose cache is a set: the pinger's create registers,
# the ponger's attach re-registers (no-op), the ponger's unlink() unregisters. The
# pinger only close()s and never unlinks or unregisters, which would trip the tracker's
# KeyError (cpython#116849). The runner sweeps the prefix if a role dies mid-message.


class _ShmPerMsgPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = role_link(ctx)
        self._prefix = ctx.prefix
        self._seq = 0

    def handoff(self, src: F32) -> Ack:
        from multiprocessing import shared_memory

        self._seq += 1
        name = f"{self._prefix}m{self._seq}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=src.nbytes)
        try:
            dst: F32 = np.ndarray(src.shape, src.dtype, buffer=shm.buf)
            np.copyto(dst, src)
            del dst
        finally:
            shm.close()
        self._conn.send_bytes(NBYTES.pack(src.nbytes) + name.encode())
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        pass


class _ShmPerMsgPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = role_link(ctx)
        self._shm: Any = None

    def receive(self) -> npt.NDArray[Any]:
        from multiprocessing import shared_memory

        msg = self._conn.recv_bytes()
        (nbytes,) = NBYTES.unpack_from(msg)
        name = msg[NBYTES.size :].decode()
        shm = shared_memory.SharedMemory(name=name)
        self._shm = shm
        a: F32 = np.ndarray((nbytes // 4,), np.float32, buffer=shm.buf)
        return a

    def release(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
            shm.unlink()

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)

    def close(self) -> None:
        self.release()


def _shm_per_msg_sweep(prefix: str, shared: Mapping[str, Any]) -> None:
    """Unlink segments a killed role left, and drop them from the runner's tracker.

    Runs in the runner, whose resource tracker the roles share: without the
    unregister, the tracker would try to unlink them again at exit and warn.
    """
    from multiprocessing import resource_tracker

    stem = prefix + "m"
    for entry in os.listdir("/dev/shm"):
        if entry.startswith(stem) and entry[len(stem) :].isdigit():
            try:
                os.unlink(os.path.join("/dev/shm", entry))
            except OSError:
                continue
            resource_tracker.unregister("/" + entry, "shared_memory")


# -- the specs -----------------------------------------------------------------------------

MP_PIPE_OOB = MethodSpec(
    "mp_pipe_oob",
    "multiprocessing.Pipe, pickle protocol 5 with out-of-band buffers",
    _PipeOobPinger,
    _PipeOobPonger,
    receiver_array="read-only (backed by bytes)",
)

MP_QUEUE = MethodSpec(
    "mp_queue",
    "multiprocessing.Queue put/get (ack on a Pipe)",
    _QueuePinger,
    _QueuePonger,
    make_shared=_queue_shared,
    receiver_array="writable",
)

SHM_PER_MSG = MethodSpec(
    "shm_per_msg",
    "new multiprocessing.shared_memory segment per message, name over a Pipe, view",
    _ShmPerMsgPinger,
    _ShmPerMsgPonger,
    sweep=_shm_per_msg_sweep,
    receiver_array="writable view (segment unlinked after use)",
)
