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
    keys: str | None = None  # the key pattern of this run (common.KEY_PATTERNS); None: no keys
    cells: dict[int, CellResult] = field(default_factory=dict)

    @property
    def row(self) -> str:
        """The method and its key pattern, as every table's row names it."""
        return self.name if self.keys is None else f"{self.name} · {self.keys}"


@dataclass
class BenchRun:
    """A whole run: the machine, the settings, every method."""

    machine: dict[str, Any]
    config: dict[str, Any]
    started: str
    methods: list[MethodResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    interrupted: bool = False

    def method(self, name: str, keys: str | None = None) -> MethodResult | None:
        """The result of method ``name`` to compare a run under key pattern ``keys`` with: the
        one of that pattern; else the method's run without keys; else (for a caller without
        keys, or a pattern the method did not run) its run with one key reused, or its first."""
        found = [m for m in self.methods if m.name == name]
        for wanted in (keys, None, "same"):
            for m in found:
                if m.keys == wanted:
                    return m
        return found[0] if found else None

    def fixed_cost_ns(self, m: MethodResult, nbytes: int) -> float | None:
        """Median round trip of ``m`` minus memcpy's at the same size: what a handoff costs
        beyond the one copy it cannot avoid."""
        b = self.method(BASELINE_COPY)
        if b is None or nbytes not in m.cells or nbytes not in b.cells:
            return None
        return float(m.cells[nbytes].rtt_median_ns - b.cells[nbytes].rtt_median_ns)

    def ratio(self, m: MethodResult, nbytes: int, baseline: str, what: str) -> float | None:
        """``what`` ("rtt" or "oneway") median of ``m`` over the same of ``baseline`` (its run
        under ``m``'s key pattern, where it has one: ``method``)."""
        return self._ratio(m, self.method(baseline, m.keys), nbytes, what)

    def ratio_same_keys(self, m: MethodResult, nbytes: int, what: str) -> float | None:
        """``what`` median of ``m`` over the same method's with one key reused; None for a run
        without keys or with one key reused."""
        if m.keys in (None, "same"):
            return None
        same = next((o for o in self.methods if o.name == m.name and o.keys == "same"), None)
        return self._ratio(m, same, nbytes, what)

    @staticmethod
    def _ratio(m: MethodResult, b: MethodResult | None, nbytes: int, what: str) -> float | None:
        if b is None or nbytes not in m.cells or nbytes not in b.cells:
            return None
        num = getattr(m.cells[nbytes], f"{what}_median_ns")
        den = getattr(b.cells[nbytes], f"{what}_median_ns")
        return float(num / den) if den > 0 else None
