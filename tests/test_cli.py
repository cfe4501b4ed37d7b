"""The shmrdv command: every subcommand runs for real in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import shmrdv


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("SHMRDV_NAMESPACE", None)
    return subprocess.run(
        [sys.executable, "-m", "shmrdv", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize("command", ["demo", "bench", "ls", "gc", "serve", "namespace"])
def test_cli_every_command_has_help(command: str) -> None:
    proc = run(command, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_cli_bad_usage_exits_2() -> None:
    proc = run("frobnicate", timeout=60)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
    assert run(timeout=60).returncode == 2


def test_cli_namespace_prints_a_token() -> None:
    proc = run("namespace", timeout=60)
    assert proc.returncode == 0
    token = proc.stdout.strip()
    assert token.isalnum() and len(token) >= 20


@pytest.mark.timeout(180)
def test_cli_demo_runs_checks_and_leaves_nothing() -> None:
    proc = run("demo", "--frames", "40", "--size", "256k", "--stages", "2", timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 bad" in proc.stdout
    assert "multiprocessing.Queue" in proc.stdout
    assert "leftover" not in proc.stderr


@pytest.mark.timeout(180)
def test_cli_demo_two_hosts_over_grpc() -> None:
    proc = run(
        "demo",
        "--frames",
        "20",
        "--size",
        "64k",
        "--stages",
        "1",
        "--hosts",
        "2",
        "--no-baseline",
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gRPC" in proc.stdout and "0 bad" in proc.stdout
    assert "leftover" not in proc.stderr


def test_cli_demo_bad_arguments_exit_2() -> None:
    assert run("demo", "--frames", "0", timeout=60).returncode == 2
    assert run("demo", "--size", "lots", timeout=60).returncode == 2


def test_cli_ls_and_gc_see_only_dead_namespaces() -> None:
    ns_live = shmrdv.new_namespace()
    with shmrdv.Worker("/job:cli/task:0", namespace=ns_live):
        ls = run("ls", "--namespace", ns_live, "--json", timeout=60)
        assert ls.returncode == 0, ls.stderr
        objs = json.loads(ls.stdout)
        assert {o["kind"] for o in objs} >= {"presence", "bell"}
        assert all(o["alive"] for o in objs)
        gc = run("gc", "--namespace", ns_live, timeout=60)
        assert gc.returncode == 0
        assert "removed 0 object" in gc.stdout
        # ls shows the public namespace id, never the token; --namespace takes either.
        nsid = shmrdv.namespace_id(ns_live)
        assert all(o["namespace"] == nsid and ns_live not in o["name"] for o in objs)
        for which in (ns_live, nsid):
            shown = run("ls", "--namespace", which, timeout=60).stdout
            assert shown.count(nsid) == len(objs) and ns_live not in shown
        assert run("gc", "--namespace", "NOT-A-NAMESPACE", timeout=60).returncode == 1
    # A namespace whose only worker was SIGKILLed: everything it left is collected.
    ns_dead = shmrdv.new_namespace()
    code = f"import os, shmrdv; w = shmrdv.Worker('/job:cli/task:1', namespace={ns_dead!r}); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    listed = json.loads(run("ls", "--namespace", ns_dead, "--json", timeout=60).stdout)
    assert listed and not any(o["alive"] for o in listed)
    dry = run("gc", "--namespace", ns_dead, "--dry-run", timeout=60)
    assert f"would remove {len(listed)} object" in dry.stdout
    gc = run("gc", "--namespace", ns_dead, timeout=60)
    assert f"removed {len(listed)} object" in gc.stdout
    assert json.loads(run("ls", "--namespace", ns_dead, "--json", timeout=60).stdout) == []
