"""A worker under a descriptor limit, and a client that floods it with silent calls.

Both are real child processes talking gRPC over 127.0.0.1 (issue 19 §4):

* ``ServerChild`` runs, under ``ulimit -n`` = ``nofile``, a Worker serving gRPC (with the
  Worker options given) and a second Worker of the same namespace reached through
  shared memory. ``check()`` makes it send a tensor through shared memory to the other
  worker and receive it, open a file, and report its RSS, open descriptors and server
  counters.
* ``SilentFlood`` opens ``connections`` connections (one channel each, never shared) and
  on each ``calls`` calls that send their headers and never a request message: the calls
  a hostile client needs no token to make. ``up()`` reports how many connected;
  ``outcomes()`` the status codes the calls ended with so far. Its connections all go
  when it is closed (killed).

Every wait on a child is bounded (``timeout``); ``close()`` always reaps.
``silent_call_outcomes`` makes such calls from this process, and says how each ended.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
from typing import Any

import grpc
import grpc.aio
from helpers import SHMRDV_PATH

_TESTS = os.path.dirname(os.path.abspath(__file__))

_SERVER = r"""
import json, os, resource, sys
nofile, ns, opts = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
import numpy as np
import shmrdv
from helpers import CONSUMER, PRODUCER, make_key
# No pool: every send makes a segment (a descriptor), as a process out of them would feel.
served = shmrdv.Worker(PRODUCER, namespace=ns, transports=("grpc", "shm"), shm_pool_bytes=0, **opts)
local = shmrdv.Worker(CONSUMER, namespace=ns, transports=("shm",))
print(json.dumps({"address": served.address}), flush=True)

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

step = 0
for line in sys.stdin:
    step += 1
    out = {}
    try:
        out["rss_mb"] = rss_mb()
        out["fds"] = len(os.listdir("/proc/self/fd"))
    except OSError as e:
        out["rss_mb"], out["fds"] = None, None
    try:
        key = make_key(f"probe{step}")
        served.rendezvous(step).send(key, np.arange(1000.0))
        got = local.rendezvous(step).recv(key, timeout=10).value
        out["shm"] = "ok" if got.sum() == np.arange(1000.0).sum() else "wrong value"
    except Exception as e:
        out["shm"] = f"{type(e).__name__}: {e}"
    try:
        os.close(os.open("/dev/null", os.O_RDONLY))
        out["open"] = "ok"
    except OSError as e:
        out["open"] = str(e)
    served.cleanup(step)
    local.cleanup(step)
    stats = served.stats()["grpc"]
    out["server"] = {k[len("server_"):]: v for k, v in stats.items() if k.startswith("server_")}
    print(json.dumps(out), flush=True)
local.close()
served.close()
"""

_FLOOD = r"""
import asyncio, json, resource, sys
import grpc, grpc.aio
address, method, connections, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per connection

async def main():
    channels, pending = [], []
    for _ in range(connections):
        ch = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(ch)
        silent = ch.stream_unary(method)
        pending += [silent(timeout=120) for _ in range(calls)]
    try:
        await asyncio.wait_for(
            asyncio.gather(*(c.wait_for_connection() for c in pending), return_exceptions=True),
            20,
        )
    except asyncio.TimeoutError:
        pass
    states = [str(ch.get_state()) for ch in channels]
    print(json.dumps({"ready": states.count("ChannelConnectivity.READY"), "calls": len(pending)}),
          flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        codes, details = {}, set()
        for c in pending:
            if c.done():
                code = str(await c.code()).rsplit(".", 1)[-1]
                codes[code] = codes.get(code, 0) + 1
                details.add(await c.details() or "")
        details = sorted(details)[:3]
        print(json.dumps({"codes": codes, "details": details}), flush=True)

asyncio.run(main())
"""


class _LineChild:
    """A child process answering one JSON line per line it is sent."""

    def __init__(self, args: list[str], timeout: float, quiet: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if quiet else None,
            text=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([SHMRDV_PATH, _TESTS])),
        )
        self.first = self._line(timeout)

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise AssertionError(f"child said nothing within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise AssertionError(f"child ended (rc={self.proc.poll()})")
        result: dict[str, Any] = json.loads(line)
        return result

    def ask(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Close its stdin (a clean exit), kill it if it lingers, close the pipes."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
        self.proc.stdout.close()


class ServerChild(_LineChild):
    """A serving Worker (options ``opts``) and a shared-memory peer under ``ulimit -n nofile``."""

    def __init__(self, namespace: str, nofile: int, **opts: Any) -> None:
        super().__init__([_SERVER, str(nofile), namespace, json.dumps(opts)], timeout=30)
        self.address: str = self.first["address"]

    def check(self) -> dict[str, Any]:
        return self.ask()


class SilentFlood(_LineChild):
    """``connections`` connections to ``address``, each with ``calls`` silent calls."""

    def __init__(self, address: str, method: str, connections: int, calls: int = 1) -> None:
        # Quiet: gRPC logs every refused connection.
        super().__init__(
            [_FLOOD, address, method, str(connections), str(calls)], timeout=60, quiet=True
        )

    def up(self) -> dict[str, Any]:
        """``ready``: connections that got through; ``calls``: calls opened."""
        return self.first

    def outcomes(self) -> dict[str, Any]:
        """``codes``: status code name -> calls ended with it so far; ``details``: a few."""
        return self.ask()

    def close(self, timeout: float = 10.0) -> None:
        """Kill it: its connections close with it."""
        self.proc.kill()
        super().close(timeout)


# -- silent calls from this process (a server in this process too) --------------------------


def silent_call_outcomes(
    address: str,
    method: str,
    count: int = 1,
    *,
    response_stream: bool = False,
    metadata: tuple[tuple[str, str], ...] = (),
    half_close: bool = False,
    timeout: float = 20.0,
) -> list[tuple[grpc.StatusCode, str, float]]:
    """Open ``count`` calls to ``method`` that send headers and no request message (with
    ``half_close``: that end their request stream at once), on one channel; wait for each
    to end (at the latest at the client's own ``timeout``). Returns each one's status
    code, details and the seconds from opening to its end."""

    async def run() -> list[tuple[grpc.StatusCode, str, float]]:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(address) as ch:
            open_call = ch.stream_stream(method) if response_stream else ch.stream_unary(method)
            t0 = loop.time()
            calls = [open_call(timeout=timeout, metadata=metadata) for _ in range(count)]
            if half_close:
                for c in calls:
                    await c.done_writing()

            async def outcome(c: Any) -> tuple[grpc.StatusCode, str, float]:
                code = await c.code()
                return code, await c.details() or "", loop.time() - t0

            return list(await asyncio.gather(*(outcome(c) for c in calls)))

    return asyncio.run(run())
