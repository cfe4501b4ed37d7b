"""The figures of a ``shmrdv bench`` run: per method and size a cell, per method its result,
and the run that holds them (with the ratios every report derives from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BASELINE_COPY", "BASELINE_PEER", "BenchRun", "CellResult", "MethodResult"]

BASELINE_COPY = "memcpy"
BASELINE_PEER = "mp_pipe_oob"


@dataclass
class CellResult:
    """One (method, size): every time in nanoseconds, medians of repetition medians."""

    nbytes: int
    reps: int
    per_rep: int
    warmup: int
    checks: int
    rtt_median_ns: float
    rtt_p99_ns: float
    rtt_min_ns: float
    rtt_rep_medians_ns: list[float]
    oneway_median_ns: float
    oneway_p99_ns: float
    oneway_rep_medians_ns: list[float]
    elapsed_s: float
    consumer_faults_per_msg: float | None = None  # minor page faults (getrusage), after warm-up

    @property
    def rtt_spread(self) -> float:
        """Largest over smallest repetition median: how noisy the cell was."""
        lo = min(self.rtt_rep_medians_ns)
        return max(self.rtt_rep_medians_ns) / lo if lo > 0 else float("nan")


@dataclass
class MethodResult:
    """One method: ``status`` is "ok", "skipped" (with ``reason``) or "failed" (with the error)."""

    name: str
    label: str
    group: str
    status: str
    reason: str | None = None
    receiver_array: str = ""
    fixed_nbytes: int | None = None
    idle_cpu_percent: float | None = None
    startup_s: float | None = None
    cpus: dict[str, list[int] | None] = field(default_factory=dict)  # each role's affinity
    baseline: str | None = None  # compared with this method too (grpc_pull for gRPC paths)
    cells: dict[int, CellResult] = field(default_factory=dict)


@dataclass
class BenchRun:
    """A whole run: the machine, the settings, every method."""

    machine: dict[str, Any]
    config: dict[str, Any]
    started: str
    methods: list[MethodResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    interrupted: bool = False

    def method(self, name: str) -> MethodResult | None:
        for m in self.methods:
            if m.name == name:
                return m
        return None

    def fixed_cost_ns(self, name: str, nbytes: int) -> float | None:
        """Median round trip of ``name`` minus memcpy's at the same size (issue 11 §4): what
        a handoff costs beyond the one copy it cannot avoid."""
        m, b = self.method(name), self.method(BASELINE_COPY)
        if m is None or b is None or nbytes not in m.cells or nbytes not in b.cells:
            return None
        return float(m.cells[nbytes].rtt_median_ns - b.cells[nbytes].rtt_median_ns)

    def ratio(self, name: str, nbytes: int, baseline: str, what: str) -> float | None:
        """``what`` ("rtt" or "oneway") median of ``name`` over the same of ``baseline``."""
        m, b = self.method(name), self.method(baseline)
        if m is None or b is None or nbytes not in m.cells or nbytes not in b.cells:
            return None
        num = getattr(m.cells[nbytes], f"{what}_median_ns")
        den = getattr(b.cells[nbytes], f"{what}_median_ns")
        return float(num / den) if den > 0 else None
