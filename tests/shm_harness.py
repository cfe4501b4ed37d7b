"""Drive ``ShmTransport`` directly, through the seam contract, without a Worker or a router.

An ``Endpoint`` is what a Worker gives its transports: a presence record of its own (so
peers see it alive), a real ``Peers`` directory and a ``TransportContext``; ``recv`` is
the one blocking loop (``wait_received``) helped by the transport's ``wait``, as the
router calls it. Usable in this process or in a child (``python -m`` not needed: run
with the repository on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import time
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from shmrdv._cluster import Peers, canonical_task
from shmrdv._keys import DeviceName, ParsedKey, create_key, parse_key
from shmrdv._rendezvous import Received, RecvSlot, wait_received
from shmrdv._shm.naming import Names
from shmrdv._shm.presence import Presence, PresenceInfo, boot_id
from shmrdv._shm.transport import ShmBoard, ShmTransport
from shmrdv._transport import TransportContext

__all__ = ["Endpoint", "key_between"]


def key_between(src_task: str, dst_task: str, name: str, incarnation: int = 0) -> ParsedKey:
    """The parsed key of edge ``name`` from CPU:0 of ``src_task`` to CPU:0 of ``dst_task``."""
    return parse_key(
        create_key(src_task + "/device:CPU:0", incarnation, dst_task + "/device:CPU:0", name)
    )


class Endpoint:
    """One worker's shared-memory transport, built as a Worker builds it."""

    def __init__(
        self, namespace: str, task: str, *, incarnation: int = 0, pool_bytes: int = 256 << 20
    ) -> None:
        self.names = Names(namespace)
        self.task = str(canonical_task(DeviceName.parse(task)))
        self.incarnation = incarnation or int.from_bytes(os.urandom(8), "little") | 1
        self.cleaned: set[int] = set()
        self.presence = Presence.publish(
            self.names,
            PresenceInfo(
                task=self.task,
                pid=os.getpid(),
                boot_id=boot_id(),
                incarnation=self.incarnation,
                started=time.time(),
                namespace=namespace,
            ),
        )
        self.peers = Peers(ShmBoard(namespace), None)
        self.ctx = TransportContext(
            task=canonical_task(DeviceName.parse(task)),
            task_name=self.task,
            incarnation=self.incarnation,
            namespace=namespace,
            peers=self.peers,
            cleaned_up=self.cleaned.__contains__,
        )
        self.transport = ShmTransport(self.ctx, pool_bytes=pool_bytes)

    def send(
        self, step: int, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool = False
    ) -> None:
        self.transport.send(step, key, value, is_dead, None)

    def recv(self, step: int, key: ParsedKey, timeout: float | None = 10.0) -> Received:
        slot = RecvSlot()
        cancel = self.transport.start_recv(step, key, slot.done, blocking=True)
        return wait_received(slot, cancel, key, timeout, self.transport.wait)

    def cleanup(self, step: int) -> None:
        from shmrdv._errors import AbortedError

        self.cleaned.add(step)
        self.transport.cleanup_step(step, AbortedError(f"Cleanup {step}"))

    def close(self) -> None:
        self.transport.close()
        self.peers.close()
        self.presence.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _demo() -> None:  # pragma: no cover - a smoke run: python tests/shm_harness.py
    import shmrdv

    ns = shmrdv.new_namespace()
    a, b = "/job:h/replica:0/task:0", "/job:h/replica:0/task:1"
    with Endpoint(ns, a) as pa, Endpoint(ns, b) as pb:
        k = key_between(a, b, "x")
        pa.send(1, k, np.arange(4))
        print(pb.recv(1, k))


if __name__ == "__main__":  # pragma: no cover
    _demo()
