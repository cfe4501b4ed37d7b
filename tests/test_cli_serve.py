"""``shmrdv serve``: a Worker for one task of a cluster, answering over gRPC until SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import free_port, reap_popen

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
