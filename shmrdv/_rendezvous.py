"""The Rendezvous interface, ``Received``, and the receive flavours written once on it.

A rendezvous implements ``send``, ``start_recv`` (the one asynchronous receive primitive,
TensorFlow's ``RecvAsync``, returning a canceller), ``start_abort`` and, where it can do
better than ``numpy.empty``, ``allocate``. ``recv``, ``recv_async``, ``recv_future`` and
``arecv`` are built here on ``start_recv`` (TensorFlow: ``Recv`` is a "synchronous wrapper
for RecvAsync"), so every rendezvous behaves alike. The canceller's contract is
``_transport.py``'s. Unlike TensorFlow, a receive that gave up never takes a value.
``LocalRendezvous`` is the in-process one, on ``_channels.WaiterTable``.

Thread model: see ``docs/threads.md``.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from ._channels import MISSING, WaiterTable
from ._errors import CancelledError, DeadlineExceededError, InvalidArgumentError, RendezvousError
from ._keys import ParsedKey, parse_key
from ._values import check_value

__all__ = [
    "Canceller",
    "Closing",
    "DoneCallback",
    "LocalRendezvous",
    "Received",
    "RecvSlot",
    "Rendezvous",
    "WaitObserver",
    "as_parsed_key",
    "check_timeout",
    "invoke_done",
    "received",
    "timeout_error",
    "wait_received",
]


_callback_log = logging.getLogger("shmrdv.callbacks")

DoneCallback: TypeAlias = "Callable[[BaseException | None, Received | None], None]"


def invoke_done(done: DoneCallback, error: BaseException | None, received: Received | None) -> None:
    """Call ``done(error, received)``, logging what it raises. Hold no lock: it may call back."""
    try:
        done(error, received)
    except Exception:
        _callback_log.exception("exception in a recv_async done callback %r", done)


_C = TypeVar("_C", bound="Closing")


class Closing:
    """Mixin for a class that defines ``close``: a context manager that closes on exit."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_log = logging.getLogger("shmrdv.rendezvous")


@dataclass(frozen=True, slots=True)
class Received:
    """A received tensor and TensorFlow's ``is_dead`` flag (set for values of untaken
    control-flow branches). Unpacks as ``value, is_dead = rdv.recv(key)``."""

    value: npt.NDArray[Any]
    is_dead: bool = False

    def __iter__(self) -> Any:
        return iter((self.value, self.is_dead))

    def __repr__(self) -> str:
        v = self.value
        return f"Received(value=<ndarray {v.dtype} {v.shape}>, is_dead={self.is_dead})"


# ``Received``'s slots, set directly: a frozen dataclass's ``__init__`` goes through
# ``object.__setattr__`` per field, which doubles the cost of building one.
_slots: Any = Received
_new = object.__new__
_set_value = _slots.value.__set__
_set_is_dead = _slots.is_dead.__set__


def received(value: npt.NDArray[Any], is_dead: bool) -> Received:
    """``Received(value, is_dead)`` for the receive side's hot loop; ``is_dead`` a ``bool``."""
    r: Received = _new(Received)
    _set_value(r, value)
    _set_is_dead(r, is_dead)
    return r


Canceller = Callable[[], bool]

# How long a blocked receiver waits between looks at its deadline and the transport's
# work (a dispatcher tick): short enough for a dead producer to be noticed within a second.
_HELP_PERIOD = 0.2
_INF = float("inf")
# After this long a blocked receive tells its observer it is still waiting (then after
# twice as long, and so on): a debug line and an entry in Worker.stats(), never per message.
_LONG_WAIT = 1.0


def as_parsed_key(key: str | ParsedKey) -> ParsedKey:
    if isinstance(key, ParsedKey):
        return key
    if not isinstance(key, str):
        raise InvalidArgumentError(
            f"a rendezvous key must be a str (see shmrdv.create_key), not {type(key).__name__}"
        )
    return parse_key(key)


