"""Sightings: a task's presence records in /dev/shm, in any namespace of this user.

A producer and a consumer started with different namespace tokens never meet: the
consumer waits out its timeout. The diagnosis (``_diagnose.py``) says where the producer
is alive instead; this module finds it out for the shared-memory ``PresenceBoard``
(``board.py``), only for a timeout, a receive that waits long or ``Worker.stats()``: never
on the per-message path.

How: list /dev/shm for presence records of any namespace (``shmrdv_<ns>_w<hash>``; the
hash is keyed by each namespace's token, so the task is read from the record itself),
keep regular files of this user with no group/other bits and at most ``_MAX_BYTES``
bytes (``lstat`` first), look at no more than ``_MAX_RECORDS`` of them, and ``probe``
each (opened ``O_NOFOLLOW | O_NONBLOCK``, checked again, its flock tested). The namespace
is shown as it appears in the record's name (the part after ``shmrdv_``).
"""

from __future__ import annotations

import os
import stat

from .._errors import RendezvousError
from .._transport import Sighting
from .files import is_ours
from .naming import SHM_DIR, parse_name
from .presence import probe

__all__ = ["sightings"]

# Bounds of one look: a presence record is a few hundred bytes; a user rarely runs more
# than a few dozen workers, so 256 records cover every sane case at a bounded cost.
_MAX_RECORDS = 256
_MAX_BYTES = 4096


def sightings(task: str, namespace: str, *, shm_dir: str = SHM_DIR) -> list[Sighting]:
    """Every presence record of this user naming ``task`` (canonical), in any namespace.

    ``namespace``: the caller's, as it appears in object names (``Sighting.ours``).

    Bounded (``_MAX_RECORDS`` records, ``_MAX_BYTES`` each); skips other users' files,
    symlinks, anything not shmrdv's and records that vanish or change meanwhile. Never
    raises for what it finds; never blocks.
    """
    out: list[Sighting] = []
    looked = 0
    try:
        it = os.scandir(shm_dir)
    except OSError:
        return out
    with it:
        for dirent in it:
            # A cheap look before parse_name: only a presence record has "_w" (its kind
            # letter after the namespace id; ids and hashes are hex), and a flood of other
            # names must cost a timed-out receive next to nothing.
            if "_w" not in dirent.name:
                continue
            parsed = parse_name(dirent.name)
            if parsed is None or parsed.kind != "presence":
                continue
            try:
                st = dirent.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or not is_ours(st) or st.st_size > _MAX_BYTES:
                continue
            looked += 1
            if looked > _MAX_RECORDS:
                break
            try:
                state, info = probe(os.path.join(shm_dir, dirent.name))
            except (RendezvousError, OSError):
                continue  # changed owner or mode since the lstat, or out of descriptors
            if info is None or info.task != task:
                continue
            out.append(
                Sighting(
                    parsed.namespace, info.pid, state == "alive", parsed.namespace == namespace
                )
            )
    return out
