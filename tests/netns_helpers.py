"""Two "hosts" on one machine for the cross-host tests: network + mount namespaces.

Each host is a network namespace joined to the other by a veth pair, each end with its
own address; the processes started on a host (``host_cmd``) also get a private mount
namespace with their own tmpfs on /dev/shm, so shared memory truly cannot cross. Needs
root, iproute2 and util-linux; ``make_hosts`` skips the calling test with the reason
otherwise. Everything is deleted on exit (deleting a namespace deletes its veth end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["Hosts", "host_cmd", "make_hosts", "run"]


def run(*cmd: str) -> None:
    """Run an administrative command (``ip``, ``tc``); raise with its stderr if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)


@dataclasses.dataclass(frozen=True)
class Hosts:
    """Two namespaces ``a`` and ``b``; ``dev_x`` is host x's end of the veth pair."""

    a: str
    b: str
    addr_a: str
    addr_b: str
    dev_a: str
    dev_b: str

    def set_link(self, up: bool, *, host: str = "a") -> None:
        """Bring host ``a``'s (or ``b``'s) end of the link down or up: a partition."""
        ns, dev = (self.a, self.dev_a) if host == "a" else (self.b, self.dev_b)
        run("ip", "-n", ns, "link", "set", dev, "up" if up else "down")

    def limit_rate(self, rate: str, *, host: str = "a") -> None:
        """Shape what host ``a`` (or ``b``) sends to ``rate`` (tc syntax, e.g. ``200mbit``)."""
        ns, dev = (self.a, self.dev_a) if host == "a" else (self.b, self.dev_b)
        run(
            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
            "tbf", "rate", rate, "burst", "256kb", "latency", "400ms",
        )  # fmt: skip


@contextlib.contextmanager
def make_hosts() -> Iterator[Hosts]:
    """Create the two hosts (skip the test where that is not permitted); delete them after."""
    if os.geteuid() != 0:
        pytest.skip("network and mount namespaces need root")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("iproute2 (ip) and util-linux (unshare) are needed")
    tag = secrets.token_hex(3)
    a, b = f"shmrdva{tag}", f"shmrdvb{tag}"
    dev_a, dev_b = f"va{tag}", f"vb{tag}"
    net = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    hosts = Hosts(a, b, f"{net}.1", f"{net}.2", dev_a, dev_b)
    try:
        run("ip", "netns", "add", a)
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"cannot create a network namespace here: {e}")
    try:
        run("ip", "netns", "add", b)
        run("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        run("ip", "link", "set", dev_a, "netns", a)
        run("ip", "link", "set", dev_b, "netns", b)
        for ns, dev, addr in ((a, dev_a, hosts.addr_a), (b, dev_b, hosts.addr_b)):
            run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def host_cmd(netns: str, script: Path, *args: str) -> list[str]:
    """The command running ``python script args...`` on host ``netns``.

    A private mount namespace with its own /dev/shm: the hosts share no shared memory.
    """
    inner = 'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$0" "$@"'
    return [
        "ip", "netns", "exec", netns, "unshare", "-m", "sh", "-c", inner,
        sys.executable, str(script), *args,
    ]  # fmt: skip
