"""The cross-host transport: TensorFlow's pull model over gRPC.

``GrpcTransport`` composes the two halves and is neither:

* producer: ``outbox.Outbox`` buffers what this worker sends to consumers on other hosts,
  and ``server.RpcServer`` answers their ``RecvTensor`` calls from it;
* consumer: ``client.RpcClient`` pulls the next value of a key from its producer's
  address (``TransportContext.peers``: the cluster's, else the producer's presence
  record), one ``RecvTensor`` per receive.

Implements ``Transport`` (``_transport.py``) and nothing else: it is given a
``TransportContext``, never the Worker.

Thread model (docs/threads.md): the server runs its own event loop thread. A blocked
receiver (``blocking=True``) makes its RecvTensor call in its own thread and waits on it
in ``wait``; other receives are answered through gRPC's future callbacks. ``done``
callbacks never run under a lock of ours.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from .._errors import RendezvousError, UnavailableError, closed_error, code_for_error
from .._keys import ParsedKey
from .._rendezvous import Canceller, DoneCallback, RecvSlot
from .._transport import PeerRecord, TransportContext
from .client import RpcClient
from .limits import ServerLimits
from .outbox import Outbox
from .series_client import SeriesClient
from .server import RpcServer

if TYPE_CHECKING:
    from .security import TLSConfig

__all__ = ["GrpcTransport"]

# How long a producer's address, once looked up, is used without looking again: a
# presence lookup costs a stat and a lock per receive. A restarted producer's new address
# is found within this time (a receive's UNAVAILABLE retries look again).
_ADDRESS_TTL = 1.0
# How long close() lets calls already sending a value finish (bug 3b of i19).
_CLOSE_GRACE = 1.0
# How long explain_wait waits for a peer's GetStatus. A peer with nothing listening
# answers at once (connection refused, or the channel's last failure); only a host that
# drops packets makes the probe wait this long, on a receive that already timed out.
_PROBE_TIMEOUT = 0.25
# Receives counted per (step, key) to find the keys that carry a series, and producers'
# addresses kept.
_COUNTS_KEPT = 4096


class GrpcTransport:
    """gRPC transport of one Worker.

    ``bind``: the address to serve on (``host:port``; port 0 picks one), or None for a
    client only (this worker receives from other hosts but nobody pulls from it).
    ``limits``: the server's connection and call bounds (``ServerLimits``; default ones).
    """

    name = "grpc"

    def __init__(
        self,
        ctx: TransportContext,
        bind: str | None,
        *,
        tls: TLSConfig | None,
        token: str | None,
        limits: ServerLimits | None = None,
    ) -> None:
        self._ctx = ctx
        self.task: str = ctx.task_name
        self._outbox = Outbox(ctx)
        self._client = RpcClient(tls=tls, token=token)
        self._series = SeriesClient(
            channel=self._client.channel,
            metadata=self._client.metadata,
            busy=self._client.own_calls.busy,
            fallback=self._fallback,
        )
        self._server: RpcServer | None = None
        self.address: str | None = None
        self._closed = False
        # The producer's address by the key's source device: (address, good until).
        self._addresses: dict[str, tuple[str, float]] = {}
        self._counts: dict[tuple[int, str], int] = {}  # receives per (step, full key)
        if bind is not None:
            self._server = RpcServer(
                bind, self._outbox, tls=tls, token=token, limits=limits
            ).start()
            self.address = self._server.address

    def __repr__(self) -> str:
        return f"<GrpcTransport {self.task} address={self.address} closed={self._closed}>"

    def can_reach(self, peer: PeerRecord) -> bool:
        """Any host: a peer not yet known gets its address once it publishes it."""
        return True

    def explain_wait(self, peer: PeerRecord) -> str | None:
        """None if ``peer``'s server answers a GetStatus within ``_PROBE_TIMEOUT``; else
        its address and the gRPC status the probe got (issue 19 §4: "nothing listening"
        used to read as "not alive anywhere on this host")."""
        address = peer.address
        if address is None:
            return None  # not started: its presence record will carry its address
        try:
            self._client.get_status(address, timeout=_PROBE_TIMEOUT)
        except RendezvousError as e:
            return (
                f"the gRPC server of {peer.task} at {address} does not answer: "
                f"{code_for_error(e).name}: {e}"
            )
        return None

    # -- producer side --------------------------------------------------------------

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        return self._outbox.allocate(key, shape, dtype)

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None,
    ) -> None:
        self._outbox.send(step_id, key, value, is_dead, timeout)

    # -- consumer side --------------------------------------------------------------

    def start_recv(
        self,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller:
        """Pull the next value of ``key`` (always a private, writable array: ``copy`` is
        moot). ``blocking``: the caller then calls ``wait`` until ``done`` has run.

        A (step, key) received a second time, or a key that had a series, goes to its
        series (``SeriesClient``); every other receive is one ``RecvTensor`` call: a
        blocked receiver's own (``OwnCalls``, started here), else ``RpcClient``'s."""
        if self._closed:
            raise closed_error(self.task)
        k = (step_id, key.full_key)
        counts = self._counts
        n = counts.get(k, 0) + 1
        if n == 1 and len(counts) >= _COUNTS_KEPT:
            counts.clear()  # a bound, not an LRU: the counts only pick the method
        counts[k] = n
        if n > 1 or key.full_key in self._series.keys:
            canceller = self._series.start_recv(
                step_id, key, done, lambda: self._address(key), blocking=blocking
            )
            if canceller is not None:
                return canceller
        known = self._addresses.get(key.src_device)
        address = known[0] if known is not None and time.monotonic() < known[1] else None
        if blocking:  # the receiving thread's own call, started here directly
            own = self._client.own_calls.start(
                lambda: self._address(key), address, step_id, key, done
            )
            if own is not None:
                return own
        return self._client.start_recv(
            lambda: self._address(key), step_id, key, done, blocking=blocking, known=address
        )

    def _fallback(self, step_id: int, key: ParsedKey, done: DoneCallback) -> Canceller:
        """A receive its key's series could not serve goes by RecvTensor."""
        return self._client.start_recv(lambda: self._address(key), step_id, key, done)

    def wait(self, slot: RecvSlot, timeout: float) -> None:
        """Wait on the blocked receiver's own call (decoding its answer here), else on
        its slot."""
        own = self._client.own_calls.by_done.get(slot.done)
        if own is None:
            slot.wait(timeout)
        else:
            own.wait(timeout)

    def _address(self, key: ParsedKey) -> str:
        """The producer's gRPC address: the cluster's, else its presence record's (looked
        up again after ``_ADDRESS_TTL``)."""
        now = time.monotonic()
        known = self._addresses.get(key.src_device)
        if known is not None and now < known[1]:
            return known[0]
        address = self._ctx.peers.lookup(key.src).address
        if address is None:
            raise UnavailableError(
                f"no address known for task {key.src} for key {key.full_key!r}: not in the "
                "cluster spec and not running here"
            )
        if len(self._addresses) >= _COUNTS_KEPT:
            self._addresses.clear()
        self._addresses[key.src_device] = (address, now + _ADDRESS_TTL)
        return address

    # -- steps and lifetime -----------------------------------------------------------

    def abort_step(self, step_id: int, error: BaseException) -> None:
        self._outbox.abort_step(step_id, error)
        self._series.abort_step(step_id, error)
        self._client.abort_step(step_id, error)

    def cleanup_step(self, step_id: int) -> None:
        for k in [k for k in list(self._counts) if k[0] == step_id]:
            self._counts.pop(k, None)
        self._outbox.cleanup_step(step_id)
        self._series.cleanup_step(step_id)
        self._client.cleanup_step(step_id)
        if self._server is not None:
            self._server.drop_step(step_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            # First the server: calls waiting for a value fail at once with UNAVAILABLE
            # ("stopping": their consumers fail too, naming this worker); calls already
            # sending one may finish, bounded (bug 3b of issue 19).
            self._server.stop(_CLOSE_GRACE)
        self._outbox.close()
        self._series.close(closed_error(self.task))
        self._client.close(closed_error(self.task))
        # grpcio's objects stay in reference cycles of their own (the aio server with its
        # handlers' call states). Collected later in a child forked meanwhile, the aio
        # server's finalizer joins grpcio's poller thread, which the child has not got, and
        # spins there for good (a fork child's Worker hung in its first allocation that
        # ran the collector). So they go now, in this process.
        gc.collect()

    def stats(self) -> dict[str, int]:
        out = self._outbox.stats()
        client = self._client.stats()
        series = self._series.stats()
        out["received"] = client["received"] + series["received"]
        out["received_bytes"] = client["received_bytes"] + series["received_bytes"]
        out["receives_pending"] = client["inflight"]
        out["series"] = series["series"]
        out["series_held_bytes"] = series["series_held_bytes"]
        out["series_held_peak"] = series["series_held_peak"]
        out["series_held_values"] = series["series_held_values"]
        if self._server is not None:
            out.update({f"server_{k}": v for k, v in self._server.stats().items()})
        return out
