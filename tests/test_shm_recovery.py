"""``recovery.Listing``: a directory listed again only when it changed, refused names skipped
(issue 13 §2). In a private directory (``tmp_path``): other processes' work in /dev/shm would
change its mtime under the test."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from helpers import CONSUMER, PRODUCER, make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.recovery import Listing

PREFIX = "shmrdv_test_"


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def test_listing_lists_again_only_when_the_directory_changed(tmp_path: Path) -> None:
    listing = Listing(PREFIX, 0.0, directory=str(tmp_path))
    _touch(str(tmp_path / "other_name"))  # not under the prefix: never listed
    paths = [str(tmp_path / f"{PREFIX}m{i:04x}") for i in range(3)]
    _touch(paths[0])
    time.sleep(0.05)  # older than the coarse-clock margin: the listing is trusted
    assert listing.refresh()
    assert listing.names == [os.path.basename(paths[0])]
    done, gen = listing.listings, listing.generation
    for _ in range(5):
        assert listing.refresh()  # unchanged: one stat, no listdir
    assert (listing.listings, listing.generation) == (done, gen)
    _touch(paths[1])
    assert listing.refresh()
    assert listing.listings == done + 1
    assert sorted(listing.names) == sorted(os.path.basename(p) for p in paths[:2])
    listing.refuse(os.path.basename(paths[0]))
    _touch(paths[2])
    time.sleep(0.05)
    assert listing.refresh()
    assert sorted(listing.names) == sorted(os.path.basename(p) for p in paths[1:])


def test_listing_is_rate_limited_while_the_directory_churns(tmp_path: Path) -> None:
    listing = Listing(PREFIX, 10.0, directory=str(tmp_path))
    assert listing.refresh()  # the first listing is allowed at once
    _touch(str(tmp_path / f"{PREFIX}m0001"))
    assert not listing.refresh()  # changed, but the next listing is 10 s away
    assert listing.listings == 1 and listing.names == []


# -- messages a full ring lost, found by listing ----------------------------------------------

OTHER = "/job:worker/replica:0/task:2"


def child_take_all(worker: shmrdv.Worker, edge: str, count: int) -> list[int]:
    """Receive ``count`` values of ``edge`` (step 1), then clean the step up."""
    rdv = worker.rendezvous(1)
    got = [int(rdv.recv(make_key(edge), timeout=30).value[0]) for _ in range(count)]
    worker.cleanup(1)
    return got


def child_take_other(worker: shmrdv.Worker) -> int:
    key = make_key("big", dst=OTHER)
    return int(worker.rendezvous(1).recv(key, timeout=30).value[0])


def test_recovery_of_lost_records_leaves_another_consumers_messages_alone(ns: str) -> None:
    """A consumer whose ring was full finds what it lost by listing the producer's messages.
    Those the same producer run sent to another consumer are not its own: its cleanup does
    not free them, and the other consumer receives its value."""
    n = 12_000  # several times what a ring holds: most of them go by name
    with shmrdv.Worker(PRODUCER, namespace=ns) as producer:
        out = producer.rendezvous(1)
        with (
            ChildWorker(CONSUMER, namespace=ns) as first,
            ChildWorker(OTHER, namespace=ns) as other,
        ):
            out.send(make_key("big", dst=OTHER), np.full(100_000, 5, np.uint32))
            for i in range(n):
                out.send(make_key("small"), np.full(4, i, np.uint32))
            assert producer.stats()["shm"]["ring_full"] > 0
            assert first.call(child_take_all, "small", n) == list(range(n))
            assert other.call(child_take_other) == 5
