"""The soak run (``shmrdv bench --soak``): its analysis, and 30,000 real handoffs that stay flat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, run_bench

from shmrdv._bench.soak import format_soak, run_soak
from shmrdv._bench.soak_analysis import COUNT_SERIES, analyse
from shmrdv._bench.soak_plan import SoakConfig, soak_sizes
from shmrdv._bench.soak_sample import process_sample
from shmrdv._shm.pool import DEFAULT_MAX_SLOTS

MiB = 1 << 20


def _samples(**series: list[int]) -> list[dict[str, int]]:
    n = len(next(iter(series.values())))
    base = {
        "rss_bytes": 50 * MiB,
        "shm_bytes": MiB,
        "shm_bytes_beside_pool": 0,
        "shm_pool_bytes": MiB,
        "fds": 20,
        "fds_beside_pool": 10,
        "threads_py": 2,
        "threads_os": 3,
        "shm_objects": 20,
        "shm_objects_beside_pool": 4,
        "pool_slots": 10,
        "shm_pool_objects": 16,
    }
    return [
        {**base, "handoffs": i * 1000, **{k: v[i] for k, v in series.items()}} for i in range(n)
    ]


def test_analyse_flat_series_not_flagged() -> None:
    report = analyse(_samples(fds=[20] * 11), 10_000, 0.1, 0.05)
    assert not any(r.flagged for r in report.values())
    assert report["fds"].slope_per_10k == 0.0


def test_analyse_count_rising_after_warmup_is_flagged_even_by_one() -> None:
    report = analyse(_samples(fds_beside_pool=[5, 10, 10, 10, 10, 11]), 5_000, 0.2, 0.05)
    assert report["fds_beside_pool"].flagged
    assert "rose from 10 to 11" in report["fds_beside_pool"].why
    # Growth during warm-up alone is not growth.
    report = analyse(_samples(threads_py=[1, 2, 2, 2, 2, 2]), 5_000, 0.2, 0.05)
    assert not report["threads_py"].flagged


def test_analyse_rss_slope_flagged_beyond_growth_fraction() -> None:
    # +1 MiB per 1,000 handoffs on 50 MiB: 10 MiB over the run, past 5 %.
    rising = [50 * MiB + i * MiB for i in range(11)]
    report = analyse(_samples(rss_bytes=rising), 10_000, 0.1, 0.05)
    assert report["rss_bytes"].flagged
    assert report["rss_bytes"].slope_per_10k == pytest.approx(10 * MiB)
    # A few pages of noise is not growth.
    noisy = [50 * MiB + (i % 2) * 8192 for i in range(11)]
    assert not analyse(_samples(rss_bytes=noisy), 10_000, 0.1, 0.05)["rss_bytes"].flagged


def test_config_interval_is_a_multiple_of_the_batch() -> None:
    cfg = SoakConfig(handoffs=30_000)
    assert cfg.interval % cfg.batch == 0 and 0 < cfg.interval <= 30_000 // 20
    assert soak_sizes(cfg).max() <= cfg.max_size
    with pytest.raises(ValueError):
        SoakConfig(handoffs=0).check()


def test_process_sample_reads_this_process() -> None:
    s = process_sample("a" * 26, 7)
    assert s["handoffs"] == 7 and s["rss_bytes"] > 0 and s["fds"] > 0
    assert s["threads_os"] >= s["threads_py"] >= 1
    assert s["shm_objects"] == 0


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_soak_30000_handoffs_resources_flat_after_warmup() -> None:
    cfg = SoakConfig(handoffs=30_000, max_size=16 << 10)
    r = run_soak(cfg)
    assert r.failure is None, r.failure
    assert r.handoffs == 30_000 and r.bad == []
    text = format_soak(r)
    for proc in ("producer", "consumer"):
        series = r.series[proc]
        for name in COUNT_SERIES:  # descriptors, threads, /dev/shm objects (pool apart)
            s = series[name]
            assert s.max_steady == s.first_steady, f"{proc}.{name} grew:\n{text}"
        rss = series["rss_bytes"]
        assert rss.max_steady - rss.first_steady < 20 * MiB, text
        assert rss.growth_over_run < 20 * MiB, text
        # The pool grows only while it learns the in-flight high-water mark, to its cap.
        assert series["pool_slots"].max_steady <= DEFAULT_MAX_SLOTS
    assert r.leftover_objects == [] and r.processes_left == r.processes_stopped == 0
    assert r.ok, text


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_soak_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = run_bench(
        "--soak",
        "2000",
        "--soak-max-size",
        "4k",
        "--json",
        str(out),
        timeout=100,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["soak"]["ok"] is True and data["soak"]["handoffs"] == 2000
    assert set(data["soak"]["series"]) == {"producer", "consumer"}
    assert "slope_per_10k" in data["soak"]["series"]["producer"]["rss_bytes"]


def test_leak_check_never_calls_objects_of_a_live_namespace_dead() -> None:
    import shmrdv
    from shmrdv._shm.naming import Names
    from shmrdv.pytest_plugin import _dead_leftovers

    ns = shmrdv.new_namespace()
    with shmrdv.Worker("/job:soak/replica:0/task:9", namespace=ns) as w:
        # The name of one of w's pool slots at a moment it is renamed to its message name:
        # the leak check's first listing saw it, its second does not.
        between_renames = Names(ns).pool(w.task, w.incarnation, 7)
        assert _dead_leftovers({between_renames})[0] == set()
