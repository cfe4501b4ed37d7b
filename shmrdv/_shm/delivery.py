"""Deliveries of the shared-memory consumer, made outside its lock.

The consumer never calls a ``done`` callback under its lock (STYLE.md rule 5): what it
completes comes back to its caller as ``Item``s, ``(done, copy, value or error)``, which
the caller hands to ``deliver`` once the lock is released.

Thread model (docs/threads.md): whichever thread took the items: a receiving thread, a
blocked receiver that polled the doorbell, or the dispatcher thread.
"""

from __future__ import annotations

import numpy as np

from .._rendezvous import DoneCallback, Received, done_failed, invoke_done

__all__ = ["Item", "deliver", "deliver_one"]

#: A delivery to make outside the lock: ``done``, whether to copy, the value or the error.
Item = tuple[DoneCallback, bool, Received | BaseException]


def deliver_one(done: DoneCallback, copy: bool, result: Received | BaseException) -> None:
    """Call ``done`` with ``result`` through ``invoke_done`` (a private copy if ``copy``)."""
    if isinstance(result, BaseException):
        invoke_done(done, result, None)
        return
    if copy:
        # Rebinding drops the mapped original before the receiver wakes up.
        result = Received(np.array(result.value, copy=True), result.is_dead)
    invoke_done(done, None, result)


def deliver(items: list[Item]) -> None:
    """Call each ``done`` as ``invoke_done`` does (outside every lock; what it raises is
    logged), emptying ``items``. The per-message loop of every poll, hence ``invoke_done``
    written out for a value (its ``try`` here, its logging in ``done_failed``).

    Holds no reference to a delivered value afterwards: a mapped array the receiver
    drops (or that ``copy`` replaced) releases its segment at once.
    """
    items.reverse()
    while items:
        done, copy, result = items.pop()
        if isinstance(result, BaseException):
            invoke_done(done, result, None)
            continue
        if copy:
            # Rebinding drops the mapped original before the receiver wakes up.
            result = Received(np.array(result.value, copy=True), result.is_dead)
        try:
            done(None, result)
        except Exception:
            done_failed(done)
        del result
