"""Link: the consumer's long-lived Exchange stream to one producer (server.py).

Each receive posts one want (a RecvTensorRequest with a fresh request_id) on the
stream; the producer answers it with one message as soon as the value is sent, so a
tensor costs one stream message: no new call, no server handler wake-up (issue 12).
Acks of earlier values ride on the next want; a cancel is a want with the cancel flag.

Thread model: one reader thread per link ("shmrdv-rpc-link") iterates the replies and
hands each to its want (``Want.link_*``, called in that thread, never under the link's
lock); gRPC's own thread consumes the request queue. A broken stream is reopened after a
backoff (50 ms doubling to 1 s) while wants are pending, and every pending want is posted
again under its request_id (the server's response cache answers one it already took);
a want whose deadline passes meanwhile is told so. A peer without Exchange
(``UNIMPLEMENTED``: TensorFlow, an older shmrdv) hands its wants back for the unary path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import grpc

from .._errors import RendezvousError, ResourceExhaustedError
from .._status import error_for_code
from . import messages
from .methods import EXCHANGE_METHOD
from .rpc_errors import error_code, error_details

__all__ = ["Link", "Want"]

_log = logging.getLogger("shmrdv.rpc.link")

_RETRY_INITIAL = 0.05
_RETRY_MAX = 1.0
_JOIN_TIMEOUT = 5.0
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Want(Protocol):
    """A receive waiting on a link (the client's ``_Recv``); called in the reader thread."""

    request_id: int

    def link_request(self, acks: Sequence[int]) -> bytes | None:
        """The want's request bytes carrying ``acks``; None: it is over (post nothing)."""

    def link_value(self, data: bytes) -> None:
        """Its value arrived (a RecvTensorResponse, ``messages.encode_link_value``)."""

    def link_fetch(self) -> None:
        """Too large for the stream: fetch it with RecvTensorInline under request_id."""

    def link_failed(self, error: RendezvousError, code: grpc.StatusCode) -> None:
        """The producer failed it (or the link did, for good)."""

    def link_expired(self, why: str) -> bool:
        """Its deadline passed while the link was down (``why``): told so, True."""

    def link_unsupported(self) -> None:
        """The peer has no Exchange: go the unary way."""


class Link:
    """One Exchange stream to ``address`` on ``channel``; see the module docstring."""

    def __init__(
        self,
        address: str,
        channel: grpc.Channel,
        metadata: Sequence[tuple[str, str]],
        take_acks: Any,
        on_end: Any,
    ) -> None:
        self.address = address
        self._channel = channel
        self._metadata = metadata
        self._take_acks = take_acks  # () -> list[int]: acks waiting for this peer
        self._on_end = on_end  # (Link) -> None: the link is over
        self._lock = threading.Lock()
        self._pending: dict[int, Want] = {}
        self._requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._call: Any = None
        self._live = False  # a call consumes self._requests
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shmrdv-rpc-link", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<shmrdv Link {self.address} pending={len(self._pending)}>"

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- called by receives (any thread) ---------------------------------------------

    def post(self, want: Want) -> bool:
        """Post ``want``; False if the link is over (make a new one)."""
        with self._lock:
            if self._closed:
                return False
            if not self._live:
                # Between calls: the reader posts every pending want when the stream opens.
                self._pending[want.request_id] = want
                return True
            request = want.link_request(self._take_acks())
            if request is None:
                return True
            self._pending[want.request_id] = want
            self._requests.put(request)
        return True

    def withdraw(self, want: Want, request: bytes | None) -> bool:
        """Take ``want`` off the link (posting ``request``, a cancel, if given); False if
        its reply is already being handed to it."""
        with self._lock:
            if self._pending.get(want.request_id) is not want:
                return False
            del self._pending[want.request_id]
            if request is not None and not self._closed:
                self._requests.put(request)
        return True

    def send_acks(self, acks: Sequence[int]) -> bool:
        """Post an acks-only message; False if the link is over."""
        return self.send(messages.encode_request(0, "", 0, finished=acks))

    def send(self, request: bytes) -> bool:
        """Post ``request`` (acks, a cancel) if the stream is open; False if not."""
        with self._lock:
            if self._closed or not self._live:
                return False
            self._requests.put(request)
        return True

    def close(self, *, join: bool = True) -> None:
        """End the stream (its wants are the client's to fail); join the reader thread."""
        with self._lock:
            if self._closed and not join:
                return
            self._closed = True
            call = self._call
            self._requests.put(None)
        if call is not None:
            call.cancel()
        if join and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT)

    # -- the reader thread -------------------------------------------------------------

    def _iter_requests(self, requests: queue.SimpleQueue[bytes | None]) -> Iterator[bytes]:
        while True:
            item = requests.get()
            if item is None:
                return
            yield item

    def _run(self) -> None:
        backoff = _RETRY_INITIAL
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    # A fresh request queue per call: the old one's consumer may still hold it.
                    old, self._requests = self._requests, queue.SimpleQueue()
                    old.put(None)
                    wants = list(self._pending.values())
                    acks = self._take_acks()
                    for want in wants:
                        request = want.link_request(acks)
                        acks = []
                        if request is None:
                            self._pending.pop(want.request_id, None)
                        else:
                            self._requests.put(request)
                    call = self._channel.stream_stream(EXCHANGE_METHOD)(
                        self._iter_requests(self._requests), metadata=self._metadata
                    )
                    self._call = call
                    self._live = True
                error = self._read(call)
                with self._lock:
                    self._live = False
                if error is None:
                    code, details = grpc.StatusCode.UNAVAILABLE, "the producer ended the stream"
                else:
                    code, details = error_code(error), error_details(error)
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    self._end_all(lambda w: w.link_unsupported())
                    return
                if "Too many open files" in details:
                    exhausted = ResourceExhaustedError(
                        f"cannot connect to {self.address}: too many open files (ulimit -n): "
                        f"{details}"
                    )
                    self._fail_all(exhausted, code)
                    return
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    failure = error_for_code(code)(
                        f"Exchange with {self.address} failed: {details}"
                    )
                    self._fail_all(failure, code)
                    return
                # Transient: reopen while wants are pending, after the backoff; a want whose
                # deadline passes meanwhile is told so.
                wait_until = time.monotonic() + backoff
                backoff = min(backoff * 2, _RETRY_MAX)
                while True:
                    with self._lock:
                        if self._over():
                            return
                        wants = list(self._pending.values())
                        if not wants:
                            self._closed = True
                            break
                    for want in wants:
                        if want.link_expired(details):
                            self.withdraw(want, None)
                    left = wait_until - time.monotonic()
                    if left <= 0:
                        break
                    time.sleep(min(left, 0.05))
                with self._lock:
                    if self._over():
                        return
        finally:
            with self._lock:
                self._closed = True
                self._requests.put(None)
            self._on_end(self)

    def _over(self) -> bool:
        return self._closed  # a method: mypy would keep an attribute narrowed across calls

    def _read(self, call: Any) -> grpc.RpcError | None:
        try:
            for data in call:
                self._reply(data)
        except grpc.RpcError as e:
            return e
        return None

    def _reply(self, data: bytes) -> None:
        try:
            reply = messages.decode_link_reply(data)
        except RendezvousError:
            _log.warning("a bad Exchange reply from %s was ignored", self.address)
            return
        with self._lock:
            want = self._pending.get(reply.request_id)
            if want is None:
                return  # withdrawn (cancelled): the server gives that value back
            if reply.code == grpc.StatusCode.UNAVAILABLE.value[0]:
                return  # the producer is stopping: posted again when the stream reopens
            del self._pending[reply.request_id]
        try:
            if reply.code:
                code = _CODES.get(reply.code, grpc.StatusCode.UNKNOWN)
                want.link_failed(error_for_code(code)(reply.message), code)
            elif reply.fetch:
                want.link_fetch()
            else:
                want.link_value(data)
        except Exception:  # a want's bug must not end the link for the others
            _log.exception("handing an Exchange reply from %s failed", self.address)

    def _fail_all(self, error: RendezvousError, code: grpc.StatusCode) -> None:
        self._end_all(lambda w: w.link_failed(error, code))

    def _end_all(self, tell: Any) -> None:
        with self._lock:
            self._closed = True
            wants = list(self._pending.values())
            self._pending.clear()
        for want in wants:
            try:
                tell(want)
            except Exception:
                _log.exception("ending a want on the link to %s failed", self.address)
