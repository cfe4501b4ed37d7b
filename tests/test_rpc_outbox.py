"""The outbox's window accounting: a value a pull took counts until the server is done
with it (delivered or dropped), a requeue counts it again, a cleaned-up step returns what
its outbox held."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shmrdv._cluster import Peers
from shmrdv._errors import AbortedError, ResourceExhaustedError
from shmrdv._keys import DeviceName, parse_key
from shmrdv._rendezvous import Received
from shmrdv._rpc.outbox import Outbox
from shmrdv._shm.transport import ShmBoard
from shmrdv._transport import TransportContext
from tests.helpers import PRODUCER, make_key


@pytest.fixture
def outbox(ns: str) -> Iterator[Outbox]:
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
    box = Outbox(ctx)
    yield box
    box.close()
    peers.close()


def test_outbox_window_counts_a_value_until_the_server_is_done_with_it(outbox: Outbox) -> None:
    pk = parse_key(make_key("w"))
    outbox.send(5, pk, np.zeros(600, np.uint8), False, None)
    outbox.send(5, pk, np.ones(400, np.uint8), False, None)
    assert outbox.stats()["inflight_bytes"] == 1000
    with pytest.raises(ResourceExhaustedError, match="max_inflight_bytes=1000"):
        outbox.send(5, pk, np.ones(1, np.uint8), False, 0.05)
    assert outbox.stats()["window_waits"] == 1
    got: list[Received] = []
    outbox.serve_recv(5, pk, lambda error, received: got.append(received))  # type: ignore[arg-type]
    assert got and got[0].value.nbytes == 600
    assert outbox.stats()["inflight_bytes"] == 1000  # taken, not delivered: still counts
    outbox.done_with(5, pk, 600)  # its call ended: delivered
    assert outbox.stats()["inflight_bytes"] == 400
    outbox.requeue(5, pk, got[0])  # a client gave it back: in flight again, without waiting
    assert outbox.stats()["inflight_bytes"] == 1000
    outbox.abort_step(5, AbortedError("Cleanup 5"))
    outbox.cleanup_step(5)
    assert outbox.stats()["inflight_bytes"] == 0
    outbox.done_with(5, pk, 600)  # a late report of a cleaned-up step gives back nothing
    outbox.send(6, pk, np.ones(1000, np.uint8), False, 0.05)  # the whole window again
    assert outbox.stats()["inflight_bytes"] == 1000
