"""The shmrdv command: every subcommand runs for real in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

import shmrdv
from shmrdv._cli import main


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
@pytest.mark.slow
def test_cli_demo_runs_checks_and_leaves_nothing() -> None:
    proc = run("demo", "--frames", "40", "--size", "256k", "--stages", "2", timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 bad" in proc.stdout
    assert "multiprocessing.Queue" in proc.stdout
    assert "backpressure: at most 4 frames" in proc.stdout  # the demo says it uses a window
    assert "leftover" not in proc.stderr
    # Rates are timed from the first frame received to the last, and the output says so.
    assert "frames/s: from the first frame the sink receives to the last" in proc.stdout
    assert "shmrdv:                 40 frames, the last 39 in" in proc.stdout
    # Both halves report progress as they go (stderr is not a terminal: a line per report).
    for label in ("shmrdv", "multiprocessing.Queue"):
        assert f"  {label}: 40/40 frames" in proc.stderr, proc.stderr


@pytest.mark.timeout(180)
@pytest.mark.slow
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
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gRPC" in proc.stdout and "0 bad" in proc.stdout
    assert "leftover" not in proc.stderr
    # Consumers close their channels before the producer stops its server: grpc core has
    # nothing to log ("Got goaway ... Cancelling all calls").
    assert "goaway" not in proc.stderr.lower(), proc.stderr
    assert "chttp2" not in proc.stderr, proc.stderr
    # The ratio is explained: the network path against a same-host queue.
    last = proc.stdout.strip().splitlines()[-1]
    assert "network path" in last and "within one host" in last, last


def test_cli_demo_rate_leaves_start_up_out() -> None:
    from shmrdv._bench.demo import _rate, _result_line

    # 11 frames, the first received at t, the last at t + 2 s: 10 intervals in 2 s.
    assert _rate(11, 2.0) == 5.0
    assert _rate(1, 0.0) is None
    assert "a rate takes two frames" in _result_line("shmrdv", 1, 0.0, 0, 64)
    line = _result_line("shmrdv", 11, 2.0, 0, 1 << 20)
    assert "11 frames, the last 10 in   2.00 s =      5.0 frames/s" in line and "0 bad" in line


def test_cli_demo_bad_arguments_exit_2() -> None:
    assert run("demo", "--frames", "0", timeout=60).returncode == 2
    assert run("demo", "--size", "lots", timeout=60).returncode == 2
    assert run("demo", "--window", "-1", timeout=60).returncode == 2


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``shmrdv argv`` in this process; it must be a usage error (exit 2): its stderr."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("size", ["4x", "lots", "0", "2"])
def test_cli_demo_bad_size_is_usage_error_with_an_example(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(capsys, "demo", "--size", size)
    assert "usage: shmrdv demo" in err
    assert "argument --size" in err and repr(size) in err
    assert "e.g." in err and "4m" in err, err


@pytest.mark.parametrize(
    "argv",
    [["ls", "--bogus"], ["gc", "--json"], ["namespace", "-x"], ["demo", "--nope", "1"]],
)
def test_cli_unknown_flag_prints_the_subcommands_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(capsys, *argv)
    assert f"usage: shmrdv {argv[0]} " in err, err
    assert f"unrecognized arguments: {' '.join(argv[1:])}" in err


def test_cli_serve_without_cluster_or_namespace_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("SHMRDV_NAMESPACE", raising=False)
    err = usage_error(capsys, "serve", "--task", "/job:s/task:0")
    assert "usage: shmrdv serve" in err
    for needed in ("TF_CONFIG", "--cluster", "--namespace", "SHMRDV_NAMESPACE"):
        assert needed in err, (needed, err)


def test_cli_serve_bad_cluster_json_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(
        capsys, "serve", "--task", "/job:s/task:0", "--cluster", "{nope", "--namespace", "x" * 26
    )
    assert "--cluster is not JSON" in err and "e.g." in err


@pytest.mark.parametrize(
    "argv",
    [
        ["namespace"],
        ["ls"],
        ["ls", "--json"],
        ["gc", "--dry-run"],
        ["--help"],
        ["ls", "--help"],
        ["demo", "--frames", "2", "--size", "4k", "--stages", "1", "--no-baseline"],
    ],
)
def test_cli_exits_quietly_when_its_output_pipe_closes(argv: list[str]) -> None:
    # As `shmrdv ls | head -1`: the reader is gone before (or while) the command writes.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "shmrdv", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.stderr == "", proc.stderr
    assert proc.returncode in (0, 141)


def test_cli_ls_with_many_objects_into_head_exits_quietly() -> None:
    # More than a pipe buffer (64 KiB) of listing; head reads one line and goes away.
    with contextlib.ExitStack() as stack:
        ns = shmrdv.new_namespace()
        for i in range(150):
            stack.enter_context(shmrdv.Worker(f"/job:many/task:{i}", namespace=ns))
        proc = subprocess.run(
            [sys.executable, "-m", "shmrdv", "ls", "--json"],
            stdout=subprocess.PIPE,
            timeout=60,
        )
        assert len(proc.stdout) > 65536, len(proc.stdout)
        piped = subprocess.run(
            f"{sys.executable} -m shmrdv ls --json | head -c 10 >/dev/null; echo ${{PIPESTATUS[0]}}",
            shell=True,
            executable="/bin/bash",
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert piped.stderr == "", piped.stderr
    assert piped.stdout.strip() == "141"


@pytest.mark.slow
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
