"""GrpcTransport: a Worker's cross-host transport, TensorFlow's pull model over gRPC.

It composes the producer's ``Outbox`` and ``RpcServer`` (when the worker serves) with
the consumer's ``RpcClient``, and implements ``Transport`` (``_transport.py``), given a
``TransportContext``. A producer's address comes from the peer directory (the cluster
spec, else its presence record on this host), cached for ``_ADDRESS_TTL``.

Thread model (docs/threads.md): any thread; a blocked receiver makes its calls in ``wait``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import (
    InvalidArgumentError,
    RendezvousError,
    UnavailableError,
    closed_error,
    code_for_error,
)
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback, RecvSlot
from .._transport import PeerRecord, TransportContext
from .client import RpcClient
from .guard import Limits, TLSConfig
from .outbox import Outbox
from .server import RpcServer

__all__ = ["GrpcTransport"]

# How long a producer's address is used before it is looked up again (a stat and a lock).
_ADDRESS_TTL = 1.0
_ADDRESSES_KEPT = 4096
# How long close() lets calls sending a value finish.
_CLOSE_GRACE = 1.0
# How long explain_wait waits for a peer's GetStatus (on a receive that timed out).
_PROBE_TIMEOUT = 0.25


class GrpcTransport:
    """The gRPC transport of one Worker; ``bind``: the address to serve on (port 0 picks
    one), or None for a client only."""

    name = "grpc"

    def __init__(
        self, ctx: TransportContext, bind: str | None, *, tls: TLSConfig | None,
        token: str | None, limits: Limits | None = None,
    ) -> None:  # fmt: skip
        self._ctx = ctx
        self.task: str = ctx.task_name
        self._outbox = Outbox(
            ctx.task_name,
            ctx.incarnation,
            cleaned_up=ctx.cleaned_up,
            peers=ctx.peers,
            max_inflight_bytes=ctx.max_inflight_bytes,
        )
        self._client = RpcClient(tls=tls, token=token)
        self._server: RpcServer | None = None
        self.address: str | None = None
        self._closed = False
        self._addresses: dict[str, tuple[str, float]] = {}  # src device -> (address, until)
        if bind is not None:
            server = RpcServer(bind, self._outbox, tls=tls, token=token, limits=limits)
            self._server = server.start()
            self.address = server.address

    def __repr__(self) -> str:
        return f"<GrpcTransport {self.task} address={self.address} closed={self._closed}>"

    def can_reach(self, peer: PeerRecord) -> bool:
        """Any host: a peer not known yet gets its address once it publishes it."""
        return True

    def explain_wait(self, peer: PeerRecord) -> str | None:
        """Why a receive from ``peer`` may wait: its server does not answer a GetStatus."""
        if peer.address is None:
            return None
        try:
            self._client.get_status(peer.address, timeout=_PROBE_TIMEOUT)
        except RendezvousError as e:
            return (
                f"the gRPC server of {peer.task} at {peer.address} does not answer: "
                f"{code_for_error(e).name}: {e}"
            )
        return None

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        try:
            return np.empty(shape, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"allocate({key.full_key!r}): bad shape {shape!r} or dtype {dtype!r}: {e}"
            ) from e

    def send(
        self, step_id: int, key: ParsedKey, value: npt.NDArray[Any], is_dead: bool,
        timeout: float | None,
    ) -> None:  # fmt: skip
        self._outbox.send(step_id, key, value, is_dead, timeout)

    def start_recv(
        self, step_id: int, key: ParsedKey, done: DoneCallback, *, copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:  # fmt: skip
        """Pull the next value of ``key`` (always a private array: ``copy`` is moot)."""
        if self._closed:
            raise closed_error(self.task)
        return self._client.start_recv(
            lambda refused: self._address(key, refused), step_id, key, done, blocking=blocking
        )

    def wait(self, slot: RecvSlot, timeout: float) -> None:
        if not self._client.wait(slot.done, timeout):
            slot.wait(timeout)

    def _address(self, key: ParsedKey, refused: str | None) -> str:
        now = time.monotonic()
        known = self._addresses.get(key.src_device)
        if known is not None and now < known[1] and known[0] != refused:
            return known[0]
        address = self._ctx.peers.lookup(key.src).address
        if address is None:
            raise UnavailableError(
                f"no address known yet for task {key.src} (key {key.full_key!r}): not in the "
                "cluster spec, or given port 0 there, and not running on this host"
            )
        if len(self._addresses) >= _ADDRESSES_KEPT:
            self._addresses.clear()
        self._addresses[key.src_device] = (address, now + _ADDRESS_TTL)
        return address

    def abort_step(self, step_id: int, error: BaseException) -> None:
        self._outbox.abort_step(step_id, error)
        self._client.abort_step(step_id, error)

    def cleanup_step(self, step_id: int, error: BaseException) -> None:
        self.abort_step(step_id, error)
        self._outbox.cleanup_step(step_id)
        self._client.cleanup_step(step_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            # First the server: parked calls fail at once ("is stopping": their consumers
            # fail too, naming this worker); calls sending a value may finish.
            self._server.stop(_CLOSE_GRACE)
        self._outbox.close()
        self._client.close(closed_error(self.task))
        # grpcio's objects live in reference cycles of their own; collected later in a
        # forked child, the aio server's finalizer would wait there for a thread the
        # child has not got. So they go now.
        gc.collect()

    def stats(self) -> dict[str, int]:
        out = self._outbox.stats()
        out.update(self._client.stats())
        if self._server is not None:
            out.update({f"server_{k}": v for k, v in self._server.stats().items()})
        return out
