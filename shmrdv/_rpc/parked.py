"""ParkedCalls: the counts of calls waiting for a value, and their bounds.

A call whose value is not there yet parks at the server (``waits``); hostile or broken
clients must not park without bound (issues 12 §4, 19 §4). Calls are counted in all, per
peer host (one host opening many connections is one peer) and per connection; beyond a
bound, ``refusal`` says why the call is refused (``RESOURCE_EXHAUSTED``). A call whose
value is already there never parks, so it is never refused.

Thread model (``docs/threads.md``): none of its own; it belongs to the server's event loop
(no lock).
"""

from __future__ import annotations

__all__ = ["ParkedCalls", "peer_host"]


def peer_host(peer: str) -> str:
    """A call's peer without its port ("ipv4:10.0.0.1:5123" -> "ipv4:10.0.0.1"): the
    unit the per-host bound counts (one host opening many connections is one peer)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class ParkedCalls:
    """Counts of calls waiting for a value: in all, per peer host, per connection."""

    def __init__(
        self,
        total: int,
        per_host: int,
        per_connection: int,
        *,
        what: str = "calls waiting for values",
        option: str = "max_waiting",
    ) -> None:
        self.bounds = (total, per_host, per_connection)
        self.total = 0
        self._by: dict[str, int] = {}
        self._what = what  # what is counted, and the options that bound it (the refusals)
        self._option = option

    def refusal(self, peer: str) -> str | None:
        """Why one more call from ``peer`` may not wait (None: it may)."""
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
