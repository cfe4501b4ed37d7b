"""Values of no bytes (a shape with a 0 dimension) count in the gRPC bounds like any.

Each value costs memory even without data (its array, its header, the tables that hold
it): the producer's window (``max_inflight_bytes``) and a series' prefetch bound count
it at least ``VALUE_FLOOR`` bytes, so a flood of empty values stops at the bound, as a
flood of full ones does. Before, they counted 0: the window let every send through and
a series took every value into its table.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import rpc_helpers
from rpc_helpers import CHANNEL_OPTIONS, StepSource, make_key

import shmrdv
from shmrdv._errors import ResourceExhaustedError
from shmrdv._rpc import messages
from shmrdv._rpc.guard import Limits
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
    """A series pushes at most its bound of empty values ahead of its consumer's
    acknowledgement, each counted ``VALUE_FLOOR`` bytes (before: 2,999 pushed, counted 0)."""
    bound = 4096
    key = make_key("empties")
    with (
        RpcServer("127.0.0.1:0", source, limits=Limits(max_pushed_bytes=bound)) as server,
        grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch,
    ):
        for _ in range(3000):
            source.send(1, key, np.zeros((0, 2), np.float32))
        request = messages.encode_request(1, key.full_key, 7)
        call = ch.unary_stream(messages.RECV_TENSOR_SERIES)(request, timeout=2.0)
        got = 0
        with pytest.raises(grpc.RpcError) as info:  # read all it pushes, acknowledging none
            for message in call:
                assembly = messages.Assembly()
                value = assembly.feed(message) if message else None
                for v in [value, *(messages.Assembly().feed(p) for p in assembly.packed)]:
                    if v is not None:
                        assert v.value.shape == (0, 2)
                        got += 1
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert got == bound // VALUE_FLOOR == server.stats()["series_values"]
