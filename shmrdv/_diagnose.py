"""Why a receive waits: is its producer's task alive in another namespace of this user?

A producer and a consumer started with different namespace tokens never meet: the
consumer waits out its timeout. This module finds out, for the message of that timeout
(DESIGN.md: "… task … is alive in namespace id …, not in this worker's: producer and
consumer must share the namespace"), for a debug line of a receive that waits long and
for ``Worker.stats()``. It is never on the per-message path.

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
from dataclasses import dataclass

from ._errors import RendezvousError
from ._shm.naming import SHM_DIR, parse_name
from ._shm.ownership import is_ours
from ._shm.presence import probe

__all__ = ["Sighting", "explain_absent_producer", "sightings"]

# Bounds of one look: a presence record is a few hundred bytes; a user rarely runs more
# than a few dozen workers, so 256 records cover every sane case at a bounded cost.
_MAX_RECORDS = 256
_MAX_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Sighting:
    """A presence record of ``task`` found in /dev/shm."""

    namespace: str  # as in the record's name
    pid: int
    alive: bool


def sightings(task: str, *, shm_dir: str = SHM_DIR) -> list[Sighting]:
    """Every presence record of this user naming ``task`` (canonical), in any namespace.

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
            out.append(Sighting(parsed.namespace, info.pid, state == "alive"))
    return out


def explain_absent_producer(task: str, namespace: str, *, shm_dir: str = SHM_DIR) -> str | None:
    """A sentence saying where ``task`` lives if not in ``namespace``; None if it is alive there.

    Either "task … is alive in namespace id …, not in this worker's: producer and
    consumer must share the namespace", or "task … is not alive anywhere on this host".
    """
    found = sightings(task, shm_dir=shm_dir)
    if any(s.alive and s.namespace == namespace for s in found):
        return None
    elsewhere = sorted({s.namespace for s in found if s.alive and s.namespace != namespace})
    if elsewhere:
        pids = sorted({s.pid for s in found if s.alive and s.namespace != namespace})
        which = ", ".join(elsewhere)
        return (
            f"task {task} is alive in namespace id {which} (pid {', '.join(map(str, pids))}), "
            "not in this worker's: producer and consumer must share the namespace"
        )
    return (
        f"task {task} is not alive anywhere on this host (no live presence record of this "
        "user in any namespace): it has not started, it exited, or it runs on another host"
    )
