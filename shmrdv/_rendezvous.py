"""The Rendezvous interface every transport implements, and the receive flavours built on it.

Every receive ends in a ``Received`` (the value and TensorFlow's ``is_dead``), defined
here with the interface that returns it, so that a transport's receive path reads this
module and its own.

A rendezvous implements four things: ``send``, ``start_recv`` (the one asynchronous
receive primitive, with a canceller: TensorFlow's ``RecvAsync``), ``start_abort`` and,
where it can do better than a plain ``numpy.empty``, ``allocate``. Everything else a user
calls — the blocking ``recv`` with a timeout, ``recv_async``, ``recv_future`` and
``arecv`` — is written once, here, on top of ``start_recv``, so every rendezvous behaves
the same way (TensorFlow: ``Recv`` is a "synchronous wrapper for RecvAsync"). The same
name and flags go on down to the transports (``Transport.start_recv`` in
``_transport.py``).

The canceller returned by ``start_recv`` is how a timeout, ``Future.cancel()`` or an
asyncio cancellation removes a waiter: it returns ``True`` when it removed the waiter
before anything was delivered (``done`` will then never be called), ``False`` when the
delivery already happened or is under way (``done`` is, or will be, called exactly once).
Unlike TensorFlow, whose timed-out waiter stays queued and swallows the next send, a
receive that gave up never takes a value.

Thread model: see ``docs/threads.md``. A blocked ``recv`` waits in the calling thread;
``done`` callbacks run where the rendezvous says, never under its lock.
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
    "done_failed",
    "invoke_done",
    "received",
    "same_value",
    "timeout_error",
    "wait_received",
]


_callback_log = logging.getLogger("shmrdv.callbacks")

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
    _callback_log.exception("exception in a recv_async done callback %r", done)


_C = TypeVar("_C", bound="Closing")


class Closing:
    """Mixin for a class that defines ``close``: entering gives the object itself, leaving
    (normally or by an exception, which propagates) calls ``close``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_log = logging.getLogger("shmrdv.rendezvous")


@dataclass(frozen=True, slots=True)
class Received:
    """A received tensor: ``value`` and TensorFlow's ``is_dead`` flag.

    ``is_dead`` is set for values of untaken control-flow branches; the value still has
    the sender's dtype and shape. Unpacks as ``value, is_dead = rdv.recv(key)``.
    """

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
    """``Received(value, is_dead)``, built at half the cost: for the receive side's hot
    loop (one per message arriving). ``is_dead`` must be a ``bool``."""
    r: Received = _new(Received)
    _set_value(r, value)
    _set_is_dead(r, is_dead)
    return r


def same_value(a: Received, b: Received) -> bool:
    """Equal dtype, shape, bytes and ``is_dead`` (for tests and checks; NaN-safe)."""
    return (
        a.is_dead == b.is_dead
        and a.value.dtype == b.value.dtype
        and a.value.shape == b.value.shape
        and np.ascontiguousarray(a.value).tobytes() == np.ascontiguousarray(b.value).tobytes()
    )


Canceller = Callable[[], bool]

# How long a blocked receiver waits between looks at its deadline and the transport's
# work (a dispatcher tick): short enough for a dead producer to be noticed within a second.
_HELP_PERIOD = 0.2
_INF = float("inf")
# After this long a blocked receive tells its observer it is still waiting (then after
# twice as long, and so on): a debug line and an entry in Worker.stats(), never per message.
_LONG_WAIT = 1.0


def as_parsed_key(key: str | ParsedKey) -> ParsedKey:
    """Accept a key string or an already parsed key."""
    if isinstance(key, ParsedKey):
        return key
    if not isinstance(key, str):
        raise InvalidArgumentError(
            f"a rendezvous key must be a str (see shmrdv.create_key), not {type(key).__name__}"
        )
    return parse_key(key)


