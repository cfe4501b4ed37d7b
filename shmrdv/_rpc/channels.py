"""ChannelCache: one gRPC channel per peer, and each channel's ``RecvTensor`` callable.

It owns the channel options (TensorFlow's message limits and reconnect backoff,
keepalive) and opens a peer's channel on first use. ``calls`` maps each open channel's
address to it and its ``RecvTensor`` callable, for a receive's hot path to read without
a lock or a call.

Fork: channels are per process. A cache used in a parent and then in a forked child
(``forked()``) keeps the parent's channels referenced, never closed (closing would act on
the parent's connections, and their finalizers must not run in the child); its owner
then opens a fresh cache.

Thread model (docs/threads.md): thread-safe; one lock guards the table, and nothing
blocks under it (channels are created, not connected, under it).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from typing import Any

import grpc

from .._cluster import split_host_port
from .._errors import CancelledError, ResourceExhaustedError, UnavailableError
from .methods import RECV_TENSOR_METHOD
from .security import TLSConfig

__all__ = ["ChannelCache", "recv_tensor"]

_log = logging.getLogger("shmrdv.rpc.client")

# TensorFlow's channel: GRPC_ARG_MAX_MESSAGE_LENGTH = INT32_MAX and
# GRPC_ARG_MAX_RECONNECT_BACKOFF_MS = 1000 (research §3.4).
_MAX_RECEIVE_BYTES = 2**31 - 1
_MAX_SEND_BYTES = 1 << 20  # requests are tiny
_BASE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", _MAX_SEND_BYTES),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.initial_reconnect_backoff_ms", 50),
    # Notice a peer that vanished without closing the connection (host down, partition)
    # while a call waits; the server permits pings every 5 s (server.py).
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
# HTTP/2 window options were measured and left at gRPC's defaults: a 256 MiB stream over
# loopback in 4 MiB chunks ran at 0.6-1.0 GB/s (best of 6, 2 busy cores) with the defaults
# and within that noise with grpc.http2.lookahead_bytes 16/32/64 MiB, bdp_probe off,
# max_frame_size 16 MiB or write_buffer_size 8 MiB on both ends.
# Also measured and left out (shmrdv bench shmrdv_grpc vs grpc_pull, 64 KiB and 1 MiB,
# 3 interleaved runs, 2026-12-04): grpc.experimental.single_threaded_unary_stream (the
# series reader waits on its call itself, no channel-thread hop) made 1 MiB slower
# (1.84/1.71/1.64 ms against 1.30/1.24/1.44 ms) and 64 KiB no faster; lookahead_bytes
# 8 MiB on the channel moved the 1 MiB ratio within the noise (1.26-1.69 against
# 1.36-1.75 times the pull) and 64 KiB the other way (1.24-1.42 against 1.13-1.37).


# Each channel's RecvTensor callable, made once: ``Channel.unary_unary`` costs a few
# microseconds per call (grpcio builds a closure and evaluates its type annotations).
_RECV_TENSOR: weakref.WeakKeyDictionary[grpc.Channel, grpc.UnaryUnaryMultiCallable] = (
    weakref.WeakKeyDictionary()
)


def recv_tensor(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """``channel``'s RecvTensor callable (identity serializers: bytes in, bytes out)."""
    method = _RECV_TENSOR.get(channel)
    if method is None:
        method = _RECV_TENSOR[channel] = channel.unary_unary(RECV_TENSOR_METHOD)
    return method


class ChannelCache:
    """The channels of one client in one process (``tls``: open TLS channels)."""

    def __init__(self, tls: TLSConfig | None) -> None:
        self._tls = tls
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False
        self._channels: dict[str, grpc.Channel] = {}
        # address -> (its open channel, that channel's RecvTensor callable); written
        # under the lock with ``_channels``, read without it.
        self.calls: dict[str, tuple[grpc.Channel, grpc.UnaryUnaryMultiCallable]] = {}

    def forked(self) -> bool:
        """True in a forked child: this cache is the parent's, and is left alone for good."""
        if os.getpid() == self._pid:
            return False
        # The parent's channels and threads are not ours (gRPC's state in them is invalid
        # here), and a lock held at fork time would never be released. Keep them without
        # closing: closing would act on the parent's connections. (A child is
        # single-threaded when it starts, so no race here.)
        _log.debug("RpcClient: pid changed (fork); opening fresh channels")
        _FORKED_LEFTOVERS.append(self._channels)
        return True

    def channel(self, address: str) -> grpc.Channel:
        """The channel to ``address``, opened now if need be.

        Raises ``InvalidArgumentError`` naming a bad address, ``CancelledError`` once
        closed, ``ResourceExhaustedError`` without descriptors, else ``UnavailableError``.
        """
        channel = self._channels.get(address)
        if channel is not None:  # open already (its address was checked then)
            return channel
        split_host_port(address)  # InvalidArgumentError naming a bad address
        with self._lock:
            if self._closed:
                raise CancelledError("RpcClient is closed")
            channel = self._channels.get(address)
            if channel is None:
                options = list(_BASE_OPTIONS)
                try:
                    if self._tls is not None:
                        options += self._tls.channel_options()
                        channel = grpc.secure_channel(
                            address, self._tls.channel_credentials(), options
                        )
                    else:
                        channel = grpc.insecure_channel(address, options)
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE):
                        raise ResourceExhaustedError(
                            f"cannot open a gRPC channel to {address}: too many open files "
                            f"({e.strerror}); raise the limit (ulimit -n)"
                        ) from e
                    raise UnavailableError(f"cannot open a gRPC channel to {address}: {e}") from e
                self._channels[address] = channel
                self.calls[address] = (channel, recv_tensor(channel))
            return channel

    def drop_channel(self, address: str, channel: Any) -> None:
        """Close ``channel`` if it is still ``address``'s (the next use opens a fresh one)."""
        with self._lock:
            current = self._channels.get(address)
            if current is None or current is not channel:
                return
            del self._channels[address]
            self.calls.pop(address, None)
        try:
            current.close()
        except Exception:  # pragma: no cover - closing a broken channel
            _log.debug("closing the channel to %s failed", address, exc_info=True)

    def route(self, address: str) -> grpc.Channel | None:
        """``address``'s open channel, or None."""
        with self._lock:
            return self._channels.get(address)

    def close(self) -> dict[str, grpc.Channel]:
        """Stop opening channels; the open ones, for the caller to close."""
        with self._lock:
            self._closed = True
            channels, self._channels = dict(self._channels), {}
            self.calls = {}
        return channels

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"channels": len(self._channels)}


# Channels inherited by forked children, kept referenced so that their finalizers never
# run in the child (they would act on the parent's gRPC state).
_FORKED_LEFTOVERS: list[Any] = []
