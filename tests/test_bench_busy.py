"""``shmrdv bench --oversubscribe N``: busy processes beside the run, and the host state it reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import run_bench, wait_for

from shmrdv._bench.busy import busy_processes, host_text


def _children() -> dict[int, str]:
    """This process's live children: pid -> command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid():
            found[int(entry)] = cmd
    return found


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.timeout(60)
def test_busy_processes_spin_pinned_while_open_and_are_gone_after() -> None:
    before = set(_children())
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with busy_processes(2, cpus) as host:
        busy = sorted(
            p for p, cmd in _children().items() if p not in before and "resource_tracker" not in cmd
        )
        assert len(busy) == 2, _children()
        pinned = sorted(sorted(os.sched_getaffinity(p)) for p in busy)
        assert pinned == sorted([[cpus[0]], [cpus[1 % len(cpus)]]])
        ticks = {p: _cpu_ticks(p) for p in busy}
        wait_for(lambda: all(_cpu_ticks(p) > ticks[p] for p in busy), 20, "the busy processes spin")
        assert host == {
            "state": "oversubscribed",
            "busy_processes": 2,
            "busy_cpus": [[cpus[0]], [cpus[1 % len(cpus)]]],
        }
    assert not [p for p in busy if os.path.exists(f"/proc/{p}")]


def test_busy_processes_zero_is_a_quiet_host() -> None:
    before = set(_children())
    with busy_processes(0, None) as host:
        assert host == {"state": "quiet", "busy_processes": 0, "busy_cpus": None}
        assert set(_children()) == before
    assert host_text(host) == "quiet" and host_text(None) == "quiet"
    assert host_text({"busy_processes": 1, "busy_cpus": None}) == "oversubscribed (1 busy process)"
    assert host_text({"busy_processes": 2, "busy_cpus": [[0], [1]]}) == (
        "oversubscribed (2 busy processes pinned to CPUs 0, 1)"
    )


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_bench_oversubscribed_says_so_in_the_report_and_the_json(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    proc = run_bench(
        "--methods=mp_pipe_oob",
        "--no-baselines",
        "--sizes=64",
        "--reps=1",
        "--budget=0.02",
        "--idle-seconds=0",
        "--oversubscribe=2",
        f"--json={out}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "oversubscribed (2 busy processes" in proc.stdout
    host = json.loads(out.read_text())["config"]["host"]
    assert host["state"] == "oversubscribed" and host["busy_processes"] == 2


def test_oversubscribe_is_refused_with_another_mode() -> None:
    proc = run_bench("--python-cost", "--oversubscribe=1")
    assert proc.returncode == 2
    assert "--oversubscribe applies to the round-trip run, not to --python-cost" in proc.stderr
