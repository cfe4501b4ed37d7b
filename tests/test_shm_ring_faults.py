"""A ring's bytes are a peer's: truncated rings and pool slots, refused records (issue 13
§3-§5, issue 20 §3)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from header_corruptions import HEADER_CORRUPTIONS
from shm_harness import Endpoint, key_between
from small_shm import run_with_small_dev_shm

import shmrdv
from shmrdv._shm import header as layout
from shmrdv._shm.naming import Names
from shmrdv._shm.ring import RINGS_SUPPORTED, Ring

P, C = "/job:rf/replica:0/task:0", "/job:rf/replica:0/task:1"

pytestmark = pytest.mark.skipif(not RINGS_SUPPORTED, reason="rings are x86-64 only")


def _ring_fd(prod: Endpoint) -> int:
    """A descriptor of the producer's ring for C, as a buggy process of this user keeps."""
    name = Names.path(prod.names.ring(prod.task, prod.incarnation, C))
    return os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)


# Every size a truncation can leave: no page, part of the words' page, the words without
# the records, part of the records (issue 20 §3: 4,096 killed the producer, 0 the consumer).
@pytest.mark.parametrize("size", [0, 1, 64, 4095, 4096, 4097, 8191, 8192, 65536])
def test_ring_truncated_fails_it_not_the_processes(size: int) -> None:
    ns = shmrdv.new_namespace()
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "first"), np.arange(4))
        fd = _ring_fd(prod)
        try:
            assert cons.recv(1, key_between(P, C, "first")).value.tolist() == [0, 1, 2, 3]
            os.ftruncate(fd, size)  # some or all of the ring's pages are gone
        finally:
            os.close(fd)
        # The producer checks its ring's size before it writes: it gives the ring up and
        # publishes by name; the consumer checks before it reads, gives the ring up too, and
        # finds the message by name. Neither process touches a lost page (SIGBUS).
        prod.send(1, key_between(P, C, "second"), np.arange(3))
        assert cons.recv(1, key_between(P, C, "second"), timeout=5).value.tolist() == [0, 1, 2]
        assert cons.transport.stats()["rings"] == 0  # unmapped
        # Large messages still arrive, found by name.
        big = np.arange(100_000, dtype=np.float64)
        prod.send(1, key_between(P, C, "big"), big)
        assert np.array_equal(cons.recv(1, key_between(P, C, "big"), timeout=5).value, big)


@pytest.mark.parametrize("size", [0, 4096, 8192])
def test_ring_truncated_with_values_read_not_taken_still_delivers_them(size: int) -> None:
    # The first receive reads both records; "queued" stays in the ring (it is not taken)
    # until a receive takes it, which marks it taken there: a store, after a look at the
    # ring's size (into a page the truncation took, a SIGBUS).
    ns = shmrdv.new_namespace()
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "first"), np.arange(4))
        prod.send(1, key_between(P, C, "queued"), np.arange(2))
        fd = _ring_fd(prod)
        try:
            assert cons.recv(1, key_between(P, C, "first")).value.tolist() == [0, 1, 2, 3]
            os.ftruncate(fd, size)  # the ring's pages go, its records read already
        finally:
            os.close(fd)
        assert cons.recv(1, key_between(P, C, "queued"), timeout=5).value.tolist() == [0, 1]
        prod.send(1, key_between(P, C, "after"), np.arange(3))
        assert cons.recv(1, key_between(P, C, "after"), timeout=5).value.tolist() == [0, 1, 2]


def _write_record(
    prod: Endpoint, step: int, name: str, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> None:
    """Append a record by hand into the producer's ring (as a buggy producer would)."""
    from shmrdv._shm.files import Segment

    seg = Segment.attach(prod.names, prod.names.ring(prod.task, prod.incarnation, C))
    try:
        ring = Ring(memoryview(seg.buf))
        key = key_between(P, C, name).full_key.encode()
        t = layout.Template(dtype, shape, len(key))
        at = ring.reserve(t.data_offset)
        assert at >= 0
        t.write(ring.buf, at, key, 0, step, 0, prod.incarnation, os.getpid(), -1, time.time_ns())
        ring.commit()
        ring.release()
    finally:
        seg.close()


def test_ring_zero_itemsize_record_refused_and_what_follows_delivered() -> None:
    ns = shmrdv.new_namespace()
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "first"), np.arange(2))  # makes the ring
        _write_record(prod, 1, "huge", np.dtype("|S0"), (2**40,))  # 2**40 zero-byte items
        prod.send(1, key_between(P, C, "after"), np.arange(5))
        assert cons.recv(1, key_between(P, C, "first")).value.tolist() == [0, 1]
        with pytest.raises(shmrdv.InternalError, match=f"producer {P}") as info:
            cons.recv(1, key_between(P, C, "huge"), timeout=5)
        assert "zero-byte items" in str(info.value)
        assert cons.recv(1, key_between(P, C, "after"), timeout=5).value.tolist() == list(range(5))
        assert cons.transport.stats()["refused_records"] == 1


