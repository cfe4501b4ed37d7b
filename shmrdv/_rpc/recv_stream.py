"""A receive's stream phase: ``RecvTensorStream`` of a value too large to come inline.

When ``RecvTensor`` answered empty bytes (the value is larger than the client's
``inline_max``), the value waits in the server's response cache under the receive's
request_id, and ``run`` fetches it with ``RecvTensorStream`` under the same request_id
(a cache hit), assembled into one array (``assembly.StreamAssembler``). A connection
lost mid-stream is retried twice (the server still caches the value), then fails with
``UnavailableError``; no partial array is ever delivered. Once every byte is here the
server's cached copy is released (``MarkRecvFinished``).

What it uses of its receive is declared in ``StreamOwner`` (``call.Recv`` is one).

Thread model (docs/threads.md): ``run`` is the whole of a thread of its own
("shmrdv-rpc-recv", started by ``call.Recv``); it delivers the value from there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from .._errors import InternalError, RendezvousError, UnavailableError
from .._rendezvous import Received
from . import assembly
from .acks import notify
from .methods import RECV_TENSOR_STREAM_METHOD
from .rpc_errors import error_code, error_details

__all__ = ["StreamOwner", "run"]

_log = logging.getLogger("shmrdv.rpc.client")

_MID_STREAM_RETRIES = 2


class StreamOwner(Protocol):
    """The receive a stream belongs to (``call.Recv``)."""

    @property
    def ended(self) -> bool:
        """Delivered, failed or cancelled: nothing more to do."""

    @property
    def receiving(self) -> bool:
        """Data is flowing (``begin_receiving`` said so)."""

    @property
    def address(self) -> str: ...

    def where(self) -> str: ...

    def open_stream(self, start: Callable[[float | None], Any]) -> Any | None:
        """``start(timeout)`` the next stream call as the receive's call in flight; None
        when the receive is over (ended, or its deadline passed: then it timed out)."""

    def begin_receiving(self) -> bool:
        """The first data came: from now on the receive cannot be cancelled (False: it
        was cancelled already)."""

    def deliver(self, error: BaseException | None, received: Received | None) -> None: ...

    def pause_unavailable(self, error: grpc.RpcError) -> None:
        """Wait out a backoff pause after a transient ``UNAVAILABLE`` (or a cancel)."""

    def out_of_files(self, error: grpc.RpcError) -> bool: ...

    def release_if_late(self, code: grpc.StatusCode) -> None: ...

    def error(self, code: grpc.StatusCode, error: grpc.RpcError) -> RendezvousError: ...


def run(
    owner: StreamOwner,
    channel: grpc.Channel,
    request: bytes,
    request_id: int,
    metadata: Sequence[tuple[str, str]],
) -> None:
    """Stream ``owner``'s value (``request`` under ``request_id``) and deliver it."""
    try:
        _attempts(owner, channel, request, request_id, metadata)
    except BaseException as e:  # a bug here must not leave the caller waiting forever
        _log.exception("RecvTensorStream of %s failed unexpectedly", owner.where())
        owner.deliver(UnavailableError(f"receiving {owner.where()} failed: {e!r}"), None)


def _attempts(
    owner: StreamOwner,
    channel: grpc.Channel,
    request: bytes,
    request_id: int,
    metadata: Sequence[tuple[str, str]],
) -> None:
    method = channel.unary_stream(RECV_TENSOR_STREAM_METHOD)
    mid_stream_failures = 0
    while True:
        call = owner.open_stream(
            lambda timeout: method(request, timeout=timeout, metadata=metadata)
        )
        if call is None:
            return
        assembler = assembly.StreamAssembler()
        delivered = False
        try:
            for message in call:
                if not owner.receiving and not owner.begin_receiving():
                    call.cancel()
                    return
                assembler.feed(message)
                if assembler.complete and not delivered:
                    # Every byte is here: hand it over now rather than after the call's
                    # closing status (one more loopback round); the stream is then
                    # drained, never cancelled (the server would take a cancel after
                    # its last chunk for a value not delivered).
                    delivered = True
                    owner.deliver(None, Received(assembler.result(), assembler.is_dead))
            received = Received(assembler.result(), assembler.is_dead)
        except grpc.RpcError as e:
            if delivered or owner.ended or owner.out_of_files(e):
                return
            code = error_code(e)
            if code == grpc.StatusCode.UNAVAILABLE:
                if owner.receiving:
                    mid_stream_failures += 1
                    if mid_stream_failures > _MID_STREAM_RETRIES:
                        owner.deliver(
                            UnavailableError(
                                f"lost the connection while receiving {owner.where()}; "
                                f"retried {_MID_STREAM_RETRIES} times: {error_details(e)}"
                            ),
                            None,
                        )
                        return
                owner.pause_unavailable(e)
                continue
            owner.release_if_late(code)
            owner.deliver(owner.error(code, e), None)
            return
        except RendezvousError as e:  # the assembler refused what arrived
            call.cancel()
            owner.deliver(
                InternalError(
                    f"bad RecvTensorStream from {owner.address} for {owner.where()}: {e}"
                ),
                None,
            )
            return
        if not delivered:
            owner.deliver(None, received)
        # A large value: release the server's cached copy now, not at the next request.
        notify(channel, request_id, metadata)
        return
