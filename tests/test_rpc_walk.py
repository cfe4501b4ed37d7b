"""How far a blocking gRPC receive walks (issue 19 §2): the modules of ours it crosses.

TensorFlow's pattern receives a key once per step (``rendezvous(step)``, ``recv``,
``cleanup(step)``), so every receive is one ``RecvTensor`` call made by the receiving
thread (``_rpc.client``). A real producer and consumer Worker on loopback, forced over
gRPC; ``sys.setprofile`` on the receiving thread only lists the ``shmrdv`` modules whose
Python functions that receive calls. The steady state (steps after the first, which
also finds the producer's address and opens the channel) must stay within
``MAX_MODULES``: a receive that picks up a module again (a thread hop's queue, a second
decode, a lookup per receive) fails here.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv

pytestmark = pytest.mark.timeout(60)

#: The receive's modules at steady state: the rendezvous and the step's router, the
#: key's parse (no cache per key: a key used once costs what a reused one does), the
#: transport, the client and the core's per-key table it orders receives in, the messages
#: (request out, response in), the wire (its varints and TensorProto) and the value's
#: element-count rule.
MAX_MODULES = 9


def _walk(rdv: shmrdv.Rendezvous, key: str) -> list[str]:
    """The shmrdv modules one blocking ``recv`` of ``key`` calls into, in first-call order."""
    seen: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("shmrdv") and module not in seen:
                seen.append(module)

    sys.setprofile(profile)  # this thread only
    try:
        received = rdv.recv(key, timeout=10)
    finally:
        sys.setprofile(None)
    assert received.value.tolist() == [0.0, 1.0, 2.0, 3.0]
    return seen


def test_a_per_step_grpc_receive_crosses_few_modules(ns: str) -> None:
    key = make_key("walk")
    with (
        shmrdv.Worker(PRODUCER, namespace=ns, transports=("grpc",)) as producer,
        shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as consumer,
    ):
        walks = []
        for step in (1, 2, 3, 4):
            sender = threading.Timer(0.05, producer.rendezvous(step).send, (key, np.arange(4.0)))
            sender.start()
            try:
                walks.append(_walk(consumer.rendezvous(step), key))
            finally:
                sender.join(10)
            consumer.cleanup(step)
            producer.cleanup(step)
        for walk in walks[1:]:
            assert len(walk) <= MAX_MODULES, f"{len(walk)} modules: {' -> '.join(walk)}"
            assert "shmrdv._rpc.client" in walk, walk  # the receiving thread makes the call
