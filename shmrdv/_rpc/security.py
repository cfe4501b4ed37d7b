"""Who may talk to a shmrdv gRPC server: TLS credentials and the shared bearer token.

Two independent options (DESIGN.md "TLS and a shared token are options"):

* ``TLSConfig``: a server certificate (and optionally a client certificate checked by
  the server, mutual TLS), built into gRPC credentials. Without it the server listens
  in plaintext, which is why ``RpcServer`` binds loopback unless told otherwise
  (research/pitfalls.md §7).
* a token: every call carries ``authorization: Bearer <token>`` metadata; the server's
  ``TokenInterceptor`` refuses any other call with ``UNAUTHENTICATED`` as soon as its
  headers arrive, before a handler runs and without waiting for a request message. The comparison is constant-time (``hmac.compare_digest``). A token over
  plaintext only keeps out peers that do not know it; anyone on the path can read it,
  so use it with TLS across hosts.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from .._errors import InvalidArgumentError

__all__ = [
    "TLSConfig",
    "TokenInterceptor",
    "UNAUTHENTICATED_MESSAGE",
    "bearer_metadata",
    "check_token",
    "token_matches",
]

_AUTH_HEADER = "authorization"
_BEARER = "Bearer "
UNAUTHENTICATED_MESSAGE = "missing or wrong shmrdv token"


@dataclasses.dataclass(frozen=True, repr=False)
class TLSConfig:
    """TLS material of one side of a connection, as PEM bytes.

    On a server: ``cert_chain`` and ``private_key`` are the server's certificate and key
    (required); ``root_certificates`` is the CA that signed client certificates, needed
    when ``require_client_auth`` is set (mutual TLS).

    On a client: ``root_certificates`` is the CA that signed the server's certificate
    (``None``: the system's default roots); ``cert_chain`` and ``private_key`` are the
    client's own certificate and key, for servers that require one.

    ``server_name_override`` makes a client accept a server certificate issued for that
    name instead of the host it dials (for tests; gRPC's ``ssl_target_name_override``).
    ``repr`` shows sizes, never key material.
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

        return (
            f"TLSConfig(cert_chain={pem(self.cert_chain)}, "
            f"private_key={'None' if self.private_key is None else '<hidden>'}, "
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
        """Read the PEM files; raise ``InvalidArgumentError`` naming a file that cannot be read."""
        return cls(
            cert_chain=_read_pem(cert, "certificate"),
            private_key=_read_pem(key, "private key"),
            root_certificates=_read_pem(ca, "CA certificate"),
            require_client_auth=require_client_auth,
            server_name_override=server_name_override,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials; raise ``InvalidArgumentError`` without cert and key."""
        if self.cert_chain is None or self.private_key is None:
            raise InvalidArgumentError("a TLS server needs cert_chain and private_key")
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.root_certificates,
            require_client_auth=self.require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials for a client (with its certificate when one is set)."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """Extra channel options a client needs (the name override, if any)."""
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


def check_token(token: str | None) -> str | None:
    """Validate a token: ``None``, or a non-empty str that gRPC metadata can carry.

    Metadata values must be printable ASCII; whitespace at the ends would be stripped
    by some proxies, so it is refused too. Raises ``InvalidArgumentError``.
    """
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
    """The call metadata that carries ``token`` (empty without a token)."""
    if token is None:
        return ()
    return ((_AUTH_HEADER, _BEARER + token),)


def token_matches(metadata: Sequence[tuple[str, Any]] | None, token: str) -> bool:
    """True when ``metadata`` carries exactly ``Bearer <token>`` (constant-time compare)."""
    expected = (_BEARER + token).encode()
    found = False
    for name, value in metadata or ():
        if name != _AUTH_HEADER:
            continue
        got = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        # Compare every authorization header, so timing reveals nothing about which matched.
        found = hmac.compare_digest(got, expected) or found
    return found


# The refusing handlers take a request *stream* and never read it: gRPC runs them as soon
# as the call's headers arrive. A unary-request handler would run only once the request
# message arrived, and a client that never sends one would never be refused (issue 19 §4).
async def _refuse_unary(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


async def _refuse_stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield b""  # pragma: no cover - makes this an async generator, as the method expects


_REFUSE_UNARY = grpc.stream_unary_rpc_method_handler(_refuse_unary)
_REFUSE_STREAM = grpc.stream_stream_rpc_method_handler(_refuse_stream)


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuse every call without ``authorization: Bearer <token>`` with ``UNAUTHENTICATED``.

    Runs when the call's headers arrive, before any handler and without waiting for the
    request message, so an unauthenticated call never touches a rendezvous and cannot
    linger by keeping silent. The refusal answers in the shape the method's client
    expects (one response or a stream).
    """

    def __init__(self, token: str) -> None:
        checked = check_token(token)
        assert checked is not None
        self._token = checked

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or token_matches(handler_call_details.invocation_metadata, self._token):
            return handler
        return _REFUSE_STREAM if handler.response_streaming else _REFUSE_UNARY
