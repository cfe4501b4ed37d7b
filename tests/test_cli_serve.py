"""``shmrdv serve``: the echo peer, on its own (``--listen``, for ``shmrdv bench --peer``) or as a
task of a cluster, answering until SIGTERM."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import free_port, reap_popen, run_bench

import shmrdv
from shmrdv._rpc.client import RpcClient


@pytest.mark.timeout(60)
def test_cli_serve_answers_getstatus_and_stops_cleanly_on_sigterm() -> None:
    ns = shmrdv.new_namespace()
    port = free_port()
    cluster = json.dumps({"s": [f"127.0.0.1:{port}"]})
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmrdv",
            "serve",
            "--task",
            "/job:s/task:0",
            "--cluster",
            cluster,
            "--namespace",
            ns,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"127.0.0.1:{port}" in line, line + (proc.stderr.read() if proc.stderr else "")
        with RpcClient() as client:
            (device,) = client.get_status(f"127.0.0.1:{port}", timeout=10)
        assert device.name == "/job:s/replica:0/task:0/device:CPU:0"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        reap_popen(proc)
    assert not [e for e in os.listdir("/dev/shm") if shmrdv.namespace_id(ns) in e]


def test_cli_serve_without_task_is_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CONFIG"] = json.dumps({"cluster": {"w": ["127.0.0.1:0"]}})
    proc = subprocess.run(
        [sys.executable, "-m", "shmrdv", "serve", "--namespace", shmrdv.new_namespace()],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    assert "--task" in proc.stderr


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "shmrdv", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cli_serve_listen_is_the_echo_peer_that_bench_peer_measures(tmp_path: Path) -> None:
    # Before: serve only held an idle Worker, and bench had no --peer.
    port = free_port()
    proc = _serve("--listen", f"127.0.0.1:{port}")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"echo peer listening on 127.0.0.1:{port}" in line, line + _err(proc)
        assert f"shmrdv bench --peer <this host>:{port}" in line
        out = tmp_path / "peer.json"
        bench = run_bench(
            f"--peer=127.0.0.1:{port}",
            "--sizes=64,4k",
            "--reps=1",
            "--budget=0.02",
            f"--json={out}",
            timeout=80,
        )
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert "goaway" not in bench.stderr.lower(), bench.stderr
        assert "| 4 KiB |" in bench.stdout and "shmrdv_grpc \u00d7grpc_echo" in bench.stdout
        data = json.loads(out.read_text())["peer"]
        assert data["failure"] is None and data["local_address"].startswith("127.0.0.1:")
        for method in ("shmrdv_grpc", "grpc_echo"):
            cells = data["cells"][method]
            assert set(cells) == {"64", "4096"}
            assert all(c["rtt_p99_ns"] >= c["rtt_median_ns"] > 0 for c in cells.values())
        assert data["rtt_x_grpc_echo"]["4096"] > 0
        assert data["echoed"] >= 2 * (3 + 2)  # per size: warm-up, checks, timed round trips
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, _err(proc)
    finally:
        reap_popen(proc)
    assert not [e for e in os.listdir("/dev/shm") if e.startswith("shmrdv_")]


def _err(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        return ""
    return proc.stderr.read() if proc.stderr else ""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_cli_serve_task_echoes_what_another_task_sends() -> None:
    from shmrdv._bench.echo import STEP, echo_keys

    ns = shmrdv.new_namespace()
    cluster = {"s": [f"127.0.0.1:{free_port()}"], "c": [f"127.0.0.1:{free_port()}"]}
    proc = _serve("--task", "/job:s/task:0", "--cluster", json.dumps(cluster), "--namespace", ns)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "echoing what 1 other task(s) send it" in line, line + _err(proc)
        # Over gRPC, as from another host (serve puts gRPC first).
        c = shmrdv.Worker("/job:c/task:0", cluster=cluster, namespace=ns, transports=("grpc",))
        with c as w:
            rdv = w.rendezvous(STEP)
            out, back = echo_keys("/job:s/replica:0/task:0", "/job:c/replica:0/task:0")
            rdv.send(out, np.arange(12, dtype=np.int32).reshape(3, 4))
            got = rdv.recv(back, timeout=30).value
            assert got.dtype == np.int32 and got.tolist() == np.arange(12).reshape(3, 4).tolist()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, _err(proc)
    finally:
        reap_popen(proc)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "127.0.0.1:0", "--task", "/job:s/task:0"], "--listen runs the echo peer"),
        (["--listen", "nohost"], "--listen: address 'nohost' is not 'host:port'"),
    ],
)
def test_cli_serve_listen_usage_errors(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shmrdv", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_bench_peer_where_nothing_listens_fails_at_once_naming_it() -> None:
    port = free_port()
    proc = run_bench(f"--peer=127.0.0.1:{port}", "--sizes=64", timeout=40)
    assert proc.returncode == 1
    assert f"nothing answers at 127.0.0.1:{port} (Connection refused)" in proc.stdout
    assert "shmrdv serve --listen" in proc.stdout


# The bench spawns children, which import the main module again: only run under __main__.
_CLI_SCRIPT = (
    "import sys\nfrom shmrdv._cli import main\n"
    "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_peer_measures_the_round_trip_between_two_hosts(tmp_path: Path) -> None:
    # Two network namespaces joined by a veth pair, each with its own /dev/shm: the echo peer
    # on host A, `shmrdv bench --peer` on host B, as iperf's server and client.
    from netns_helpers import host_cmd, make_hosts

    script = tmp_path / "cli.py"
    script.write_text(_CLI_SCRIPT, encoding="utf-8")
    out = tmp_path / "peer.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with make_hosts() as hosts:
        listen = f"{hosts.addr_a}:{20000 + secrets.randbelow(20000)}"
        serve = subprocess.Popen(
            host_cmd(hosts.a, script, "serve", "--listen", listen),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert serve.stdout is not None
            line = serve.stdout.readline()
            assert f"echo peer listening on {listen}" in line, line + _err(serve)
            argv = ["bench", f"--peer={listen}", "--sizes=64,64k", "--reps=1", "--budget=0.05"]
            bench = subprocess.run(
                host_cmd(hosts.b, script, *argv, f"--json={out}"),
                capture_output=True,
                text=True,
                timeout=100,
                env=env,
            )
            assert bench.returncode == 0, bench.stdout + bench.stderr
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(30) == 0, _err(serve)
        finally:
            reap_popen(serve)
    data = json.loads(out.read_text())["peer"]
    assert data["failure"] is None
    assert data["local_address"].startswith(f"{hosts.addr_b}:")  # host B, as host A sees it
    for method in ("shmrdv_grpc", "grpc_echo"):
        assert set(data["cells"][method]) == {"64", "65536"}
    assert data["rtt_x_grpc_echo"]["65536"] > 0 and data["echoed"] > 0
    assert f"# shmrdv bench --peer {listen}" in bench.stdout