def check_timeout(timeout: object) -> float | None:
    """The one check of every call's timeout: ``None``, or a finite real >= 0 (numpy's
    too). A string or a bool is refused, not converted: ``"1"`` and ``True`` are no durations."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgumentError(f"timeout must be a number of seconds or None, not {timeout!r}")
    t = float(timeout)
    if not 0 <= t < _INF:  # also refuses NaN
        raise InvalidArgumentError(f"timeout must be finite and >= 0 seconds, not {timeout!r}")
    return t


def timeout_error(key: str | ParsedKey, timeout: float | None) -> DeadlineExceededError:
    """The error of a receive of ``key`` whose ``timeout`` expired (its waiter removed)."""
    pk = as_parsed_key(key)
    return DeadlineExceededError(
        f"Timed out after {timeout:g}s waiting for key {pk.full_key!r} "
        f"(from {pk.src_device}); the waiter was removed"
    )


class RecvSlot:
    """One blocking receiver's mailbox, filled once by ``done``; only its receiver waits.

    The wake-up is a plain lock made only when the receiver has to wait (an ``Event``
    builds a ``Condition``); one is made per receive, so fields are class defaults.
    """

    _lock: threading.Lock | None = None
    filled = False
    error: BaseException | None = None
    received: Received | None = None

    def done(self, error: BaseException | None, received: Received | None) -> None:
        self.error, self.received = error, received
        self.filled = True  # before looking for the lock: ``wait`` makes it, then looks here
        lock = self._lock
        if lock is not None:
            lock.release()

    def wait(self, timeout: float | None) -> bool:
        """Block until filled (True) or ``timeout`` seconds pass (False; None: forever)."""
        lock = self._lock
        if lock is None:
            lock = threading.Lock()
            lock.acquire()
            self._lock = lock
        if self.filled:  # (also when ``done`` ran before it could see the lock)
            return True
        if lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            lock.release()  # let a later wait() pass too
            return True
        return self.filled

    def result(self) -> Received:
        if self.error is not None:
            raise self.error
        assert self.received is not None
        return self.received


class WaitObserver(Protocol):
    """What a blocked receive tells the Worker's step: the error of its timeout, that it
    has waited long (after 1 s, 2 s, 4 s, ...), and that it stopped waiting."""

    def timeout_error(self, key: ParsedKey, timeout: float | None) -> DeadlineExceededError: ...

    def waiting_long(self, slot: RecvSlot, key: ParsedKey, waited: float) -> None: ...

    def stopped_waiting(self, slot: RecvSlot) -> None: ...


def wait_received(
    slot: RecvSlot,
    cancel: Canceller,
    key: str | ParsedKey,
    timeout: float | None,
    helper: Callable[[RecvSlot, float], object] = RecvSlot.wait,
    observer: WaitObserver | None = None,
) -> Received:
    """The one blocking receive loop: wait for ``slot``, cancel on timeout or interrupt.

    ``helper`` blocks up to the given seconds, doing the transport's work meanwhile
    (``Transport.wait``). A timeout removes the waiter and raises
    ``DeadlineExceededError`` unless the value won the race; Ctrl-C removes it and
    propagates. ``key`` is parsed only for ``observer``, never on the way to a value.
    """
    if slot.filled:
        return slot.result()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    report_at = start + _LONG_WAIT if observer is not None else _INF
    reported = False
    # The clock is read again only for a slot still empty after a wait.
    now: float | None = start
    try:
        while not slot.filled:
            if now is None:
                now = time.monotonic()
            if now >= report_at and observer is not None:
                reported = True
                observer.waiting_long(slot, as_parsed_key(key), now - start)
                report_at = now + (now - start)
            if deadline is None:
                helper(slot, _HELP_PERIOD)
            else:
                left = deadline - now
                if left <= 0:
                    if cancel():
                        if observer is not None:
                            raise observer.timeout_error(as_parsed_key(key), timeout)
                        raise timeout_error(key, timeout)
                    slot.wait(None)  # lost the race to a delivery: it is on its way
                    break
                helper(slot, left if left < _HELP_PERIOD else _HELP_PERIOD)
            now = None
    except BaseException as e:
        if isinstance(e, DeadlineExceededError) or slot.filled or cancel():
            raise
        # Interrupted just as the value was being delivered: it is dropped with the call.
        _log.warning("recv of %r interrupted just as its value arrived; dropped", str(key))
        raise
    finally:
        if reported and observer is not None:
            observer.stopped_waiting(slot)
    got = slot.received  # ``slot.result()`` written out: one call fewer per message
    if got is not None:
        return got
    return slot.result()


class _RecvFuture(concurrent.futures.Future[Received]):
    """A Future whose ``cancel()`` removes the waiter, or fails if the value is on its way."""

    _canceller: Canceller | None = None

    def cancel(self) -> bool:
        if self.done():
            return super().cancel()
        canceller = self._canceller
        # No canceller yet means start_recv has not returned: the waiter exists and could
        # receive at any time, so refusing is the only answer that cannot lose a value.
        if canceller is None or not canceller():
            return False
        return super().cancel()


def _settle(
    fut: asyncio.Future[Received], error: BaseException | None, received: Received | None
) -> None:
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(received)  # type: ignore[arg-type]


class Rendezvous(abc.ABC):
    """Where a producer's ``send`` meets a consumer's ``recv`` under one key.

    Keys are TensorFlow rendezvous keys (``shmrdv.create_key``), strings or ``ParsedKey``.
    Sends of one key queue in FIFO order; each receive takes the oldest. See docs/api.md.
    """

    @abc.abstractmethod
    def send(
        self,
        key: str | ParsedKey,
        value: Any,
        *,
        is_dead: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Hand ``value`` (a numpy array) to the receiver of ``key``.

        Never blocks on the consumer, unless a ``max_inflight_bytes`` window is full: then
        it waits up to ``timeout`` seconds (None: as long as it takes) for room and raises
        ``ResourceExhaustedError``, having sent nothing.
        """

    @abc.abstractmethod
    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        """Arrange for ``done(error, received)`` to be called once; return a canceller.

        The receive primitive (TensorFlow's ``RecvAsync``). The canceller removes the waiter
        and returns True (``done`` never runs), or False when the value is on its way.
        ``done`` never runs under a lock. ``copy``: a private copy, not shared memory.
        Raises a ``RendezvousError`` (``done`` never called) for a call that cannot start.
        """

    @abc.abstractmethod
    def start_abort(self, error: BaseException) -> None:
        """Fail every pending and later call with ``error``; the first error wins. Never blocks."""

    def allocate(self, key: str | ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """An array to fill and then ``send(key, array)``: memory the receiver sees without
        a copy where the transport can, else a plain ``numpy.empty``."""
        as_parsed_key(key)
        try:
            return np.empty(shape, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"cannot allocate shape={shape!r} dtype={dtype!r}: {e}"
            ) from e

    def recv_async(self, key: str | ParsedKey, done: DoneCallback, *, copy: bool = False) -> None:
        """Call ``done(error, received)`` exactly once; return at once.

        ``done`` runs in this thread if the value is there, else in a transport thread,
        never under a lock; what it raises is logged (``shmrdv.callbacks``). A bad key is
        reported through ``done`` too.
        """
        try:
            self.start_recv(key, lambda err, rec: invoke_done(done, err, rec), copy=copy)
        except RendezvousError as e:
            invoke_done(done, e, None)

    def recv(
        self, key: str | ParsedKey, *, timeout: float | None = None, copy: bool = False
    ) -> Received:
        """Block until the oldest value of ``key`` arrives; return ``Received(value, is_dead)``.

        A ``timeout`` (seconds; None: forever) that expires raises ``DeadlineExceededError``
        and removes the waiter, so no later send is swallowed; so does Ctrl-C. Raises the
        abort error if the rendezvous is or gets aborted.
        """
        if timeout is not None and (type(timeout) is not float or not 0.0 <= timeout < _INF):
            timeout = check_timeout(timeout)  # not a plain finite float >= 0: convert or refuse
        if type(key) is str:
            key = parse_key(key)  # once: the wait below routes it again
        slot = RecvSlot()
        cancel = self.start_recv(key, slot.done, copy=copy, blocking=True)
        if slot.filled:
            got = slot.received  # ``slot.result()`` written out: the value was there
            if got is not None:
                return got
            return slot.result()
        return self._wait_blocked(slot, cancel, key, timeout)

    def _wait_blocked(
        self, slot: RecvSlot, cancel: Canceller, key: str | ParsedKey, timeout: float | None
    ) -> Received:
        """How ``recv`` waits; overridden by a rendezvous whose transports need help from a
        blocked receiver or that reports long waits."""
        return wait_received(slot, cancel, key, timeout)

    def recv_future(
        self, key: str | ParsedKey, *, copy: bool = False
    ) -> concurrent.futures.Future[Received]:
        """A ``Future`` of the next value of ``key``; ``cancel()`` removes the waiter, or
        returns False when the value is already on its way (it then completes normally)."""
        fut = _RecvFuture()

        def done(error: BaseException | None, received: Received | None) -> None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(received)  # type: ignore[arg-type]
            fut._canceller = None  # it holds ``done``, which holds the future: no cycle

        try:
            canceller = self.start_recv(key, done, copy=copy)
        except RendezvousError as e:
            fut.set_exception(e)
            return fut
        fut._canceller = canceller
        if fut.done():  # ``done`` may have run before the line above
            fut._canceller = None
        return fut

    async def arecv(
        self, key: str | ParsedKey, *, timeout: float | None = None, copy: bool = False
    ) -> Received:
        """``await`` the next value of ``key`` without blocking the event loop.

        A timeout or a cancellation of the task removes the waiter; a value already taken
        when the cancellation came is returned, not dropped (as ``asyncio.wait_for`` does).
        """
        pk = as_parsed_key(key)
        t = check_timeout(timeout)
        loop = asyncio.get_running_loop()
        afut: asyncio.Future[Received] = loop.create_future()

        def done(error: BaseException | None, received: Received | None) -> None:
            loop.call_soon_threadsafe(_settle, afut, error, received)

        cancel = self.start_recv(pk, done, copy=copy)
        try:
            finished, _ = await asyncio.wait({afut}, timeout=t)
        except asyncio.CancelledError:
            if cancel():
                raise
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            return await afut
        if not finished and cancel():
            raise self._timeout_error(pk, t)
        return await afut

    def _timeout_error(self, key: ParsedKey, timeout: float | None) -> DeadlineExceededError:
        return timeout_error(key, timeout)


_local_log = logging.getLogger("shmrdv.local")


class _Waiter:
    """One pending receive; hashed by identity, so its channel can remove exactly it."""

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

    The receiver gets the very array sent (as TensorFlow shares a host tensor between
    Send and Recv on one worker): the sender must not write to it afterwards, or the
    receiver asks for ``copy=True``. ``send`` never blocks; a waiting receiver's ``done``
    runs in the sender's thread. ``close()`` aborts with ``CancelledError``. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: WaiterTable[str, _Value, _Waiter] = WaiterTable()
        self._error: BaseException | None = None
        self._error_tb: TracebackType | None = None
        self._sent = 0
        self._received = 0

    def send(
        self,
        key: str | ParsedKey,
        value: Any,
        *,
        is_dead: bool = False,
        timeout: float | None = None,
    ) -> None:
        if timeout is not None:
            check_timeout(timeout)  # for the common signature: nothing here waits
        pk = as_parsed_key(key)
        self.put(pk, check_value(value, pk.full_key), bool(is_dead))

    def put(self, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool) -> None:
        """``send`` of a parsed key and a value ``check_value`` accepted (a Worker's step)."""
        with self._lock:
            if self._error is not None:
                raise self._abort_error()
            self._sent += 1
            waiter = self._table.put(key.full_key, (value, is_dead))
            if waiter is None:
                return
            self._received += 1
        invoke_done(waiter.done, None, _deliverable(value, is_dead, waiter.copy))

    def start_recv(
        self,
        key: str | ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
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
        with self._lock:
            return self._table.cancel(full_key, waiter)

    def start_abort(self, error: BaseException) -> None:
        """Fail every waiting receive with ``error`` (in this thread, after the lock is
        released) and every later call; drop queued values. The first error wins.
        ``InvalidArgumentError`` if ``error`` is not an exception (TensorFlow CHECK-fails)."""
        if not isinstance(error, BaseException):
            raise InvalidArgumentError(f"start_abort needs an exception instance, not {error!r}")
        with self._lock:
            if self._error is not None:
                return
            self._error, self._error_tb = error, error.__traceback__
            dropped = self._table.pending_values
            waiters = self._table.abort()
        if dropped:
            # TensorFlow logs the dropped sends too ("Rendezvous aborted, dropping ...").
            _local_log.debug("LocalRendezvous aborted (%r): dropped %d value(s)", error, dropped)
        for waiter in waiters:
            invoke_done(waiter.done, self._abort_error(), None)

    def _abort_error(self) -> BaseException:
        """The stored error with its stored traceback: raising one instance again and again
        would grow its ``__traceback__`` and keep those frames (and their arrays) alive."""
        error = self._error
        assert error is not None
        return error.with_traceback(self._error_tb)

    def close(self) -> None:
        """Abort with ``CancelledError("LocalRendezvous closed")`` unless aborted. Idempotent."""
        self.start_abort(CancelledError("LocalRendezvous closed"))

    @property
    def aborted(self) -> BaseException | None:
        """The error the rendezvous was aborted with, or ``None``."""
        return self._error

    def stats(self) -> dict[str, int]:
        """Values and waiters pending now, keys with either, sent and received so far."""
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


def _too_late() -> bool:  # the canceller of a receive done before ``start_recv`` returned
    return False
