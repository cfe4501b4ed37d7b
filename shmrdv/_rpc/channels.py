"""The consumer's channels: one per producer address, in one process.

A ``Peer``: a producer's channel, its methods, and what rides on its next request: acks
(answers arrived) and releases (request_ids given up: their values go back).
``Channels.close`` sends what no request took, and waits for it a moment.

Thread model (docs/threads.md): thread-safe: one lock guards the table; the queues are
deques (atomic appends and pops); nothing blocks under the lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import grpc

from .._cluster import split_host_port
from .._errors import CancelledError, RendezvousError, ResourceExhaustedError, error_for_code
from .guard import TLSConfig
from .messages import (
    GET_STATUS,
    MARK_RECV_FINISHED,
    RECV_TENSOR,
    RECV_TENSOR_SERIES,
    DeviceAttributes,
    decode_status,
    encode_finished,
    take_ids,
)

__all__ = ["Channels", "Peer", "status"]

# TensorFlow's channel: GRPC_ARG_MAX_MESSAGE_LENGTH = INT32_MAX, reconnect backoff <= 1 s.
_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.max_send_message_length", 1 << 20),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.keepalive_time_ms", 20_000),  # notice a peer gone without closing (server: 5 s)
    ("grpc.keepalive_timeout_ms", 10_000),
    ("SingleThreadedUnaryStream", 1),  # a series is read in its reader's thread
]
_ACK_TIMEOUT = 5.0
_CLOSE_WAIT = 1.0


def status(error: Any) -> tuple[grpc.StatusCode, str]:
    """A failed call's code and details (a bare ``RpcError`` has neither). A connection
    that broke mid-frame ("Stream removed", ``INTERNAL``) is ``UNAVAILABLE``: dropped."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    if code == grpc.StatusCode.INTERNAL and details.startswith("Stream removed"):
        code = grpc.StatusCode.UNAVAILABLE
    return code, details


class Peer:
    """One producer address: its channel, its methods, and its next request's news."""

    __slots__ = (
        "_sending", "acks", "address", "channel", "metadata", "no_series", "reached", "recv",
        "releases", "series",
    )  # fmt: skip

    def __init__(
        self, address: str, channel: grpc.Channel, metadata: Sequence[tuple[str, str]],
        sending: set[Any],
    ) -> None:  # fmt: skip
        self.address = address
        self.channel = channel
        self.metadata = metadata
        self.recv = channel.unary_unary(RECV_TENSOR)
        self.series = channel.unary_stream(RECV_TENSOR_SERIES)
        self.acks: deque[int] = deque()
        self.releases: deque[int] = deque()
        self.no_series = 0.0  # no series until then (monotonic)
        self.reached = False  # it answered once: failing to connect now means it went away
        self._sending = sending

    def finished(self, request_id: int, *, released: bool = False, held: int = 0) -> Any:
        """``MarkRecvFinished``, without waiting; its future (None: the channel is closed)."""
        request = encode_finished(request_id, released=released, held=held)
        try:
            fut = self.channel.unary_unary(MARK_RECV_FINISHED).future(
                request, timeout=_ACK_TIMEOUT, metadata=self.metadata
            )
        except (ValueError, grpc.RpcError):
            return None
        self._sending.add(fut)
        fut.add_done_callback(self._sent)
        return fut

    def _sent(self, fut: Any) -> None:
        self._sending.discard(fut)
        if not fut.cancelled():
            fut.exception()


class Channels(dict[str, Peer]):
    """This process's channels to producers, by address (``tls``: TLS channels): a
    missing address opens its channel (``InvalidArgumentError`` naming a bad address,
    ``ResourceExhaustedError`` without descriptors, ``CancelledError`` once closed)."""

    def __init__(self, tls: TLSConfig | None, metadata: Sequence[tuple[str, str]]) -> None:
        super().__init__()
        self._tls = tls
        self._metadata = metadata
        self._lock = threading.Lock()
        self._sending: set[Any] = set()
        self._closed = False

    def __missing__(self, address: str) -> Peer:
        split_host_port(address)
        with self._lock:
            if self._closed:
                raise CancelledError("RpcClient is closed")
            peer = self.get(address)
            if peer is None:
                options = list(_OPTIONS)
                try:
                    if self._tls is None:
                        channel = grpc.insecure_channel(address, options)
                    else:
                        options += self._tls.channel_options()
                        creds = self._tls.channel_credentials()
                        channel = grpc.secure_channel(address, creds, options)
                except OSError as e:
                    raise ResourceExhaustedError(
                        f"cannot open a gRPC channel to {address}: {e}"
                    ) from e
                peer = self[address] = Peer(address, channel, self._metadata, self._sending)
        return peer

    def drop(self, peer: Peer) -> None:
        """Forget a channel that failed for lack of descriptors: the next one connects anew."""
        with self._lock:
            if self.get(peer.address) is peer:
                del self[peer.address]
        peer.channel.close()

    def get_status(self, address: str, timeout: float | None) -> tuple[DeviceAttributes, ...]:
        """TensorFlow's ``GetStatus`` of ``address``; blocks. The mapped error if it fails."""
        channel = self[address].channel
        try:
            data = channel.unary_unary(GET_STATUS)(b"", timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            code, details = status(e)
            raise error_for_code(code)(f"GetStatus of {address} failed: {details}") from e
        try:
            return decode_status(data)
        except RendezvousError as e:
            raise type(e)(f"bad GetStatusResponse from {address}: {e}") from e

    def close(self) -> None:
        """Send the acks and releases no request took (the servers drop or give back the
        values now, not at their cache's expiry), wait for them up to a second, and close
        the channels. Idempotent."""
        with self._lock:
            self._closed = True
            peers = list(self.values())
            self.clear()
        for peer in peers:
            for rid in take_ids(peer.acks):
                peer.finished(rid)
            for rid in take_ids(peer.releases):
                peer.finished(rid, released=True)
        deadline = time.monotonic() + _CLOSE_WAIT
        for fut in list(self._sending):
            try:
                fut.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # timed out or cancelled: the server's cache expires it
                fut.cancel()
        for peer in peers:
            peer.channel.close()
