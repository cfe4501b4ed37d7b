"""LocalRendezvous: the in-process rendezvous table, and the reference every transport is held to.

A port of TensorFlow's ``LocalRendezvous`` (``core/framework/local_rendezvous.cc``): one
``WaiterTable`` (``_waiters.py``) from the full key string to a FIFO queue that holds
either values sent and not yet received, or receivers waiting for a value, never both. It
differs from TensorFlow as that table does: a key's own queue (not ``Hash64(FullKey())``,
research/tf_rendezvous.md §1.2), and a removed waiter never takes a value (§2.2).

Thread model (``docs/threads.md``): one lock guards the table and the counters. User callbacks (``done``) are
called after the lock is released, in the thread that completed the pairing: the sender's
thread when a waiter was queued, the receiver's when a value was, the aborting thread on
abort (STYLE.md rule 5; TensorFlow does the same).
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import CancelledError, InvalidArgumentError, RendezvousError
from ._keys import ParsedKey
from ._rendezvous import (
    Canceller,
    Closing,
    DoneCallback,
    Received,
    Rendezvous,
    as_parsed_key,
    check_timeout,
    invoke_done,
)
from ._values import check_value
from ._waiters import MISSING, WaiterTable

__all__ = ["LocalRendezvous"]

_log = logging.getLogger("shmrdv.local")


class _Waiter:
    """One pending receive: its callback and whether it wants a private copy.

    Hashed by identity, so a channel can find and remove exactly this waiter.
    """

    __slots__ = ("copy", "done")

    def __init__(self, done: DoneCallback, copy: bool) -> None:
        self.done = done
        self.copy = copy


_Value = tuple[npt.NDArray[Any], bool]  # a queued value and its is_dead


def _deliverable(value: npt.NDArray[Any], is_dead: bool, copy: bool) -> Received:
    # Called outside the lock: copying a large array must not stall other keys.
    return Received(np.array(value, copy=True) if copy else value, is_dead)


class LocalRendezvous(Rendezvous, Closing):
    """A rendezvous inside one process: ``send`` and ``recv`` meet in a locked table.

    No copy is made: the receiver gets the very array object that was sent (as TensorFlow
    shares a host tensor between Send and Recv on one worker), so the sender must not
    write to it afterwards. ``recv(..., copy=True)`` (or ``copy=True`` on any receive
    flavour) returns a private ``numpy.array(value, copy=True)`` instead.

    Thread-safe. ``send`` never blocks. ``close()`` (or leaving a ``with`` block) aborts
    with ``CancelledError``; ``start_abort(error)`` aborts with your error.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: WaiterTable[str, _Value, _Waiter] = WaiterTable()
        self._error: BaseException | None = None
        self._error_tb: TracebackType | None = None
        self._sent = 0
        self._received = 0

    # -- the Rendezvous primitives -----------------------------------------------------

    def send(
        self,
        key: str | ParsedKey,
        value: Any,
        *,
        is_dead: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Queue ``value`` under ``key``, or hand it to the oldest waiting receiver.

        Never blocks (``timeout`` is accepted for the common signature; nothing here waits). If a receiver is waiting, its callback runs in this thread before
        ``send`` returns (outside the lock); an exception from it is logged, not raised.
        Raises ``InvalidArgumentError`` for a bad key or a value that is not a numpy array
        or holds Python objects (nothing is queued), and the abort error once aborted.
        """
        if timeout is not None:
            check_timeout(timeout)
        self._put(as_parsed_key(key), value, bool(is_dead), front=False)

    def put(self, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool) -> None:
        """``send`` for a caller that already parsed the key and checked the value with
        ``check_value`` (a Worker's router): the same, minus those two per-message steps."""
        self._put(key, value, is_dead, front=False, checked=True)

    def requeue(self, key: ParsedKey, received: Received) -> None:
        """Put a value that was taken but could not be delivered back at the head of its key.

        The next receive of ``key`` gets it before anything sent later, so FIFO order
        holds (the gRPC server uses this when a call is cancelled after its value was
        taken). After an abort the value is dropped, like every queued value.
        """
        try:
            self._put(key, received.value, received.is_dead, front=True)
        except RendezvousError:
            pass

    def _put(
        self, pk: ParsedKey, value: Any, dead: bool, *, front: bool, checked: bool = False
    ) -> None:
        arr = value if checked else check_value(value, pk.full_key)
        with self._lock:
            if self._error is not None:
                raise self._abort_error()
            self._sent += 1
            waiter = self._table.put(pk.full_key, (arr, dead), front=front)
            if waiter is None:
                return
            self._received += 1
        invoke_done(waiter.done, None, _deliverable(arr, dead, waiter.copy))

    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        """Take the oldest value of ``key`` now, or queue a waiter for the next one.

        With a value queued (or once aborted) ``done`` runs in this thread before the
        call returns; otherwise it runs later in the thread of the ``send`` (or abort)
        that completes it, whether ``blocking`` or not. The canceller removes exactly
        this waiter. Raises ``InvalidArgumentError`` for a bad key.
        """
        full_key = as_parsed_key(key).full_key
        with self._lock:
            if self._error is not None:
                error: BaseException | None = self._abort_error()
            else:
                error = None
                got = self._table.take(full_key)
                if got is MISSING:
                    waiter = _Waiter(done, copy)
                    self._table.wait(full_key, waiter)
                    return lambda: self._cancel(full_key, waiter)
                value, dead = got
                self._received += 1
        if error is not None:
            invoke_done(done, error, None)
        else:
            invoke_done(done, None, _deliverable(value, dead, copy))
        return _too_late

    def _cancel(self, full_key: str, waiter: _Waiter) -> bool:
        """Remove ``waiter`` if it is still queued: ``True``, and its done will never run."""
        with self._lock:
            return self._table.cancel(full_key, waiter)

    def start_abort(self, error: BaseException) -> None:
        """Fail every waiting receive with ``error`` and every later call; drop queued values.

        The first error wins: later calls are no-ops. Waiters' callbacks run in this
        thread after the lock is released. Never blocks (beyond those callbacks).
        Raises ``InvalidArgumentError`` if ``error`` is not an exception (TensorFlow
        CHECK-fails on an OK status).
        """
        if not isinstance(error, BaseException):
            raise InvalidArgumentError(f"start_abort needs an exception instance, not {error!r}")
        with self._lock:
            if self._error is not None:
                return
            self._error, self._error_tb = error, error.__traceback__
            dropped = self._table.pending_values
            keys = sum(1 for k in self._table if self._table.values_of(k)) if dropped else 0
            waiters = self._table.abort()
        if dropped:
            # TensorFlow logs the dropped sends too ("Rendezvous aborted, dropping ...").
            _log.debug(
                "LocalRendezvous aborted (%r): dropped %d queued value(s) over %d key(s)",
                error,
                dropped,
                keys,
            )
        for waiter in waiters:
            invoke_done(waiter.done, self._abort_error(), None)

    def _abort_error(self) -> BaseException:
        """The stored abort error, with the traceback it had when stored.

        Raising one instance again and again would grow its ``__traceback__`` by the
        raising frames each time and keep those frames (and the arrays in them) alive.
        """
        error = self._error
        assert error is not None
        return error.with_traceback(self._error_tb)

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Abort with ``CancelledError("LocalRendezvous closed")`` unless already aborted.

        Idempotent. Pending receives fail with that error; queued values are dropped.
        """
        self.start_abort(CancelledError("LocalRendezvous closed"))

    # -- introspection -----------------------------------------------------------------

    @property
    def aborted(self) -> BaseException | None:
        """The error the rendezvous was aborted with, or ``None``."""
        return self._error

    def stats(self) -> dict[str, int]:
        """Counters: values and waiters pending now, keys with either, sent and received so far."""
        with self._lock:
            return {
                "pending_values": self._table.pending_values,
                "pending_waiters": self._table.pending_waiters,
                "keys": len(self._table),
                "sent": self._sent,
                "received": self._received,
            }

    def pending_keys(self) -> list[str]:
        """The keys that have values or receivers pending, oldest first."""
        with self._lock:
            return list(self._table)

    def __repr__(self) -> str:
        s = self.stats()
        state = "open" if self._error is None else f"aborted={self._error!r}"
        return (
            f"<LocalRendezvous {state} keys={s['keys']} pending_values={s['pending_values']} "
            f"pending_waiters={s['pending_waiters']} sent={s['sent']} received={s['received']}>"
        )


def _too_late() -> bool:
    """The canceller of a receive completed before ``start_recv`` returned."""
    return False
