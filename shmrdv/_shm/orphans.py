"""Freeing the published messages addressed to a consumer that nobody will receive.

When a worker cleans up a step (``Worker.cleanup``), what was sent to it in that step and
not received is freed: a segment is unlinked, a pool slot is handed back to its producer
(``pool.give_back``) rather than dropped. So is a late notice of a step already cleaned
up. Another user's names under the job's prefix are refused after one ``lstat``
(``Listing.refuse``) and never opened.

Thread model (docs/threads.md): no lock of its own and no state but the listing's refused
names (a set: safe outside the consumer's lock); called by ``Consumer.cleanup_step``
outside the lock and by the inbox under it.
"""

from __future__ import annotations

import logging
import os

from .._errors import RendezvousError
from .._keys import parse_key
from .._transport import TransportContext
from .files import peek_header
from .listing import Listing
from .naming import Names, parse_name
from .pool import ProducerAlive, give_back
from .producer import task_name

__all__ = ["Orphans"]

_log = logging.getLogger("shmrdv.shm")


class Orphans:
    """Frees the unreceived messages of one consumer (see the module docstring)."""

    def __init__(
        self, ctx: TransportContext, names: Names, listing: Listing, alive: ProducerAlive
    ) -> None:
        self._own = ctx.task.task_key()
        self._names = names
        self._listing = listing
        self._alive = alive

    def free_named(self, src: str, step: int, key: str, inc: int, seq: int, slot: int) -> None:
        """Free one message known by its name (a late notice of a cleaned-up step)."""
        path = Names.path(self._names.message(step, key, inc, seq))
        if slot >= 0:
            give_back(self._names, self._alive, src, inc, slot, path)
            return
        try:
            os.unlink(path)
        except OSError:
            pass

    def free_unreceived(self, step_id: int | None) -> int:
        """Free the messages of ``step_id`` (every step: None) addressed to this worker."""
        freed = 0
        try:
            entries = os.listdir(Names.path(""))
        except OSError:
            return 0
        marker = self._names.prefix + "m"
        listing = self._listing
        for entry in entries:
            if not entry.startswith(marker) or listing.refused(entry) or parse_name(entry) is None:
                continue
            path = Names.path(entry)
            header = peek_header(path)  # one lstat for another user's name
            if header is None:
                listing.refuse(entry)  # a set.add: safe outside the lock
                continue
            if step_id is not None and header.step_id != step_id:
                continue
            try:
                pk = parse_key(header.key)
            except RendezvousError:
                continue
            if pk.dst.task_key() != self._own:
                continue
            if header.slot >= 0:
                # A pool slot: hand it back to its producer rather than drop it.
                give_back(
                    self._names,
                    self._alive,
                    task_name(pk.src),
                    header.producer_incarnation,
                    header.slot,
                    path,
                )
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    _log.warning("cannot free unreceived message %s: %s", path, e)
                    continue
            freed += 1
        return freed