def check_timeout(timeout: object) -> float | None:
    """``None`` waits forever; a number (an ``int`` or a ``float``, numpy's too) must be
    finite and >= 0. The one check of every call's timeout, whatever its transport: a
    string or a bool is refused, not converted (``"1"`` and ``True`` are no durations)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgumentError(f"timeout must be a number of seconds or None, not {timeout!r}")
    t = float(timeout)
    if not t >= 0 or t == float("inf"):
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
    """One blocking receiver's mailbox: filled exactly once by its ``done`` callback.

    A plain lock, made only when the receiver has to wait (a receive whose value is already
    there never makes one) and released by ``done``, is the wake-up: it costs a fraction
    of a ``threading.Event`` (which builds a ``Condition``). Only the receiving thread
    calls ``wait``. One is made per blocking receive, so its fields start as class
    defaults (no ``__init__``, no ``__slots__``): ``done`` sets what it is given.
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


def _plain_wait(slot: RecvSlot, timeout: float) -> None:
    slot.wait(timeout)


class WaitObserver(Protocol):
    """What a blocked receive tells whoever routes it (the Worker's step rendezvous)."""

    def timeout_error(self, key: ParsedKey, timeout: float | None) -> DeadlineExceededError:
        """The error of a receive whose timeout expired (its waiter already removed)."""
        ...

    def waiting_long(self, slot: RecvSlot, key: ParsedKey, waited: float) -> None:
        """The receive of ``slot`` has waited ``waited`` seconds (after 1 s, 2 s, 4 s, ...)."""
        ...

    def stopped_waiting(self, slot: RecvSlot) -> None:
        """The receive of ``slot``, once reported by ``waiting_long``, no longer waits."""
        ...


def wait_received(
    slot: RecvSlot,
    cancel: Canceller,
    key: str | ParsedKey,
    timeout: float | None,
    helper: Callable[[RecvSlot, float], None] = _plain_wait,
    observer: WaitObserver | None = None,
) -> Received:
    """The one blocking receive loop: wait for ``slot``, cancel on timeout or interrupt.

    ``helper(slot, seconds)`` blocks up to ``seconds`` or until the slot is filled, doing
    whatever work the transport needs from a blocked receiver meanwhile (``Transport.wait``);
    it may return early. A timeout that expires removes the waiter (``cancel()``) and raises
    ``DeadlineExceededError``; if the value won the race, it is returned. Ctrl-C
    (``KeyboardInterrupt``) removes the waiter too and propagates. ``observer`` (if any)
    builds the timeout's error and hears of a wait that lasts (``WaitObserver``). ``key``
    (checked already) is parsed only for those, never on the way to a value.
    """
    if slot.filled:
        return slot.result()
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    report_at = start + _LONG_WAIT if observer is not None else float("inf")
    reported = False
    # The clock is read again only for a slot still empty after a wait: one read for a
    # wait that is answered at once (the first pass uses ``start``).
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
    got = slot.received  # ``slot.result()`` written out, as in ``recv``
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
    if fut.done():  # pragma: no cover - we never cancel this future ourselves
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(received)  # type: ignore[arg-type]


