"""The load run (``shmrdv bench --load``): its plan, its checks, and a scaled-down real run."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, run_bench

from shmrdv._bench.load import format_load, run_load
from shmrdv._bench.load_plan import HEADER, MAGIC, LoadConfig, LoadPlan, draw_sizes, make_plan
from shmrdv._bench.load_roles import _Check, _check_message


def _message(plan: LoadPlan, k: int, s: int) -> np.ndarray:
    size = int(plan.sizes[k][s])
    a = np.random.default_rng([k, s]).integers(0, 256, size, dtype=np.uint8)
    crc = zlib.crc32(a[HEADER.size :].data)
    HEADER.pack_into(a.data, 0, MAGIC, plan.owner(k), k, s, size, 1, crc)
    return a


def _tally(plan: LoadPlan) -> _Check:
    counts = plan.counts
    return _Check(counts, [0] * len(counts), [bytearray(c) for c in counts])


def _take(a: np.ndarray, k: int, plan: LoadPlan, tally: _Check) -> None:
    consumed = [0] * plan.config.producers
    _check_message(a, k, plan, tally, consumed)
    tally.received[k] += 1


def test_plan_same_in_every_process_and_within_bounds() -> None:
    cfg = LoadConfig(messages=5_000, producers=4, keys=100, max_size=256 << 10)
    a, b = make_plan(cfg), make_plan(cfg)
    assert all(np.array_equal(x, y) for x, y in zip(a.sizes, b.sizes))
    assert sum(a.counts) == 5_000 and len(a.counts) == 100
    assert max(a.counts) - min(a.counts) <= 1
    sizes = np.concatenate(a.sizes)
    assert sizes.min() >= 64 and sizes.max() <= 256 << 10
    for p in range(4):
        assert np.array_equal(a.order(p), b.order(p))


def test_plan_each_key_has_one_producer_who_interleaves_its_keys() -> None:
    plan = make_plan(LoadConfig(messages=2_000, producers=4, keys=100))
    owners: dict[int, int] = {}
    for p in range(4):
        order = plan.order(p)
        assert {plan.owner(int(k)) for k in order} == {p}
        for k in set(order.tolist()):
            assert owners.setdefault(k, p) == p
            assert int((order == k).sum()) == plan.counts[k]
        # Interleaved: consecutive messages of a producer mostly change key.
        assert (np.diff(order) != 0).mean() > 0.9
    assert len(owners) == 100


def test_sizes_weighted_to_small_ones() -> None:
    sizes = draw_sizes(np.random.default_rng(0), 50_000, 64, 4 << 20)
    assert sizes.min() >= 64 and sizes.max() <= 4 << 20
    assert np.median(sizes) < 1 << 10
    assert (sizes >= 1 << 20).mean() == pytest.approx(0.02, abs=0.005)
    assert (sizes % 8 == 0).all()


@pytest.mark.parametrize(
    "bad",
    [
        {"producers": 0},
        {"keys": 3, "producers": 4},
        {"messages": 0},
        {"min_size": 16},
        {"max_size": 32},
        {"window_bytes": 1024},
    ],
)
def test_config_check_refuses_nonsense(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        LoadConfig(**bad).check()


def test_check_message_accepts_the_plan_in_order() -> None:
    plan = make_plan(LoadConfig(messages=40, producers=2, keys=4, max_size=64 << 10))
    tally = _tally(plan)
    for k in range(4):
        for s in range(plan.counts[k]):
            _take(_message(plan, k, s), k, plan, tally)
    assert (tally.duplicates, tally.fifo_violations, tally.bad_checksum) == (0, 0, 0)
    assert (tally.bad_header, tally.size_mismatch) == (0, 0)
    assert tally.nbytes == plan.total_bytes


def test_check_message_catches_reorder_duplicate_corruption_and_wrong_key() -> None:
    plan = make_plan(LoadConfig(messages=40, producers=2, keys=4, max_size=64 << 10))
    tally = _tally(plan)
    _take(_message(plan, 0, 1), 0, plan, tally)  # seq 1 before seq 0
    assert tally.fifo_violations == 1
    _take(_message(plan, 0, 1), 0, plan, tally)  # seq 1 again
    assert tally.duplicates == 1
    bad = _message(plan, 1, 0)
    bad[-1] ^= 0xFF
    _take(bad, 1, plan, tally)
    assert tally.bad_checksum == 1
    _take(_message(plan, 2, 0), 3, plan, tally)  # key 2's message arrives on key 3
    assert tally.bad_header == 1


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_load_scaled_down_all_delivered_fifo_no_duplicates() -> None:
    cfg = LoadConfig(messages=2_000, producers=4, keys=100, max_size=256 << 10)
    r = run_load(cfg)
    assert r.failure is None, r.failure
    assert r.delivered == r.unique == 2_000 and r.missing == 0
    assert r.duplicates == 0 and r.fifo_violations == 0
    assert r.bad_checksum == r.bad_header == r.size_mismatch == 0
    assert r.errors == []
    assert r.bytes == r.planned_bytes
    assert r.leftover_objects == [] and r.processes_left == r.processes_stopped == 0
    assert sum(p["zero_copy"] for p in r.producers) > 0  # both producer paths carried load
    assert r.latency_ns["p50"] > 0 and r.latency_ns["p99"] >= r.latency_ns["p50"]
    assert r.messages_per_s > 0 and r.ok
    assert "**OK**" in format_load(r)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_load_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    proc = run_bench(
        "--load",
        "--load-messages",
        "300",
        "--load-producers",
        "2",
        "--load-keys",
        "10",
        "--load-max-size",
        "16k",
        "--load-window",
        "1m",
        "--json",
        str(out),
        timeout=100,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "**OK**" in proc.stdout
    data = json.loads(out.read_text())
    assert data["load"]["ok"] is True and data["load"]["delivered"] == 300
    assert data["load"]["latency_ns"]["p99"] > 0


def test_load_cli_refuses_load_and_soak_together() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shmrdv", "bench", "--load", "--soak", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--load and --soak" in proc.stderr
