"""Is an address this host? The fallback of the same-host probe, before a peer has started.

The probe proper is the peer's presence record in /dev/shm (``_shm/presence.py``): if
we can see it, with our boot id, the peer shares our shared memory. Until the peer has
started, the cluster address is all there is: loopback, this host's names and the
addresses of its interfaces count as "here".
"""

from __future__ import annotations

import functools
import ipaddress
import socket

from ._errors import InvalidArgumentError

__all__ = ["is_local_host", "split_host_port"]


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> (host without brackets, port).

    The one host:port parser: raises ``InvalidArgumentError`` (also a ``ValueError``)
    naming the address for anything else (no port, a port that is not 0-65535).
    """
    if not isinstance(address, str):
        raise InvalidArgumentError(
            f"an address must be a 'host:port' str, not {type(address).__name__}"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgumentError(
            f"address {address!r} is not 'host:port' (e.g. '127.0.0.1:2222', '[::1]:2222')"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


@functools.lru_cache(maxsize=1)
def _own_addresses() -> frozenset[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    addrs: set[str] = set()
    for name in names:
        try:
            for info in socket.getaddrinfo(name, None):
                addrs.add(str(info[4][0]))
        except OSError:
            continue
    # Every interface address (Linux): the kernel's local routes and the IPv6 list.
    try:
        with open("/proc/net/fib_trie", encoding="ascii") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if "/32 host LOCAL" in line and i > 0:
                addrs.add(lines[i - 1].split()[-1])
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                hexaddr = line.split()[0]
                addrs.add(str(ipaddress.IPv6Address(int(hexaddr, 16))))
    except (OSError, ValueError):
        pass
    return frozenset(a.lower() for a in names | addrs)


def is_local_host(host: str) -> bool:
    """True if ``host`` (a name or an IP) is this machine."""
    h = host.strip("[]").lower()
    if h in ("", "localhost", "0.0.0.0", "::"):
        return True
    try:
        ip = ipaddress.ip_address(h)
        if ip.is_loopback:
            return True
        return str(ip) in _own_addresses()
    except ValueError:
        pass
    if h in _own_addresses():
        return True
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(h, None)}
    except OSError:
        return False
    return any(ipaddress.ip_address(a).is_loopback or a in _own_addresses() for a in resolved)
