"""Running user callbacks: exactly once, never under a lock, their exceptions logged.

CPython's ``concurrent.futures`` does the same (``LOGGER.exception('exception calling
callback for %r', ...)``): an exception raised by a user's ``done`` must not unwind
into whichever transport thread happened to complete the receive. Which thread that is,
per transport: ``docs/threads.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from ._rendezvous import Received

__all__ = ["DoneCallback", "done_failed", "invoke_done"]

_log = logging.getLogger("shmrdv.callbacks")

DoneCallback: TypeAlias = "Callable[[BaseException | None, Received | None], None]"


def invoke_done(done: DoneCallback, error: BaseException | None, received: Received | None) -> None:
    """Call ``done(error, received)``; log, never raise, what it raises.

    Callers must not hold any lock of theirs: the callback may call back into shmrdv.
    """
    try:
        done(error, received)
    except Exception:
        done_failed(done)


def done_failed(done: DoneCallback) -> None:
    """Log the exception ``done`` just raised (in an ``except`` block): what ``invoke_done``
    does with it, for a hot loop that calls ``done`` in its own ``try``."""
    _log.exception("exception in a recv_async done callback %r", done)
