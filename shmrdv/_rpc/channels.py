"""ChannelCache: one gRPC channel and one Exchange link per peer, and what each peer speaks.

It owns the channel options (TensorFlow's message limits and reconnect backoff,
keepalive), opens a peer's channel on first use and its ``link.Link`` when a receive
asks, and remembers peers without ``Exchange`` or without ``RecvTensorInline``.

Fork: channels and links are per process. A cache used in a parent and then in a
forked child (``forked()``) keeps the parent's channels referenced, never closed (closing
would act on the parent's connections, and their finalizers must not run in the child);
its owner then opens a fresh cache. Before a fork the idle links of every cache end and
their threads are joined (a thread inside gRPC at fork time breaks the child).

Thread model: thread-safe; one lock guards the tables, and nothing blocks under it
(channels are created, not connected, under it; links are closed outside it).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from .._errors import CancelledError, ResourceExhaustedError, UnavailableError
from .._hostaddr import split_host_port
from .link import Link
from .security import TLSConfig

__all__ = ["ChannelCache"]

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


class ChannelCache:
    """The channels and links of one client in one process.

    Args:
        tls: open TLS channels (``None``: plaintext).
        metadata: the call metadata (the token) of the links' streams.
        take_acks: the acks a link's next request to a peer carries.
    """

    def __init__(
        self,
        tls: TLSConfig | None,
        metadata: Sequence[tuple[str, str]],
        take_acks: Callable[[str], list[int]],
    ) -> None:
        self._tls = tls
        self._metadata = metadata
        self._take_acks = take_acks
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False
        self._channels: dict[str, grpc.Channel] = {}
        self._links: dict[str, Link] = {}  # address -> its Exchange link
        self._no_link: set[str] = set()  # peers without Exchange (TensorFlow, older shmrdv)
        self._streams_only_peers: set[str] = set()  # peers without RecvTensorInline
        _CACHES.add(self)

    def forked(self) -> bool:
        """True in a forked child: this cache is the parent's, and is left alone for good."""
        if os.getpid() == self._pid:
            return False
        # The parent's channels and threads are not ours (gRPC's state in them is invalid
        # here), and a lock held at fork time would never be released. Keep them without
        # closing: closing would act on the parent's connections. (A child is
        # single-threaded when it starts, so no race here.)
        _log.debug("RpcClient: pid changed (fork); opening fresh channels")
        _FORKED_LEFTOVERS.append((self._channels, self._links))
        _CACHES.discard(self)
        return True

    def channel(self, address: str) -> grpc.Channel:
        """The channel to ``address``, opened now if need be.

        Raises ``InvalidArgumentError`` naming a bad address, ``CancelledError`` once
        closed, ``ResourceExhaustedError`` without descriptors, else ``UnavailableError``.
        """
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
            return channel

    def drop_channel(self, address: str, channel: Any) -> None:
        """Close ``channel`` if it is still ``address``'s (the next use opens a fresh one)."""
        with self._lock:
            current = self._channels.get(address)
            if current is None or current is not channel:
                return
            del self._channels[address]
        try:
            current.close()
        except Exception:  # pragma: no cover - closing a broken channel
            _log.debug("closing the channel to %s failed", address, exc_info=True)

    def route(self, address: str) -> tuple[grpc.Channel | None, Link | None]:
        """``address``'s open channel and link, each None if there is none."""
        with self._lock:
            return self._channels.get(address), self._links.get(address)

    def link_for(self, address: str, channel: grpc.Channel) -> Link | None:
        """The live link to ``address`` (opened now if need be); None for a peer without
        Exchange, or once closed."""
        with self._lock:
            if self._closed or address in self._no_link:
                return None
            if self._channels.get(address) is not channel:
                return None  # the channel was dropped meanwhile: the unary way, this once
            link = self._links.get(address)
            if link is None:
                link = Link(
                    address,
                    channel,
                    self._metadata,
                    lambda: self._take_acks(address),
                    self._link_ended,
                )
                self._links[address] = link
            return link

    def _link_ended(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]

    def send_on_link(self, address: str, request: bytes) -> bool:
        """Send ``request`` on ``address``'s open link; False if there is none."""
        with self._lock:
            link = self._links.get(address)
        return link is not None and link.send(request)

    def remember_no_link(self, address: str) -> None:
        with self._lock:
            self._no_link.add(address)

    def streams_only(self, address: str) -> bool:
        return address in self._streams_only_peers

    def remember_streams_only(self, address: str) -> None:
        with self._lock:
            self._streams_only_peers.add(address)

    def close_idle_links(self) -> None:
        """Before a fork: end the links no receive waits on, and join their threads.

        A fork while a thread of ours is inside gRPC leaves the child's gRPC broken; an
        idle client must fork as cleanly as one without links. The next receive opens a
        new link. (Links with receives pending stay: forking now is the caller's risk.)
        """
        if os.getpid() != self._pid:
            return
        with self._lock:
            idle = [link for link in self._links.values() if not link.pending]
        for link in idle:
            link.close()

    def close(self) -> tuple[dict[str, grpc.Channel], list[Link]]:
        """Stop opening channels and links; the open ones, for the caller to close."""
        with self._lock:
            self._closed = True
            channels, self._channels = dict(self._channels), {}
            links, self._links = list(self._links.values()), {}
        return channels, links

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"channels": len(self._channels), "links": len(self._links)}


# Live caches, for the fork hook (their idle links end before a fork).
_CACHES: weakref.WeakSet[ChannelCache] = weakref.WeakSet()


def _before_fork() -> None:
    for cache in list(_CACHES):
        try:
            cache.close_idle_links()
        except Exception:  # pragma: no cover - never fail a fork
            _log.debug("closing idle links before fork failed", exc_info=True)


os.register_at_fork(before=_before_fork)


# Channels inherited by forked children, kept referenced so that their finalizers never
# run in the child (they would act on the parent's gRPC state).
_FORKED_LEFTOVERS: list[Any] = []
