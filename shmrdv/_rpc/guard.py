"""Who may talk to a gRPC server, and how much anyone may make it hold.

* ``TLSConfig``: TLS credentials (mutual TLS with a client CA).
* ``Gate``, passed first by every call: the bearer token (``UNAUTHENTICATED`` with
  the headers; constant-time), then its request message soon, or it is dropped
  (``UNAVAILABLE``; grpc.aio would wait for a unary request forever).
* ``Limits``: every bound, the hostile-client ones too: connections, calls in flight
  and parked (in all, per peer host, per connection: ``Parked``) and for how long, the
  response cache, series open and their bytes ahead of acks (the window: ``_window``).

Thread model (docs/threads.md): ``Gate`` and ``Parked`` run on the server's loop;
``TLSConfig`` and ``Limits`` are frozen values.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os
import resource
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._errors import InvalidArgumentError, code_for_error

__all__ = [
    "DEFAULT_FIRST_MESSAGE_TIMEOUT", "DEFAULT_MAX_CONCURRENT_RPCS", "UNAUTHENTICATED_MESSAGE",
    "Gate", "Limits", "Parked", "TLSConfig", "bearer_metadata", "check_token",
    "descriptor_limit", "out_of_time", "refuse", "token_matches",
]  # fmt: skip

UNAUTHENTICATED_MESSAGE = "missing or wrong shmrdv token"
_AUTH_HEADER = "authorization"
_BEARER = "Bearer "


# -- TLS ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class TLSConfig:
    """TLS material of one side of a connection, as PEM bytes.

    On a server: ``cert_chain`` and ``private_key`` (required); ``root_certificates`` is
    the CA of client certificates, needed with ``require_client_auth`` (mutual TLS). On a
    client: ``root_certificates`` is the CA of the server's certificate (None: the
    system's roots); ``cert_chain`` and ``private_key`` its own, for servers that require
    one. ``server_name_override`` makes a client accept a certificate issued for that name
    (for tests; gRPC's ``ssl_target_name_override``). ``repr`` never shows key material.
    """

    cert_chain: bytes | None = None
    private_key: bytes | None = None
    root_certificates: bytes | None = None
    require_client_auth: bool = False
    server_name_override: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert_chain", "private_key", "root_certificates"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bytes):
                raise InvalidArgumentError(
                    f"TLSConfig.{name} must be PEM bytes or None, not {type(value).__name__}"
                )
            if isinstance(value, bytes) and b"-----BEGIN" not in value:
                raise InvalidArgumentError(f"TLSConfig.{name} does not look like PEM data")
        if (self.cert_chain is None) != (self.private_key is None):
            raise InvalidArgumentError(
                "TLSConfig needs both cert_chain and private_key, or neither"
            )
        if self.require_client_auth and self.root_certificates is None:
            raise InvalidArgumentError(
                "TLSConfig(require_client_auth=True) needs root_certificates: "
                "the CA that client certificates must be signed by"
            )
        if self.server_name_override is not None and not isinstance(self.server_name_override, str):
            raise InvalidArgumentError("TLSConfig.server_name_override must be a str or None")

    def __repr__(self) -> str:
        def pem(value: bytes | None) -> str:
            return "None" if value is None else f"<{len(value)} bytes PEM>"

        key = "None" if self.private_key is None else "<hidden>"
        return (
            f"TLSConfig(cert_chain={pem(self.cert_chain)}, private_key={key}, "
            f"root_certificates={pem(self.root_certificates)}, "
            f"require_client_auth={self.require_client_auth}, "
            f"server_name_override={self.server_name_override!r})"
        )

    @classmethod
    def from_files(
        cls,
        cert: str | os.PathLike[str] | None,
        key: str | os.PathLike[str] | None,
        ca: str | os.PathLike[str] | None = None,
        *,
        require_client_auth: bool = False,
        server_name_override: str | None = None,
    ) -> TLSConfig:
        """Read the PEM files; ``InvalidArgumentError`` naming one that cannot be read."""
        return cls(
            cert_chain=_read_pem(cert, "certificate"),
            private_key=_read_pem(key, "private key"),
            root_certificates=_read_pem(ca, "CA certificate"),
            require_client_auth=require_client_auth,
            server_name_override=server_name_override,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_chain is None or self.private_key is None:
            raise InvalidArgumentError("a TLS server needs cert_chain and private_key")
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.root_certificates,
            require_client_auth=self.require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.server_name_override is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name_override)]


def _read_pem(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgumentError(f"cannot read TLS {what} file {os.fspath(path)!r}: {e}") from e


# -- the token ------------------------------------------------------------------------------


def check_token(token: str | None) -> str | None:
    """``None``, or a non-empty printable ASCII str without spaces at its ends (what gRPC
    metadata carries through every proxy); else ``InvalidArgumentError``."""
    if token is None:
        return None
    if not isinstance(token, str) or not token:
        raise InvalidArgumentError("a shmrdv token must be a non-empty str (or None for no token)")
    if not token.isascii() or not token.isprintable() or token != token.strip():
        raise InvalidArgumentError(
            "a shmrdv token must be printable ASCII without leading or trailing spaces"
        )
    return token


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (empty without one)."""
    return () if token is None else ((_AUTH_HEADER, _BEARER + token),)


def token_matches(metadata: Sequence[tuple[str, Any]] | None, token: str) -> bool:
    """True when ``metadata`` carries exactly ``Bearer <token>`` (constant-time compare)."""
    expected = (_BEARER + token).encode()
    found = False
    for name, value in metadata or ():
        if name == _AUTH_HEADER:
            got = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
            found = hmac.compare_digest(got, expected) or found  # every header compared
    return found


# -- the gate -------------------------------------------------------------------------------

# How long a call may wait for its request message before it counts as silent when too
# many wait: a burst of calls is started one by one by the loop before their (arrived)
# messages are read.
_GRACE = 1.0


class _Waiting:
    __slots__ = ("crowded_at", "deadline", "task", "why")

    def __init__(self, task: asyncio.Task[Any], now: float, timeout: float) -> None:
        self.task = task
        self.deadline = now + timeout
        self.crowded_at = now + min(_GRACE, timeout)
        self.why: str | None = None


class Gate:
    """What every call passes first (``admit``): the token, then its request message
    within ``timeout`` seconds of its headers (at most ``max_waiting`` calls may wait
    over a second; the oldest beyond are dropped). The handlers take a request *stream*,
    so gRPC runs them at a call's headers: a call without the token is refused before it
    sends anything, a silent one dropped (``UNAVAILABLE``: a slow client calls again)."""

    def __init__(self, token: str | None, timeout: float, max_waiting: int) -> None:
        self._token = check_token(token)
        self._timeout = timeout
        self._max_waiting = max_waiting
        self._where = "(starting)"
        self._waiting: OrderedDict[_Waiting, None] = OrderedDict()  # oldest first
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._silent = self._crowded = 0

    def started(self, address: str) -> None:
        """The server listens on ``address``; called in the loop."""
        self._where = address
        self._loop = asyncio.get_running_loop()

    def stats(self) -> dict[str, int]:
        return {
            "awaiting_request": len(self._waiting),
            "silent_calls_dropped": self._silent,
            "crowded_calls_dropped": self._crowded,
        }

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def admit(self, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """The call's request message, once its token is checked; else the call is
        refused here (``context.abort`` raises)."""
        token = self._token
        if token is not None and not token_matches(context.invocation_metadata(), token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        loop = self._loop
        assert loop is not None
        task = asyncio.current_task(loop)
        assert task is not None
        entry = _Waiting(task, loop.time(), self._timeout)
        self._waiting[entry] = None
        if self._timer is None:
            self._arm(loop)
        elif len(self._waiting) > self._max_waiting:
            self._sweep(loop)
        try:
            message = await context.read()
        except asyncio.CancelledError:
            if entry.why is None:
                raise  # the client went away, or the server stops
            uncancel = getattr(task, "uncancel", None)  # Python >= 3.11 counts them
            if uncancel is not None:
                uncancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, entry.why)
            raise  # pragma: no cover - abort raises
        finally:
            self._waiting.pop(entry, None)
        if message is grpc.aio.EOF:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shmrdv RPC server {self._where}: the call ended without a request message",
            )
        return message  # type: ignore[no-any-return]

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """The one timer, at the oldest waiting call's next limit."""
        if not self._waiting:
            return
        oldest = next(iter(self._waiting))
        when = oldest.deadline
        if len(self._waiting) > self._max_waiting:
            when = min(when, oldest.crowded_at)
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = loop.call_at(when, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._sweep(loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        while self._waiting:
            oldest = next(iter(self._waiting))
            if oldest.deadline <= now:
                self._silent += 1
                why = (
                    f"shmrdv RPC server {self._where}: no request message within "
                    f"{self._timeout:g}s of the call's start (first_message_timeout); dropped"
                )
            elif len(self._waiting) > self._max_waiting and oldest.crowded_at <= now:
                self._crowded += 1
                why = (
                    f"shmrdv RPC server {self._where}: more than {self._max_waiting} calls "
                    f"were waiting for their request message, this one for over "
                    f"{min(_GRACE, self._timeout):g}s; dropped"
                )
            else:
                break
            del self._waiting[oldest]
            oldest.why = why
            oldest.task.cancel()
        self._arm(loop)


# -- the bounds -----------------------------------------------------------------------------

# Calls parked for a value are calls in flight too: as many as one peer may park.
DEFAULT_MAX_CONCURRENT_RPCS = 16_384
# A real client sends its request right behind its headers; 5 s leaves a loaded machine room.
DEFAULT_FIRST_MESSAGE_TIMEOUT = 5.0
_UNLIMITED_FDS = 1 << 20


def descriptor_limit() -> int:
    """This process's soft limit on open descriptors (``ulimit -n``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED_FDS if soft == resource.RLIM_INFINITY or soft > _UNLIMITED_FDS else int(soft)


def _positive(name: str, value: object, kind: type = int) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok or not 0 < value < 1e12:  # type: ignore[operator]
        what = "seconds > 0" if kind is float else "a positive int"
        raise InvalidArgumentError(f"{name} must be {what}, not {value!r}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Every bound of one gRPC server (module docstring); bad values raise
    ``InvalidArgumentError`` naming them."""

    max_connections: int | None = None  # None: 1/4 of the descriptor limit (<= 1,024)
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS  # beyond: RESOURCE_EXHAUSTED
    first_message_timeout: float = DEFAULT_FIRST_MESSAGE_TIMEOUT  # to send its request
    handshake_timeout: float = 10.0
    max_waiting: int = 65_536  # calls parked for a value (one there is never refused)
    max_waiting_per_peer: int = 32_768
    max_waiting_per_connection: int = 16_384
    max_wait: float = 300.0  # the longest park of a call without a nearer deadline
    cache_ttl: float = 30.0  # the response cache (TensorFlow's GrpcResponseCache)
    cache_entries: int = 1024
    cache_bytes: int = 256 << 20
    max_series: int = 4096  # RecvTensorSeries calls open
    max_series_per_peer: int = 1024
    max_series_per_connection: int = 256
    series_idle: float = 10.0  # a series without a value ends after this long
    max_pushed_bytes: int = 64 << 20  # pushed by a series ahead of its consumer's acks

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None or f.name != "max_connections":
                _positive(f.name, value, float if f.type == "float" else int)
        if self.first_message_timeout > 3600:
            raise InvalidArgumentError(
                f"first_message_timeout must be seconds in (0, 3600], not {self.first_message_timeout!r}"
            )
        if self.max_connections is not None and self.max_connections > descriptor_limit() // 2:
            raise InvalidArgumentError(
                f"max_connections={self.max_connections} would let connections take most of "
                f"this process's {descriptor_limit()} file descriptors (ulimit -n): ask for at "
                f"most {descriptor_limit() // 2}, or raise the limit"
            )

    def connections(self) -> int:
        """``max_connections``, or the default for this process's descriptor limit."""
        if self.max_connections is not None:
            return self.max_connections
        return max(1, min(1024, descriptor_limit() // 4))

    @property
    def max_awaiting_request(self) -> int:
        """Most calls that may wait longer than a second for their request message."""
        return max(1, min(1024, self.max_concurrent_rpcs // 4))


def peer_host(peer: str) -> str:
    """A call's peer without its port ("ipv4:10.0.0.1:5123" -> "ipv4:10.0.0.1")."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class Parked:
    """Counts of calls holding a place (parked calls, open series): in all, per peer
    host, per connection, with their bounds; ``refusal`` says why one more may not."""

    def __init__(self, bounds: tuple[int, int, int], what: str, option: str) -> None:
        self.bounds = bounds
        self.total = 0
        self._by: dict[str, int] = {}
        self._what, self._option = what, option

    def refusal(self, peer: str) -> str | None:
        total, per_host, per_connection = self.bounds
        what, option = self._what, self._option
        if self.total >= total:
            return f"{self.total} {what} already ({option}={total})"
        host = peer_host(peer)
        if self._by.get(host, 0) >= per_host:
            return f"{host} already has {self._by[host]} {what} ({option}_per_peer={per_host})"
        if host != peer and self._by.get(peer, 0) >= per_connection:
            return (
                f"connection {peer} already has {self._by[peer]} {what} "
                f"({option}_per_connection={per_connection})"
            )
        return None

    def add(self, peer: str, n: int) -> None:
        self.total += n
        host = peer_host(peer)
        for unit in (host, peer) if host != peer else (host,):
            left = self._by.get(unit, 0) + n
            if left:
                self._by[unit] = left
            else:
                del self._by[unit]


def out_of_time(parked: asyncio.Future[bool]) -> None:
    """A parked call's timer: it waited its time (False), unless settled meanwhile."""
    if not parked.done():
        parked.set_result(False)


async def refuse(context: grpc.aio.ServicerContext[Any, Any], error: BaseException) -> NoReturn:
    """End a call with ``error``'s status (``_errors.code_for_error``) and message."""
    await context.abort(code_for_error(error), str(error))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
