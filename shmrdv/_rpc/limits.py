"""ServerLimits: how many connections and calls a gRPC server takes, and how long a call
may keep silent.

Hostile or broken clients must not exhaust a server, whether they hold a token or not
(issue 19 §4): 1,100 connections whose calls never sent a request message once held a
server at its 1,024-descriptor limit, so that a legitimate ``GetStatus`` timed out and the
shared-memory sends of the same process failed with "too many open files". The bounds:

* ``max_connections``: connections beyond it are refused (gRPC closes them at accept).
  Default: a quarter of this process's descriptor limit (``ulimit -n``), at most 1,024,
  so connections can never take the descriptors everything else in the process needs.
  At most half of the limit may be asked for.
* ``max_concurrent_rpcs``: calls in flight beyond it are refused (``RESOURCE_EXHAUSTED``).
* ``first_message_timeout``: a call that has not sent its request message this many
  seconds after opening is dropped (``UNAVAILABLE``); at most ``max_awaiting_request``
  calls (a quarter of ``max_concurrent_rpcs``, at most 1,024) may wait for their message
  longer than a second, the oldest beyond them are dropped (``request_gate.RequestGate``).

Pure: no gRPC import, so a ``Worker`` validates these without loading gRPC.
"""

from __future__ import annotations

import dataclasses
import resource

from .._errors import InvalidArgumentError

__all__ = [
    "DEFAULT_FIRST_MESSAGE_TIMEOUT",
    "DEFAULT_MAX_CONCURRENT_RPCS",
    "ServerLimits",
    "descriptor_limit",
]

_DEFAULT_MAX_CONNECTIONS = 1024
# Calls waiting for a value are calls in flight too: as many as one peer may park
# (``RpcServer(max_waiting_per_peer=)``).
DEFAULT_MAX_CONCURRENT_RPCS = 16_384
# A real client sends its request right behind its headers (one write); 5 s leaves room
# for a loaded machine and is short next to the flood it stops.
DEFAULT_FIRST_MESSAGE_TIMEOUT = 5.0
_MAX_AWAITING_REQUEST = 1024
# A process whose limit is "unlimited" is treated as having this many descriptors.
_UNLIMITED = 1 << 20


def descriptor_limit() -> int:
    """This process's soft limit on open file descriptors (``ulimit -n``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED if soft == resource.RLIM_INFINITY or soft > _UNLIMITED else int(soft)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, not {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The connection and call bounds of one gRPC server (see the module docstring).

    ``max_connections=None`` picks the default from the descriptor limit when the server
    starts (``connections()``). Bad values raise ``InvalidArgumentError`` naming them.
    """

    max_connections: int | None = None
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    first_message_timeout: float = DEFAULT_FIRST_MESSAGE_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_connections is not None:
            wanted = _positive_int("max_connections", self.max_connections)
            limit = descriptor_limit()
            if wanted > limit // 2:
                raise InvalidArgumentError(
                    f"max_connections={wanted} would let connections take most of this "
                    f"process's {limit} file descriptors (ulimit -n): ask for at most "
                    f"{limit // 2}, or raise the limit"
                )
        _positive_int("max_concurrent_rpcs", self.max_concurrent_rpcs)
        t = self.first_message_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise InvalidArgumentError(
                f"first_message_timeout must be seconds in (0, 3600], not {t!r}"
            )

    def connections(self) -> int:
        """``max_connections``, or the default for this process's descriptor limit."""
        if self.max_connections is not None:
            return self.max_connections
        return max(1, min(_DEFAULT_MAX_CONNECTIONS, descriptor_limit() // 4))

    @property
    def max_awaiting_request(self) -> int:
        """Most calls that may wait longer than a second for their request message."""
        return max(1, min(_MAX_AWAITING_REQUEST, self.max_concurrent_rpcs // 4))
