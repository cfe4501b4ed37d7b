"""A series consumer's acks: ``RecvTensorSeriesAck`` calls, one at a time.

The producer of a resumable series keeps what it sent until its consumer acknowledges
it, and asks for an ack with a message of its own (``series_wire.ASK``). ``SeriesAcks``
answers each ask with one unary call saying how many values the series holds (the
request comes from the series, read when the call is made): one call at a time; an ask
that comes while one is in flight is answered when it returns, with the count then. A
failed ack (a dropped connection) is not repeated: the series' re-open says the same.

Thread model (docs/threads.md): ``ask`` comes from the series' reader thread; the next
call goes from the previous one's done callback (gRPC's thread); one lock guards the
state, and no call is made under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from .methods import RECV_TENSOR_SERIES_ACK_METHOD

__all__ = ["SeriesAcks"]

_ACK_TIMEOUT = 5.0


class SeriesAcks:
    """The acks of one series on ``channel``; ``request()`` gives the next one's bytes."""

    def __init__(
        self,
        channel: grpc.Channel,
        metadata: Sequence[tuple[str, str]],
        request: Callable[[], bytes],
    ) -> None:
        self._method = channel.unary_unary(RECV_TENSOR_SERIES_ACK_METHOD)
        self._metadata = metadata
        self._request = request
        self._lock = threading.Lock()
        self._busy = False  # an ack call in flight
        self._again = False  # asked for another meanwhile
        self._closed = False

    def ask(self) -> None:
        """The producer asked for an ack."""
        with self._lock:
            if self._closed:
                return
            if self._busy:
                self._again = True
                return
            self._busy = True
        self._send()

    def close(self) -> None:
        """No ack any more (one in flight ends on its own)."""
        with self._lock:
            self._closed = True

    def _send(self) -> None:
        try:
            fut = self._method.future(
                self._request(), timeout=_ACK_TIMEOUT, metadata=self._metadata
            )
        except (ValueError, grpc.RpcError):  # the channel was closed meanwhile
            with self._lock:
                self._busy = False
            return
        fut.add_done_callback(self._done)

    def _done(self, fut: Any) -> None:
        with self._lock:
            again = self._again and not self._closed
            self._again = False
            self._busy = again
        if again:
            self._send()