class Rendezvous(abc.ABC):
    """A place where a producer's ``send`` meets a consumer's ``recv`` under one key.

    Keys are TensorFlow rendezvous keys (``shmrdv.create_key``), as strings or
    ``ParsedKey``. Several sends of one key queue in FIFO order; each receive takes the
    oldest. ``send`` never blocks.
    """

    # -- what a transport implements -------------------------------------------------

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

        Never blocks on the consumer, unless its Worker has a ``max_inflight_bytes``
        window and it is full: then it waits up to ``timeout`` seconds (None: as long as
        it takes) for room and raises ``ResourceExhaustedError``, having sent nothing.
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

        The one receive primitive the other flavours are built on (TensorFlow's
        ``RecvAsync``). The canceller removes the waiter and returns ``True`` (``done``
        will never run), or returns ``False`` when the value is delivered or on its way.

        ``done`` may run in the calling thread (a value is already there) or in a
        transport thread, never under a lock of the rendezvous. ``copy``: deliver a
        private copy instead of shared memory. ``blocking``: the caller is a thread
        that will block in ``recv`` until ``done`` has run, and ``done`` is quick and
        never blocks (a ``RecvSlot``'s): a transport may then let that thread wait for
        the value itself instead of waking another thread for it.

        May raise a ``RendezvousError`` at once for a call that cannot start (a bad key,
        a key this rendezvous cannot receive, an aborted rendezvous); ``done`` is then
        never called.
        """

    @abc.abstractmethod
    def start_abort(self, error: BaseException) -> None:
        """Fail every pending and later call with ``error``; the first error wins. Never blocks."""

    def allocate(self, key: str | ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """An array to fill and then pass to ``send(key, array)``.

        Transports that can, return memory the receiver will see without a copy; the
        default is a plain ``numpy.empty``, which ``send`` hands over as any array.
        """
        as_parsed_key(key)
        try:
            return np.empty(shape, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"cannot allocate shape={shape!r} dtype={dtype!r}: {e}"
            ) from e

    # -- receive flavours, built once on start_recv ------------------------------------

    def recv_async(self, key: str | ParsedKey, done: DoneCallback, *, copy: bool = False) -> None:
        """Call ``done(error, received)`` exactly once, when the value arrives or the call fails.

        Returns at once. ``done`` runs in the calling thread if the value is already
        there, otherwise in a transport thread; it never runs under a lock, and an
        exception it raises is logged (logger ``shmrdv.callbacks``), not propagated.
        A bad key is reported through ``done`` too.
        """
        try:
            self.start_recv(key, lambda err, rec: invoke_done(done, err, rec), copy=copy)
        except RendezvousError as e:
            invoke_done(done, e, None)

    def recv(
        self, key: str | ParsedKey, *, timeout: float | None = None, copy: bool = False
    ) -> Received:
        """Block until the oldest value of ``key`` arrives; return ``Received(value, is_dead)``.

        ``timeout`` (seconds, ``None`` = forever) that expires raises
        ``DeadlineExceededError`` (also a ``TimeoutError``) and removes the waiter, so a
        later send is not swallowed. ``copy=True`` returns a private copy where the
        transport would otherwise hand out shared memory. Raises the abort error if the
        rendezvous is or gets aborted; Ctrl-C (``KeyboardInterrupt``) also removes the waiter.
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
        """How ``recv`` waits for a ``slot`` that ``start_recv(..., blocking=True)`` will fill.

        Here: on the slot alone (``wait_received``). A rendezvous whose transports need
        help from a blocked receiver, or that reports long waits, says so by overriding it.
        """
        return wait_received(slot, cancel, key, timeout)

    def recv_future(
        self, key: str | ParsedKey, *, copy: bool = False
    ) -> concurrent.futures.Future[Received]:
        """A ``concurrent.futures.Future`` of the next value of ``key``.

        ``cancel()`` removes the waiter and returns ``True``, or returns ``False`` when the
        value has already been taken for this future (it then completes normally).
        """
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
        if fut.done():  # completed already (``done`` may have run before the line above)
            fut._canceller = None
        return fut

    async def arecv(
        self, key: str | ParsedKey, *, timeout: float | None = None, copy: bool = False
    ) -> Received:
        """``await`` the next value of ``key`` without blocking the event loop.

        A ``timeout`` that expires raises ``DeadlineExceededError`` and removes the waiter;
        cancelling the awaiting task removes it too. If the value was already taken when
        the cancellation arrived, it is returned instead of being dropped (as
        ``asyncio.wait_for`` does with a result that races its cancellation).
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
        """The error of a receive of ``key`` whose ``timeout`` expired (overridable)."""
        return timeout_error(key, timeout)


_local_log = logging.getLogger("shmrdv.local")


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
            _local_log.debug(
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
