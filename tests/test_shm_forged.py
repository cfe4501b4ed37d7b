"""Forged segment headers fail the receive fast (issue 13 §3).

A process of the same user (buggy or hostile: SECURITY.md puts it out of scope for
secrecy, not for robustness) writes a well-formed segment under the exact name of the
next message of a key. Its header declares a zero-byte dtype with an enormous shape:
``nbytes`` is 0, so every byte-length check passes, and numpy would loop (``copy=True``)
or try to allocate terabytes. The receive must raise ``InternalError`` within its timeout.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from header_corruptions import build_header, write_header
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._shm.files import Segment
from shmrdv._shm.naming import Names

INCARNATION = 0xF0F0_0000_0000_0003
STEP = 1


def _forge(names: Names, key: str, dtype: str, shape: tuple[int, ...]) -> None:
    """Publish a header-only segment under the name of ``key``'s first message."""
    header = build_header(
        key=key,
        dtype=np.dtype(dtype),
        shape=shape,
        step_id=STEP,
        seq=0,
        producer_incarnation=INCARNATION,
        producer_pid=os.getpid(),
    )
    seg = Segment.create(names, header.segment_size, names.message(STEP, key, INCARNATION, 0))
    try:
        write_header(seg.buf, header)
    finally:
        seg.close()


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize(("dtype", "shape"), [("|V0", (2**62,)), ("|S0", (2**40,))])
def test_forged_zero_itemsize_segment_fails_the_receive_fast(
    shmrdv_namespace: str, dtype: str, shape: tuple[int, ...], copy: bool
) -> None:
    ns = shmrdv_namespace
    key = make_key("forged")
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        _forge(Names(ns), key, dtype, shape)
        rdv = consumer.rendezvous(STEP)
        t0 = time.monotonic()
        with pytest.raises(shmrdv.InternalError, match="elements"):
            rdv.recv(key, timeout=3, copy=copy)
        assert time.monotonic() - t0 < 1.0
        # The forgery was consumed, with the sequence number it took (the producer's first
        # send of the key reuses it, and the consumer has moved past it): what follows comes.
        for i in range(2):
            producer.rendezvous(STEP).send(key, np.arange(100_000) + i)
        np.testing.assert_array_equal(rdv.recv(key, timeout=5).value, np.arange(100_000) + 1)
        consumer.cleanup(STEP)
        producer.cleanup(STEP)
