"""``recovery.Listing``: a directory listed again only when it changed, refused names skipped
(issue 13 §2). In a private directory (``tmp_path``): other processes' work in /dev/shm would
change its mtime under the test."""

from __future__ import annotations

import os
import time
from pathlib import Path

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
