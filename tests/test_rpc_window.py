"""The gRPC transport's window accounting around its outbox: a pull gives the bytes back,
a requeue counts them again, a cleaned-up step returns what its outbox held (a real
GrpcTransport with its server on loopback)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shmrdv._devices import DeviceName
from shmrdv._errors import AbortedError, ResourceExhaustedError
from shmrdv._keys import parse_key
from shmrdv._peers import Peers
from shmrdv._received import Received
from shmrdv._rpc.transport import GrpcTransport
from shmrdv._shm.board import ShmBoard
from shmrdv._transport import TransportContext
from tests.helpers import PRODUCER, make_key


@pytest.fixture
def transport(ns: str) -> Iterator[GrpcTransport]:
    peers = Peers(ShmBoard(ns), None)
    task = DeviceName.parse(PRODUCER)
    ctx = TransportContext(
        task=task,
        task_name=PRODUCER,
        incarnation=1,
        namespace=ns,
        peers=peers,
        cleaned_up=lambda step: False,
        max_inflight_bytes=1000,
    )
    t = GrpcTransport(ctx, "127.0.0.1:0", tls=None, token=None)
    yield t
    t.close()
    peers.close()


def test_rpc_window_pull_requeue_and_cleanup(transport: GrpcTransport) -> None:
    pk = parse_key(make_key("w"))
    transport.send(5, pk, np.zeros(600, np.uint8), False, None)
    transport.send(5, pk, np.ones(400, np.uint8), False, None)
    assert transport.stats()["inflight_bytes"] == 1000
    with pytest.raises(ResourceExhaustedError, match="max_inflight_bytes=1000"):
        transport.send(5, pk, np.ones(1, np.uint8), False, 0.05)
    assert transport.stats()["window_waits"] == 1
    got: list[Received] = []
    transport.serve_recv(5, pk, lambda error, received: got.append(received))  # type: ignore[arg-type]
    assert got and got[0].value.nbytes == 600
    assert transport.stats()["inflight_bytes"] == 400  # the pull took it
    transport.requeue(5, pk, got[0])  # its call failed: back in flight, without waiting
    assert transport.stats()["inflight_bytes"] == 1000
    transport.abort_step(5, AbortedError("Cleanup 5"))
    transport.cleanup_step(5)
    assert transport.stats()["inflight_bytes"] == 0
    transport.send(6, pk, np.ones(1000, np.uint8), False, 0.05)  # the whole window again
    assert transport.stats()["inflight_bytes"] == 1000
