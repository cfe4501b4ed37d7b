"""``shmrdv bench --soak N``: one producer, one consumer, N handoffs; does anything grow?

Issue 6 §3: RSS, open file descriptors, threads and ``/dev/shm`` usage must stay flat over
a long run. One producer process and one consumer process (each a ``shmrdv.Worker``) hand
over ``handoffs`` arrays of mixed small and medium sizes (``SOAK_SIZES``, seeded) on a few
keys, alternating ``send`` and ``allocate`` + ``send``; every array carries its handoff
number at both ends, which the consumer checks.

``soak_plan.py`` says what is handed over, ``soak_roles.py`` is the two processes (paced by
credits; they sample themselves with ``soak_sample.py``), ``soak_analysis.py`` judges the
series; this module runs them and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._procs import ChildTimeout
from . import children, options
from .children import Teardown
from .common import format_size
from .soak_analysis import INFO_SERIES, SeriesReport, analyse
from .soak_plan import SoakConfig
from .soak_roles import consumer_main, producer_main

__all__ = ["SoakResult", "format_soak", "run_cli", "run_soak"]

_MIN_RATE = 100.0  # handoffs per second below which a run counts as wedged


@dataclass
class SoakResult(Teardown):
    """A soak run: per process its series, plus the checks of the handoffs themselves."""

    config: dict[str, Any]
    handoffs: int = 0
    elapsed_s: float = 0.0
    handoffs_per_s: float = 0.0
    bytes: int = 0
    bad: list[str] = field(default_factory=list)
    series: dict[str, dict[str, SeriesReport]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged(self) -> list[str]:
        return [
            f"{proc}.{name}: {r.why}"
            for proc, series in self.series.items()
            for name, r in series.items()
            if r.flagged
        ]

    @property
    def ok(self) -> bool:
        return (
            self.clean
            and self.handoffs == self.config["handoffs"]
            and not self.bad
            and not self.flagged
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        out["flagged"] = self.flagged
        return out


def run_soak(cfg: SoakConfig, progress: Callable[[str], None] | None = None) -> SoakResult:
    """Run one soak with a real producer and consumer process; return what it measured.

    Blocks until the run ends (each receive is bounded by ``cfg.recv_timeout_s``) and both
    children are gone. A child that fails, dies or hangs is reported in ``failure``, never
    raised; ``ValueError`` for a bad ``cfg``.
    """
    cfg.check()
    say = progress or (lambda text: None)
    result = SoakResult(config=dataclasses.asdict(cfg))
    go = multiprocessing.get_context("spawn").Event()

    finished: dict[str, dict[str, Any]] = {}

    def on_progress(msg: tuple[Any, ...]) -> bool:
        if msg[0] == "progress":
            say(f"soak: {msg[1]:,}/{cfg.handoffs:,} handoffs")
            return True
        return False

    t_wall = time.monotonic()
    with children.run(result) as run:
        group, namespace = run.group, run.namespace
        say(f"soak: {cfg.handoffs:,} handoffs, sizes up to {format_size(cfg.max_size)}")
        group.start("consumer", consumer_main, cfg, namespace, go)
        group.start("producer", producer_main, cfg, namespace, go)
        group["consumer"].expect("ready", 180.0)
        group["producer"].expect("ready", 180.0)
        go.set()
        # Every receive in the children is bounded; this only catches a wedged child.
        deadline = time.monotonic() + 120.0 + cfg.handoffs / _MIN_RATE
        while len(finished) < 2:
            for name in ("producer", "consumer"):
                if name not in finished:
                    with contextlib.suppress(ChildTimeout):
                        finished[name] = group[name].expect("done", 0.5, on_progress)[1]
            if len(finished) < 2 and time.monotonic() > deadline:
                raise ChildTimeout(f"the soak did not finish within {deadline - t_wall:.0f} s")
        prod, cons = finished["producer"], finished["consumer"]
        run.close(("producer", "consumer"))
        result.handoffs = cons["samples"][-1]["handoffs"]
        result.elapsed_s = cons["elapsed_s"]
        result.handoffs_per_s = result.handoffs / result.elapsed_s if result.elapsed_s else 0.0
        result.bytes = cons["bytes"]
        result.bad = cons["bad"]
        for proc, got in (("producer", prod), ("consumer", cons)):
            result.series[proc] = analyse(
                got["samples"], cfg.handoffs, cfg.warmup_fraction, cfg.growth_fraction
            )
            result.stats[proc] = got["stats"]
    return result


# -- report and command line ------------------------------------------------------------------


def _value(name: str, v: float) -> str:
    if name.endswith("_bytes"):
        return f"{v / 2**20:,.2f} MiB"
    return f"{v:,.0f}"


def _slope_text(name: str, v: float) -> str:
    if name.endswith("_bytes"):
        return f"{v / 1024:+,.1f} KiB"
    return f"{v:+.3f}"


def _verdict(name: str, flagged: bool) -> str:
    if name in INFO_SERIES:
        return "(bounded pool)"
    return "**yes**" if flagged else "no"


def format_soak(r: SoakResult) -> str:
    """The run as a short Markdown report."""
    cfg = r.config
    lines = [
        "## shmrdv soak",
        "",
        f"1 producer -> 1 consumer process, {cfg['handoffs']:,} handoffs over {cfg['keys']} "
        f"keys, sizes 64 B - {format_size(cfg['max_size'])} (seed {cfg['seed']}), sampled "
        f"every {SoakConfig(**cfg).interval:,} handoffs; warm-up "
        f"{cfg['warmup_fraction']:.0%} of the run.",
        "",
        f"Handoffs checked: {r.handoffs:,} in {r.elapsed_s:.1f} s "
        f"({r.handoffs_per_s:,.0f}/s, {r.bytes / 1e9:.2f} GB); bad: {len(r.bad)}.",
        "",
    ]
    if r.series:
        lines += [
            "| process | series | after warm-up | max | end | slope / 10k handoffs | grows? |",
            "|---|---|---|---|---|---|---|",
        ]
        for proc, series in r.series.items():
            for name, s in series.items():
                lines.append(
                    f"| {proc} | {name} | {_value(name, s.first_steady)} | "
                    f"{_value(name, s.max_steady)} | {_value(name, s.last)} | "
                    f"{_slope_text(name, s.slope_per_10k)} | {_verdict(name, s.flagged)} |"
                )
        lines.append("")
    for f in r.flagged:
        lines.append(f"growing: {f}")
    for b in r.bad[:5]:
        lines.append(f"bad: {b}")
    lines += [
        f"Left in /dev/shm after close: {len(r.leftover_objects)}; processes left / stopped: "
        f"{r.processes_left} / {r.processes_stopped}; wall {r.wall_s:.1f} s.",
        "",
    ]
    if r.failure:
        lines += ["FAILED: " + r.failure, ""]
    lines += [f"**{'OK' if r.ok else 'FAILED'}**", ""]
    return "\n".join(lines)


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(handoffs=args.soak, max_size=args.soak_max_size)


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --soak N``: 0 when flat and correct, 1 otherwise, 2 on bad options."""
    from .report import run_mode

    return run_mode("soak", args, config_from_args, run_soak, format_soak)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shmrdv._bench.soak``: the soak alone (same options as ``--soak``)."""
    parser = argparse.ArgumentParser(prog="shmrdv bench --soak")
    options.add_soak_arguments(parser)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.soak is None:
        args.soak = SoakConfig.handoffs
    return run_cli(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
