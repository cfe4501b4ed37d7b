"""Values of no bytes (a shape with a 0 dimension) count in the gRPC bounds like any.

Each value costs memory even without data (its array, its header, the tables that hold
it): the producer's window (``max_inflight_bytes``) and a series' prefetch bound count
it at least ``VALUE_FLOOR`` bytes, so a flood of empty values stops at the bound, as a
flood of full ones does. Before, they counted 0: the window let every send through and
a series took every value into its table.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import StepSource, make_key, series_client

import shmrdv
from shmrdv._errors import AbortedError, ResourceExhaustedError
from shmrdv._rendezvous import RecvSlot
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.server import RpcServer
from shmrdv._window import VALUE_FLOOR

pytestmark = pytest.mark.timeout(60)

source = rpc_helpers.source

_P = "/job:empty/replica:0/task:0"
_C = "/job:empty/replica:0/task:1"


@pytest.mark.parametrize("value", [np.zeros((0, 4)), np.zeros(3, "V0")], ids=["0-dim", "V0"])
def test_empty_values_fill_the_producers_window(ns: str, value: np.ndarray) -> None:
    window = 64 << 10
    key = shmrdv.create_key(_P + "/device:CPU:0", 0, _C + "/device:CPU:0", "empty")
    with (
        shmrdv.Worker(_P, namespace=ns, transports=("grpc",), max_inflight_bytes=window) as p,
        shmrdv.Worker(_C, namespace=ns, transports=("grpc",)),
    ):
        rdv = p.rendezvous(1)
        sent = 0
        with pytest.raises(ResourceExhaustedError, match="max_inflight_bytes"):
            while sent < 20_000:  # before: every one went through
                rdv.send(key, value, timeout=0.2)
                sent += 1
        assert sent == window // VALUE_FLOOR
        assert p.stats()["grpc"]["inflight_bytes"] == window


def test_empty_values_fill_a_series_to_its_bound(source: StepSource) -> None:
    """A series that nobody receives from keeps at most its bound of empty values (plus
    one message of the producer's, here ``chunk_bytes`` 4 KiB); then it stops reading."""
    bound, chunk = 4096, 4096
    key = make_key("empties")
    with (
        RpcServer("127.0.0.1:0", source, chunk_bytes=chunk) as server,
        RpcClient() as client,
    ):
        series = series_client(client, server.address, prefetch_bytes=bound)
        try:
            for _ in range(3000):
                source.send(1, key, np.zeros((0, 2), np.float32))
            slot = RecvSlot()
            assert series.start_recv(1, key, slot.done, lambda: server.address) is not None
            assert slot.wait(10)
            assert slot.result().value.shape == (0, 2)
            wait_for(lambda: series.stats()["series_held_values"] > 0, timeout=10)
            time.sleep(0.5)  # anything more that came would show now
            stats = series.stats()
            # Before: 2,999 values in the table, counted 0 bytes.
            assert stats["series_held_values"] * VALUE_FLOOR <= bound + chunk
            assert stats["series_held_peak"] <= bound + chunk
        finally:
            series.close(AbortedError("end"))