_FULL_SHM = r"""
import os, numpy as np, shmrdv
ns = shmrdv.new_namespace()
a, b = "/job:f/replica:0/task:0", "/job:f/replica:0/task:1"
k = shmrdv.create_key(a + "/device:CPU:0", 0, b + "/device:CPU:0", "x")
with shmrdv.Worker(a, namespace=ns) as wa, shmrdv.Worker(b, namespace=ns) as wb:
    wa.rendezvous(1).send(k, np.ones(4))  # the ring exists
    assert wb.rendezvous(1).recv(k, timeout=10).value.tolist() == [1.0] * 4
    free = os.statvfs("/dev/shm")
    filler = "/dev/shm/filler"
    with open(filler, "wb") as f:  # leave about 1.5 MiB free
        f.write(b"\0" * (free.f_bavail * free.f_frsize - (3 << 19)))
    n = (1 << 20) + (128 << 10)  # its pool size class (2 MiB + 64 KiB) is more than is left
    wa.rendezvous(1).send(k, np.ones(n, np.uint8))
    got = wb.rendezvous(1).recv(k, timeout=10)
    assert got.value.nbytes == n and got.value[0] == 1
    del got
    os.unlink(filler)
print("child ok")
"""


def test_full_dev_shm_falls_back_to_an_exact_size_segment() -> None:
    out = run_with_small_dev_shm(_FULL_SHM, size="8m")
    assert "child ok" in out


@pytest.mark.parametrize("size", [0, 4096, 8192])
def test_ring_truncated_with_records_in_it_fails_their_receive(size: int) -> None:
    ns = shmrdv.new_namespace()
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "first"), np.arange(4))
        fd = _ring_fd(prod)
        try:
            assert cons.recv(1, key_between(P, C, "first")).value.tolist() == [0, 1, 2, 3]
            prod.send(1, key_between(P, C, "lost"), np.arange(2))  # in the ring, not read yet
            os.ftruncate(fd, size)  # and gone with the ring's pages
        finally:
            os.close(fd)
        with pytest.raises(shmrdv.InternalError, match="truncated"):
            cons.recv(1, key_between(P, C, "lost"), timeout=5)
        prod.send(1, key_between(P, C, "after"), np.arange(3))
        assert cons.recv(1, key_between(P, C, "after"), timeout=5).value.tolist() == [0, 1, 2]


@pytest.mark.parametrize("size", [0, 4096, 1 << 20])
def test_pool_slot_truncated_while_returned_is_dropped_not_written(size: int) -> None:
    ns = shmrdv.new_namespace()
    big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: a pool slot, not the ring
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        prod.send(1, key_between(P, C, "a"), big)
        got = cons.recv(1, key_between(P, C, "a"), timeout=5).value
        assert np.array_equal(got, big)
        del got  # the slot goes back: "returned", for the producer to take back
        returned = [e for e in os.listdir("/dev/shm") if e.startswith(prod.names.prefix + "r")]
        assert len(returned) == 1, os.listdir("/dev/shm")
        os.truncate(os.path.join("/dev/shm", returned[0]), size)  # a buggy process of ours
        prod.send(1, key_between(P, C, "b"), big)  # writing the lost pages would be a SIGBUS
        assert np.array_equal(cons.recv(1, key_between(P, C, "b"), timeout=5).value, big)


# The magic and the version: the record does not even say whose it is, so no receive of
# the key is failed; it is refused, and what follows arrives.
_UNNAMED = ("magic", "version")


@pytest.mark.parametrize(("at", "raw", "match"), HEADER_CORRUPTIONS)
def test_ring_record_of_a_known_key_corrupted_is_refused(at: int, raw: bytes, match: str) -> None:
    """A live record of a key whose header the consumer knows (checked in the drain's own
    loop, ``HeaderCache.live``) gets the same refusal as a new one; what follows arrives."""
    ns = shmrdv.new_namespace()
    k = key_between(P, C, "known")
    a = np.arange(16, dtype=np.float32)
    with Endpoint(ns, P) as prod, Endpoint(ns, C) as cons:
        from shmrdv._shm.files import Segment

        prod.send(1, k, a)  # message 0: the consumer knows its header from now on
        # (the ring by its name, as a buggy process of this user opens it)
        seg = Segment.attach(prod.names, prod.names.ring(prod.task, prod.incarnation, C))
        try:
            assert cons.recv(1, k).value.tolist() == a.tolist()
            ring = Ring(memoryview(seg.buf))
            key = k.full_key.encode()
            t = layout.Template(a.dtype, a.shape, len(key))
            pos = ring.reserve(t.data_offset + t.nbytes + 256)  # room for a moved data offset
            assert pos >= 0
            t.write(ring.buf, pos, key, 0, 1, 1, prod.incarnation, os.getpid(), -1, 1)
            ring.buf[pos + t.data_offset : pos + t.data_offset + t.nbytes] = a.tobytes()
            ring.buf[pos + at : pos + at + len(raw)] = raw
            ring.commit()
            ring.release()
        finally:
            seg.close()
        prod.send(1, key_between(P, C, "after"), np.arange(5))
        if match not in _UNNAMED:
            with pytest.raises(shmrdv.InternalError, match=match):
                cons.recv(1, k, timeout=5)
        assert cons.recv(1, key_between(P, C, "after"), timeout=5).value.tolist() == list(range(5))
        assert cons.transport.stats()["refused_records"] == 1
