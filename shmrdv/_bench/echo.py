"""The echo peer of ``shmrdv serve``: every array another host sends it comes back.

What ``shmrdv bench --peer HOST:PORT`` measures against from another machine, as iperf's
client measures against ``iperf -s``. Two parts:

* ``EchoLoop(worker, peers)``: for each peer task, a thread that receives the arrays the
  peer sends on the key ``echo_keys(...)[0]`` (step ``STEP``, a FIFO channel) and sends
  each back on ``echo_keys(...)[1]``, as it came (dtype, shape, ``is_dead``). ``shmrdv serve
  --task T --cluster JSON`` runs one for every other task of the cluster.
* ``EchoService(listen, token=...)``: ``shmrdv serve --listen HOST:PORT``. A small grpcio
  service on ``listen`` opens one *session* at a time for a bench on another host (``Open``):
  a fresh ``shmrdv.Worker`` of ``ECHO_TASK`` on a free port of the listen host, forced over
  gRPC, in a cluster with the caller's Worker (``BENCH_TASK`` at the caller's address and
  the port it names), with an ``EchoLoop``. ``Close`` ends it; so does ``IDLE_S`` seconds
  without an echo, or another bench's ``Open`` once it has echoed nothing for ``BUSY_S``
  seconds (before that, ``RESOURCE_EXHAUSTED``: busy). ``Raw`` answers the request's bytes
  with the same bytes: the raw grpcio round trip the bench compares with.

With a token (``SHMRDV_TOKEN``, as the Workers use it), every call must carry it
(``authorization: Bearer``); the session's Workers check it too. Messages are JSON or raw
bytes (identity serializers); a message over ``MAX_MESSAGE`` is refused by gRPC.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._rendezvous import Closing
from .common import GRPC_OPTIONS

__all__ = [
    "BENCH_TASK",
    "BUSY_S",
    "CLOSE_METHOD",
    "ECHO_TASK",
    "IDLE_S",
    "MAX_MESSAGE",
    "OPEN_METHOD",
    "RAW_METHOD",
    "STEP",
    "EchoLoop",
    "EchoService",
    "echo_keys",
    "peer_host",
]

_log = logging.getLogger("shmrdv.bench.echo")

ECHO_TASK = "/job:echo/replica:0/task:0"
BENCH_TASK = "/job:bench/replica:0/task:0"
STEP = 0
ECHO_EDGE = "shmrdv_echo"
BACK_EDGE = "shmrdv_echo_back"
OPEN_METHOD = "/shmrdv.bench.Echo/Open"
CLOSE_METHOD = "/shmrdv.bench.Echo/Close"
RAW_METHOD = "/shmrdv.bench.Echo/Raw"
MAX_MESSAGE = (256 << 20) + (64 << 10)  # the largest --peer size, 256 MiB, and its framing
IDLE_S = 120.0  # a session with no echo for this long is closed
BUSY_S = 5.0  # a session idle for this long gives way to the next bench's Open
_JOIN_S = 10.0  # an echo thread ends this soon after close() aborted its receive
_BACKOFF_S = 0.5  # after a failed receive (the peer is not up, or gone)


def echo_keys(echo_task: str, peer_task: str) -> tuple[str, str]:
    """(the key ``peer_task`` sends to the echo on, the key the echo sends back on)."""
    import shmrdv

    echo, peer = echo_task + "/device:CPU:0", peer_task + "/device:CPU:0"
    return (
        shmrdv.create_key(peer, 0, echo, ECHO_EDGE),
        shmrdv.create_key(echo, 0, peer, BACK_EDGE),
    )


class EchoLoop(Closing):
    """Threads that echo what each peer task sends ``worker`` (see the module docstring).

    Each thread blocks in ``recv`` (no polling); ``close()`` aborts the worker's step
    ``STEP`` (``start_abort``: the loop owns that step), which ends every receive at once,
    and joins the threads. The Worker stays open: its owner closes it. ``echoed`` counts
    the arrays sent back; ``last_echo`` is the ``time.monotonic()`` of the last one (or of
    the start)."""

    def __init__(self, worker: Any, peers: Iterable[str]) -> None:
        self._worker = worker
        self._rdv = worker.rendezvous(STEP)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.echoed = 0
        self.last_echo = time.monotonic()
        self._threads = [
            threading.Thread(target=self._run, args=(peer,), name=f"shmrdv-echo-{i}", daemon=True)
            for i, peer in enumerate(peers)
        ]
        for t in self._threads:
            t.start()

    def _run(self, peer: str) -> None:
        from .._errors import RendezvousError

        key_in, key_out = echo_keys(self._worker.task, peer)
        while not self._stop.is_set():
            try:
                got = self._rdv.recv(key_in)
                self._rdv.send(key_out, got.value, is_dead=got.is_dead)
            except RendezvousError as e:
                if self._stop.is_set():
                    return
                _log.debug("echo of %s: %s", peer, e)
                self._stop.wait(_BACKOFF_S)
                continue
            del got
            with self._lock:
                self.echoed += 1
                self.last_echo = time.monotonic()

    def close(self) -> None:
        """Stop echoing (idempotent): abort the loop's step, join the threads."""
        from .._errors import CancelledError

        self._stop.set()
        self._rdv.start_abort(CancelledError("the echo loop is closed"))
        for t in self._threads:
            t.join(_JOIN_S)


