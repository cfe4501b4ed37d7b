"""Two "hosts" on one machine: the router must pick gRPC between them by itself.

Each host is a network namespace (joined to the other by a veth pair, each end with its
own address) whose processes also get a private mount namespace with their own tmpfs on
/dev/shm, so shared memory truly cannot cross. Host A runs the producer; host B runs the
consumer, and a second worker on host B that talks to the consumer through shared
memory in the same run. No ``transports`` override anywhere: the placement probe and the
cluster addresses decide. Needs root and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import reap_popen
from netns_helpers import host_cmd, make_hosts

pytestmark = pytest.mark.root

_HOST_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    import shmrdv

    role, cluster_json, ns, marker = sys.argv[1:5]
    cluster = shmrdv.ClusterSpec(json.loads(cluster_json))
    dev = lambda t: f"/job:worker/replica:0/task:{t}/device:CPU:0"
    AB = shmrdv.create_key(dev(0), 0, dev(1), "a_to_b")
    LOCAL = shmrdv.create_key(dev(2), 0, dev(1), "b_local")
    BACK = shmrdv.create_key(dev(1), 0, dev(0), "b_to_a")

    def report(**kw):
        print(json.dumps(kw), flush=True)

    if role == "A":
        with shmrdv.Worker("/job:worker/replica:0/task:0", cluster=cluster, namespace=ns) as w:
            rdv = w.rendezvous(1)
            for i in range(5):
                rdv.send(AB, np.full((1000, 100), i, np.float32))
            big = np.arange(8 << 20, dtype=np.uint8)  # 8 MiB: several stream chunks
            rdv.send(AB, big)
            back = rdv.recv(BACK, timeout=60)
            st = w.stats()
            report(role="A", address=w.address, back=float(back.value.sum()),
                   grpc_sent=st["grpc"]["sent"], grpc_received=st["grpc"]["received"],
                   shm_sent=st["shm"]["sent"])
            while not os.path.exists(marker):
                time.sleep(0.05)
            w.cleanup(1)
    elif role == "B":
        with shmrdv.Worker("/job:worker/replica:0/task:1", cluster=cluster, namespace=ns) as w, \\
             shmrdv.Worker("/job:worker/replica:0/task:2", cluster=cluster, namespace=ns) as w2:
            rdv, rdv2 = w.rendezvous(1), w2.rendezvous(1)
            got = [int(rdv.recv(AB, timeout=60).value[0, 0]) for _ in range(5)]
            big = rdv.recv(AB, timeout=60).value
            rdv2.send(LOCAL, np.arange(10.0))
            local = rdv.recv(LOCAL, timeout=60).value
            rdv.send(BACK, np.ones(7))
            stats = w.stats()
            report(role="B", got=got, big_ok=bool((big == np.arange(8 << 20, dtype=np.uint8)).all()),
                   local=float(local.sum()), shm_received=stats["shm"]["received"],
                   grpc_received=stats["grpc"]["received"],
                   shm_dir=sorted(e for e in os.listdir("/dev/shm") if e.startswith("shmrdv_")).__len__())
            while not os.path.exists(marker):
                time.sleep(0.05)
            w.cleanup(1)
            w2.cleanup(1)
    """
)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    with make_hosts() as h:
        yield h.a, h.b, h.addr_a, h.addr_b


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_two_hosts_router_picks_grpc_across_and_shm_within(
    two_hosts: tuple[str, str, str, str], tmp_path: Path
) -> None:
    import json

    import shmrdv

    netns_a, netns_b, addr_a, addr_b = two_hosts
    port = 20000 + secrets.randbelow(20000)
    cluster = {"worker": [f"{addr_a}:{port}", f"{addr_b}:{port}", f"{addr_b}:{port + 1}"]}
    script = tmp_path / "host.py"
    script.write_text(_HOST_SCRIPT, encoding="utf-8")
    marker = tmp_path / "done"
    ns = shmrdv.new_namespace()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            host_cmd(netns, script, role, json.dumps(cluster), ns, str(marker)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for netns, role in ((netns_a, "A"), (netns_b, "B"))
    ]
    reports = {}
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                p.wait(10)
                pytest.fail(
                    f"host process failed (rc {p.returncode}):\n{p.stderr.read() if p.stderr else ''}"
                )
            rep = json.loads(line)
            reports[rep["role"]] = rep
        marker.write_text("done")
        for p in procs:
            assert p.wait(60) == 0, p.stderr.read() if p.stderr else ""
    finally:
        marker.write_text("done")
        for p in procs:
            reap_popen(p)
    a, b = reports["A"], reports["B"]
    assert b["got"] == [0, 1, 2, 3, 4]
    assert b["big_ok"] is True
    assert b["local"] == 45.0
    assert b["shm_received"] == 1, "the same-host key must go through shared memory"
    assert b["grpc_received"] == 6, "the cross-host keys must go through gRPC"
    assert a["back"] == 7.0 and a["address"] == f"{addr_a}:{port}"
    assert (a["grpc_sent"], a["grpc_received"], a["shm_sent"]) == (6, 1, 0)
