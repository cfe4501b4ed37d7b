"""A tensor over 2 GiB end to end through the gRPC transport (no protobuf 2 GiB ceiling)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shmrdv

PRODUCER = "/job:big/replica:0/task:0"
CONSUMER = "/job:big/replica:0/task:1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rpc_tensor_over_2gib_streams_end_to_end() -> None:
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if avail < 10 << 30:
        pytest.skip(f"needs ~10 GiB of free memory, {avail >> 30} GiB free")
    ns = shmrdv.new_namespace()
    n = (1 << 31) + 4096
    key = shmrdv.create_key(PRODUCER + "/device:CPU:0", 0, CONSUMER + "/device:CPU:0", "big")
    with (
        shmrdv.Worker(PRODUCER, namespace=ns, transports=("grpc",)) as p,
        shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",)) as c,
    ):
        buf = p.rendezvous(1).allocate(key, (n,), np.uint8)  # handed over without a copy
        buf[:4096] = 7
        buf[-4096:] = 9
        p.rendezvous(1).send(key, buf)
        del buf
        got = c.rendezvous(1).recv(key, timeout=240).value
        assert got.shape == (n,) and got.dtype == np.uint8
        assert (got[:4096] == 7).all() and (got[-4096:] == 9).all()
        del got
        c.cleanup(1)
        p.cleanup(1)
