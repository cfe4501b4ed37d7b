"""Ack handling: telling servers which responses arrived (TensorFlow's MarkRecvFinished).

An ack rides on the next RecvTensor request to the same peer (``take``); one that none
takes within ``_ACK_DELAY`` goes on its own as a ``MarkRecvFinished`` call (``notify``),
so that the server's response cache drops the delivered value now rather than when it
expires. Closing sends what is left, waiting at most ``_CLOSE_ACK_WAIT``.

A peer's queue is a deque of ``(request_id, time.monotonic())``, kept for as long as the
queue is open (``pending`` hands it out): a blocked receiver's own call
(``own_call``) appends its ack and pops those it carries itself, with the deque's
atomic operations, and so costs its receive no call here.

Thread model (docs/threads.md): the deques' appends and pops are atomic; one condition
guards the table and the acker's state; one daemon thread ("shmrdv-rpc-acks"), started
with the first queue, sends the late ones. While acks come it looks every
``_ACK_DELAY``; after a period without any it looks every ``_IDLE_LOOK`` (an ack
through ``ack`` wakes it at once; one appended to a deque waits for its next look), so
an idle client costs one wake-up a second.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from . import messages
from .mark_finished import encode_mark_recv_finished
from .methods import MARK_RECV_FINISHED_METHOD

__all__ = ["AckQueue", "notify"]

_ACK_TIMEOUT = 5.0
# An ack not piggybacked on a request to the same peer within this time goes on its own
# (MarkRecvFinished), so that the server's cache does not hold the value until it expires.
# Closing waits this long (s) at most for the acks it sends.
_CLOSE_ACK_WAIT = 1.0
_ACK_DELAY = 0.05
# How often an acker without acks looks at the deques (a request to the same peer takes
# them meanwhile, as TensorFlow's step pattern makes one per step).
_IDLE_LOOK = 1.0

#: Where an ack for a peer can go: its open channel, if any.
Route = Callable[[str], grpc.Channel | None]


def notify(
    channel: grpc.Channel,
    request_id: int,
    metadata: Sequence[tuple[str, str]],
    *,
    released: bool = False,
) -> Any:
    """Tell the server, without waiting, that ``request_id`` is done with; return the
    call's future (None if the channel is closed), for a caller that wants to wait.

    ``MarkRecvFinished`` (TensorFlow): the value arrived, drop the cached response; with
    ``released`` (shmrdv's flag): the call was cancelled, give back a value taken for it.
    """
    request = encode_mark_recv_finished(request_id, released=released)
    try:
        fut = channel.unary_unary(MARK_RECV_FINISHED_METHOD).future(
            request, timeout=_ACK_TIMEOUT, metadata=metadata
        )
    except (ValueError, grpc.RpcError):  # the channel was closed meanwhile
        return None
    # The answer does not matter: the cache entry also expires on its own.
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


class AckQueue:
    """The acks (request_ids whose responses arrived) per peer, oldest first.

    Args:
        metadata: the call metadata (the token) of acks sent on their own.
        route: where a peer's late acks go (``Route``).
    """

    def __init__(self, metadata: Sequence[tuple[str, str]], route: Route) -> None:
        self._metadata = metadata
        self._route = route
        self._cond = threading.Condition(threading.Lock())
        self._acks: dict[str, deque[tuple[int, float]]] = {}
        self._acker: threading.Thread | None = None
        self._acker_idle = False
        self._closed = False

    def pending(self, address: str) -> deque[tuple[int, float]]:
        """``address``'s queue itself (see the module docstring): append
        ``(request_id, time.monotonic())`` to ack, pop from the left to carry them."""
        with self._cond:
            q = self._acks.get(address)
            if q is None:
                q = self._acks[address] = deque()
                if not self._closed:
                    self._start_acker()
        return q

    def _start_acker(self) -> None:
        if self._acker is None:
            self._acker = threading.Thread(
                target=self._send_late_acks, name="shmrdv-rpc-acks", daemon=True
            )
            try:
                self._acker.start()
            except RuntimeError:  # no thread: the server's cache expires them instead
                self._acker = None

    def ack(self, address: str, request_id: int) -> None:
        """The response of ``request_id`` arrived: tell the server, cheaply."""
        with self._cond:
            if self._closed:
                return
            q = self._acks.get(address)
            if q is None:
                q = self._acks[address] = deque()
            q.append((request_id, time.monotonic()))
            if self._acker is None:
                self._start_acker()
            elif self._acker_idle:
                # Only an idle acker needs waking; a busy one looks every _ACK_DELAY (a
                # wake-up per receive would cost a receive a thread switch).
                self._acker_idle = False
                self._cond.notify()

    def take(self, address: str) -> list[int]:
        """The acks to piggyback on a request to ``address`` (they leave the queue)."""
        pending = self._acks.get(address)
        taken: list[int] = []
        try:
            while pending and len(taken) < messages.MAX_ACKS:  # what a server takes
                taken.append(pending.popleft()[0])
        except IndexError:  # taken by another request or the acker meanwhile
            pass
        return taken

    def give_back(self, address: str, acks: list[int]) -> None:
        """A request that carried ``acks`` failed: they go with a later one."""
        if acks:
            now = time.monotonic()
            with self._cond:
                if not self._closed:
                    q = self._acks.get(address)
                    if q is None:
                        q = self._acks[address] = deque()
                    q.extendleft((rid, now) for rid in reversed(acks))
                    self._cond.notify()

    def close(self, join_timeout: float) -> list[tuple[str, int]]:
        """Stop taking acks and join the acker thread; the acks not yet sent."""
        with self._cond:
            self._closed = True
            unsent = [(a, rid) for a, q in self._acks.items() for rid, _ in q]
            for q in self._acks.values():
                q.clear()  # a deque handed out stays valid; what comes now is dropped
            self._cond.notify_all()
            acker = self._acker
        if acker is not None and acker is not threading.current_thread():
            acker.join(join_timeout)
        return unsent

    def flush(self, unsent: list[tuple[str, int]], channels: dict[str, grpc.Channel]) -> None:
        """Closing: send the acks no request took yet, waiting at most ``_CLOSE_ACK_WAIT``,
        so that servers drop the delivered values now rather than when their cache expires."""
        calls = [
            call
            for address, rid in unsent
            if (channel := channels.get(address)) is not None
            and (call := notify(channel, rid, self._metadata)) is not None
        ]
        deadline = time.monotonic() + _CLOSE_ACK_WAIT
        for call in calls:
            try:
                call.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # timed out or cancelled: the server's cache expires it
                call.cancel()

    def _send_late_acks(self) -> None:
        """The acker thread: sends acks no request took within ``_ACK_DELAY``.

        It looks every ``_ACK_DELAY`` while acks come, and every ``_IDLE_LOOK`` (or when
        woken by ``ack``) after a period that had none.
        """
        quiet = False
        while True:
            due: list[tuple[str, int]] = []
            with self._cond:
                while not due:
                    if self._closed:
                        return
                    now = time.monotonic()
                    oldest = None
                    for q in self._acks.values():
                        try:
                            t = q[0][1] if q else None
                        except IndexError:  # taken meanwhile
                            t = None
                        if t is not None and (oldest is None or t < oldest):
                            oldest = t
                    if oldest is None and quiet:
                        self._acker_idle = True
                        self._cond.wait(_IDLE_LOOK)
                        self._acker_idle = quiet = False
                    elif oldest is None:
                        quiet = True
                        self._cond.wait(_ACK_DELAY)
                    elif oldest + _ACK_DELAY > now:
                        quiet = False
                        self._cond.wait(oldest + _ACK_DELAY - now)
                    else:
                        for address, q in self._acks.items():
                            try:
                                while q and q[0][1] + _ACK_DELAY <= now:
                                    due.append((address, q.popleft()[0]))
                            except IndexError:  # taken by a request meanwhile
                                pass
            by_address: dict[str, list[int]] = {}
            for address, rid in due:
                by_address.setdefault(address, []).append(rid)
            for address, rids in by_address.items():
                channel = self._route(address)
                if channel is not None:
                    for rid in rids:
                        notify(channel, rid, self._metadata)