def peer_host(peer: str) -> str:
    """The host of a grpcio ``context.peer()`` (``ipv4:10.0.0.2:5678``, ``ipv6:[::1]:5678``),
    as a cluster address spells it (``10.0.0.2``, ``[::1]``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        raise ValueError(f"not a TCP peer: {peer!r}")
    host = rest.rpartition(":")[0]
    return host if kind == "ipv4" or host.startswith("[") else f"[{host}]"


class _Session:
    """One bench's Worker pair, the echo side: a Worker of ``ECHO_TASK`` and its loop."""

    def __init__(self, bind_host: str, bench_address: str, token: str | None) -> None:
        import shmrdv

        self.bench = bench_address
        cluster = {"echo": [f"{bind_host}:0"], "bench": [bench_address]}
        self.worker = shmrdv.Worker(
            ECHO_TASK,
            cluster=cluster,
            namespace=shmrdv.new_namespace(),
            transports=("grpc",),
            token=token,
        )
        try:
            self.loop = EchoLoop(self.worker, [BENCH_TASK])
        except BaseException:
            self.worker.close()
            raise
        assert self.worker.address is not None  # a forced gRPC Worker has a server
        self.port = int(self.worker.address.rpartition(":")[2])

    def idle_for(self) -> float:
        return time.monotonic() - self.loop.last_echo

    def close(self) -> None:
        self.loop.close()
        self.worker.close()


class EchoService(Closing):
    """``shmrdv serve --listen HOST:PORT``: the echo peer (see the module docstring).

    Starts listening at once (``address`` is where, with the real port if ``:0`` was
    given); raises ``UnavailableError`` if it cannot. ``expire_idle()`` closes an idle
    session (the CLI calls it every second); ``close()`` ends the session and the service.
    """

    def __init__(self, listen: str, *, token: str | None = None, idle_s: float = IDLE_S) -> None:
        import grpc

        from .._cluster import split_host_port
        from .._errors import UnavailableError
        from .._rpc.guard import check_token

        split_host_port(listen)  # InvalidArgumentError naming it if it is no host:port
        self._bind_host = listen.rpartition(":")[0]
        self._token = check_token(token)
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._closed = False
        self.sessions = 0
        options = [
            *[o for o in GRPC_OPTIONS if "message_length" not in o[0]],
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),  # a second echo peer on the same port fails, not shares
        ]
        handlers = {
            OPEN_METHOD: self._open,
            CLOSE_METHOD: self._close_session,
            RAW_METHOD: self._raw,
        }
        service = OPEN_METHOD.strip("/").split("/")[0]
        generic = grpc.method_handlers_generic_handler(
            service,
            {
                path.rpartition("/")[2]: grpc.unary_unary_rpc_method_handler(
                    fn, request_deserializer=None, response_serializer=None
                )
                for path, fn in handlers.items()
            },
        )
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=4, thread_name_prefix="shmrdv-echo-rpc"),
            options=options,
            maximum_concurrent_rpcs=4,  # a bench makes one call at a time
        )
        self._server.add_generic_rpc_handlers((generic,))
        try:
            port = self._server.add_insecure_port(listen)
        except RuntimeError as e:
            raise UnavailableError(f"shmrdv serve cannot listen on {listen}: {e}") from e
        if port == 0:
            raise UnavailableError(f"shmrdv serve cannot listen on {listen} (in use?)")
        self.address = f"{self._bind_host}:{port}"
        self._server.start()
        # The backstop if the service is dropped unclosed: stop listening (the session's
        # Worker has its own).
        self._finalizer = weakref.finalize(self, self._server.stop, None)

    def __repr__(self) -> str:
        with self._lock:
            session = "no session" if self._session is None else f"session of {self._session.bench}"
        return f"<EchoService on {self.address}, {session}, {self.sessions} so far>"

    def _check(self, context: Any) -> None:
        import grpc

        from .._rpc.guard import UNAUTHENTICATED_MESSAGE, token_matches

        if self._token is not None and not token_matches(
            context.invocation_metadata(), self._token
        ):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    def _open(self, request: bytes, context: Any) -> bytes:
        import grpc

        self._check(context)
        try:
            asked = json.loads(request)
            port = int(asked["port"])
            if not 0 < port < 65536:
                raise ValueError(f"port {port} is out of range")
            host = peer_host(context.peer())
        except (ValueError, KeyError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Open: {e}")
        # One lock over the whole open, close and expiry: sessions are rare, and two
        # Opens at once must not both start a Worker.
        with self._lock:
            if self._closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the echo peer is closing")
            old = self._session
            if old is not None and old.idle_for() < BUSY_S:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"busy: a bench at {old.bench} is measuring (one at a time)",
                )
            self._session = None
            if old is not None:
                old.close()
            session = _Session(self._bind_host, f"{host}:{port}", self._token)
            self._session = session
            self.sessions += 1
        _log.info("echo session for %s on port %d", session.bench, session.port)
        return json.dumps({"port": session.port, "task": ECHO_TASK}).encode()

    def _close_session(self, request: bytes, context: Any) -> bytes:
        self._check(context)
        with self._lock:
            session, self._session = self._session, None
            if session is not None:
                session.close()
        return json.dumps({"echoed": 0 if session is None else session.loop.echoed}).encode()

    def _raw(self, request: bytes, context: Any) -> bytes:
        self._check(context)
        return request

    def expire_idle(self) -> bool:
        """Close the session if it echoed nothing for ``idle_s`` seconds; True if it did."""
        with self._lock:
            session = self._session
            if session is None or session.idle_for() < self._idle_s:
                return False
            self._session = None
            session.close()
        return True

    def close(self) -> None:
        """End the session, then stop listening (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            session, self._session = self._session, None
            if session is not None:
                session.close()
        self._finalizer.detach()
        self._server.stop(grace=1.0).wait(5.0)
