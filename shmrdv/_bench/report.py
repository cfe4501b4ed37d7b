"""How the results of a ``shmrdv bench`` run are shown: markdown, JSON, a plot.

Every figure is derived here from the measured cells, so the markdown tables and
the JSON file agree. Throughput is bytes / median one-way time (and, in the JSON,
also bytes / median round trip), in GB/s = 10**9 B/s.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .busy import host_text
from .common import KEY_PATTERNS, format_size
from .machine import describe_machine
from .results import BASELINE_COPY, BASELINE_PEER, BenchRun, MethodResult
from .textfit import fit_markdown

__all__ = [
    "DASH",
    "FASTER_THAN_COPY",
    "TIMES",
    "format_markdown",
    "format_sig",
    "format_time",
    "plot_run",
    "run_mode",
    "to_json",
    "write_json",
]

TIMES = "\u00d7"  # the multiplication sign of the ratio cells
DASH = "\u2013"  # an en dash: a cell with no figure
# A round trip shorter than one single-threaded memcpy of the same size has no fixed cost
# to show: the difference is not a cost but a copy the method did not make (allocate fills
# the buffer untimed; send splits large copies over helper threads).
FASTER_THAN_COPY = "< memcpy"
FASTER_THAN_COPY_NOTE = (
    f"{FASTER_THAN_COPY}: the round trip took less than one single-threaded memcpy of the "
    "same size, so round trip minus memcpy is no fixed cost: the method made no such copy "
    "in the timed handoff (shmrdv_allocate's producer fills its buffer untimed) or made it "
    "on several threads (shmrdv_send's copy helpers from a few MiB). The JSON keeps the "
    "signed difference (rtt_fixed_cost_ns)."
)


# -- numbers as text ------------------------------------------------------------------------


def _sig(x: float) -> str:
    """Three significant digits, thousands separated: 0.270, 12.3, 1,179."""
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:#.3g}"


def format_sig(x: float) -> str:
    """``x`` as every figure of the report shows it: three significant digits, thousands
    separated (0.273, 12.3, 1,179)."""
    return _sig(x)


def format_time(ns: float) -> str:
    """A time in the unit that keeps it short: 812 µs, 1.37 ms, 1.17 s."""
    if ns >= 1e9:
        return f"{_sig(ns / 1e9)} s"
    if ns >= 1e6:
        return f"{_sig(ns / 1e6)} ms"
    return f"{_sig(ns / 1000)} µs"


def _gbps(nbytes: int, ns: float) -> str:
    return f"{_sig(nbytes / ns)} GB/s" if ns > 0 else DASH


def _fixed(ns: float | None) -> str:
    if ns is None:
        return DASH
    return FASTER_THAN_COPY if ns < 0 else format_time(ns)


def _times(r: float | None) -> str:
    return "" if r is None else f"{TIMES}{_sig(r)}"


def _ordered(run: BenchRun) -> list[MethodResult]:
    rank = {"floor": 0, "shmrdv": 1, "peer": 2}
    return sorted(run.methods, key=lambda m: rank.get(m.group, 3))


def _sizes(run: BenchRun) -> list[int]:
    sizes: list[int] = list(run.config.get("sizes", []))
    return sizes


def _baselines(run: BenchRun) -> list[str]:
    """The further baselines that methods of the run name (``MethodSpec.baseline``)."""
    return list(dict.fromkeys(m.baseline for m in run.methods if m.baseline))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out.extend("| " + " | ".join(r) + " |" for r in rows)
    return out


def _host(run: BenchRun) -> str:
    """The host's state (``busy.host_text``) and the 1-minute load average before and after:
    a quiet run on a machine others load says so."""
    loads = [run.machine.get(f"load_average_{when}") for when in ("start", "end")]
    if not all(loads):
        return host_text(run.config.get("host"))
    start, end = (load[0] for load in loads if load)
    state = host_text(run.config.get("host"))
    cpus = run.machine.get("cpu_affinity") or run.machine.get("cpu_count") or 1
    if state == "quiet" and max(start, end) >= cpus / 2:
        state += " (no busy processes of the bench, but other work loaded the host)"
    return f"{state}; load average {start:g} → {end:g}"


def _keyed(run: BenchRun) -> bool:
    return any(m.keys is not None for m in run.methods)


def _keys_legend(run: BenchRun) -> list[str]:
    """What each key pattern of the run's rows means (``common.KEY_PATTERNS``)."""
    used = list(dict.fromkeys(m.keys for m in run.methods if m.keys is not None))
    if not used:
        return []
    return [
        "Key patterns (a row's `· pattern`; rows without one name nothing by key): "
        + "; ".join(f"`{k}`: {KEY_PATTERNS[k]}" for k in used)
        + ".",
        "",
    ]


# The peers the summary compares shmrdv with, by the name it gives them: a gRPC method
# (grpc_pull itself, or one whose baseline it is) with the raw gRPC job, any other with both
# of the standard library's ways between processes.
SUMMARY_PEERS = {"mp_pipe_oob": "Pipe", "mp_queue": "Queue", "grpc_pull": "raw gRPC"}
_VERDICT_PEERS = {
    "mp_pipe_oob": "a Pipe's",
    "mp_queue": "a Queue's",
    "grpc_pull": "raw grpcio's (a pull, then an ack call)",
}
_GRPC_PEER = "grpc_pull"


def format_range(median_ns: float, reps_ns: list[float]) -> str:
    """A median and the range of the repetition medians, in the median's unit (48.1 µs and
    45.2 to 52.3 with an en dash between); the median alone if the range is one figure."""
    for scale, unit in ((1e9, "s"), (1e6, "ms"), (1e3, "µs")):
        if median_ns >= scale or unit == "µs":
            break
    lo, hi = min(reps_ns, default=median_ns), max(reps_ns, default=median_ns)
    text = f"{_sig(median_ns / scale)} {unit}"
    if _sig(lo / scale) == _sig(hi / scale):
        return text
    return f"{text} ({_sig(lo / scale)}{DASH}{_sig(hi / scale)})"


def _summary_peers(m: MethodResult) -> list[str]:
    if m.name == _GRPC_PEER or m.baseline == _GRPC_PEER:
        return [_GRPC_PEER]
    return [p for p in SUMMARY_PEERS if p != _GRPC_PEER]


def _summary(run: BenchRun, sized: list[MethodResult]) -> list[str]:
    """The verdict: shmrdv's round trips against a Pipe, a Queue and raw gRPC, per size, with
    the key pattern and the host's state; times as the median and the range of the
    repetitions' medians."""
    sizes = _sizes(run)
    ours = [m for m in sized if m.group == "shmrdv"]
    peers = [m for m in sized if m.name in SUMMARY_PEERS]
    rows_of = ours + peers if ours else [m for m in sized if m.group != "floor"] or sized
    present = [p for p in SUMMARY_PEERS if any(m.name == p for m in sized)]
    reps = sorted({c.reps for m in rows_of for c in m.cells.values()})
    keys = list(dict.fromkeys(m.keys for m in rows_of if m.keys is not None))
    by_same = any(run.ratio_same_keys(m, n, "rtt") is not None for m in rows_of for n in sizes)
    spread = f" (min{DASH}max of {'/'.join(map(str, reps))} repetitions)" if reps else ""
    lines = [
        f"## Summary: round trip, median{spread}",
        "",
        f"Host: {_host(run)}."
        + (f" Keys: {', '.join(keys)}." if keys else "")
        + " Round trip: the array there, an ack back. Ratios: the row's median over the"
        " peer's at the same size, in this run (below 1: faster)"
        + (f"; {TIMES}same key: over the same method's with one key reused" if by_same else "")
        + ".",
        "",
    ]
    header = ["size", "method · keys" if keys else "method", "round trip", "p99"]
    header += [f"{TIMES}{SUMMARY_PEERS[p]}" for p in present]
    if by_same:
        header.append(f"{TIMES}same key")
    rows = []
    for n in sizes:
        for m in rows_of:
            c = m.cells.get(n)
            if c is None:
                if m.status != "ok":
                    rows.append([format_size(n), m.row, m.status, *[""] * (len(header) - 3)])
                continue
            ratios = [
                _times(run.ratio(m, n, p, "rtt")) if p in _summary_peers(m) and p != m.name else ""
                for p in present
            ]
            rows.append(
                [
                    format_size(n),
                    m.row,
                    format_range(c.rtt_median_ns, c.rtt_rep_medians_ns),
                    format_time(c.rtt_p99_ns),
                    *ratios,
                    *([_times(run.ratio_same_keys(m, n, "rtt"))] if by_same else []),
                ]
            )
    keep = [i for i in range(len(header)) if i < 4 or any(r[i] for r in rows)]  # no empty column
    lines += [*_table([header[i] for i in keep], [[r[i] for i in keep] for r in rows]), ""]
    verdicts = [v for m in ours if (v := _verdict(run, m, sizes)) is not None]
    if verdicts:
        lines += [*verdicts, ""]
    return lines


def _verdict(run: BenchRun, m: MethodResult, sizes: list[int]) -> str | None:
    """One line: ``m``'s round trip over its first summary peer's, across the sizes."""
    peer = next((p for p in _summary_peers(m) if run.method(p) is not None), None)
    if peer is None:
        return None
    got = [(n, r) for n in sizes if (r := run.ratio(m, n, peer, "rtt")) is not None]
    if not got:
        return None
    lo, hi = min(r for _, r in got), max(r for _, r in got)
    faster = sum(1 for _, r in got if r < 1)
    first, last = (format_size(got[i][0]).replace(" ", "\u00a0") for i in (0, -1))
    span = first if len(got) == 1 else f"{first}{DASH}{last}"
    every = " at every size" if len(got) > 1 else ""
    verdict = (
        f"faster{every}"
        if faster == len(got)
        else f"slower{every}"
        if faster == 0
        else f"faster at {faster} of {len(got)} sizes"
    )
    ratio = f"{TIMES}{_sig(lo)}" + ("" if _sig(lo) == _sig(hi) else f"{DASH}{_sig(hi)}")
    return f"* `{m.row}`: {ratio} {_VERDICT_PEERS[peer]} round trip at {span}: {verdict}."


def _status(m: MethodResult) -> str:
    """ "ok", "skipped: why" or "failed: the first and last line of the error"."""
    text = m.status
    if m.reason:
        why = m.reason.strip().splitlines()
        text += f": {why[0][:120]}" + (f" {why[-1][:120]}" if len(why) > 1 else "")
    return text


def _methods_list(ordered: list[MethodResult]) -> list[str]:
    """One line per method: its key patterns and their status, its label, its receiver's
    array, and the idle CPU share of a blocked receive."""
    lines = ["## Methods", ""]
    by_name: dict[str, list[MethodResult]] = {}
    for m in ordered:
        by_name.setdefault(m.name, []).append(m)
    for name, runs in by_name.items():
        first = runs[0]
        keys = [m.keys for m in runs if m.keys is not None]
        statuses = {_status(m) for m in runs}
        if len(statuses) == 1:
            state = statuses.pop()
        else:
            state = "; ".join(f"{m.keys}: {_status(m)}" for m in runs)
        idles = [(m.keys, m.idle_cpu_percent) for m in runs if m.idle_cpu_percent is not None]
        idle = ""
        if idles:
            idle = (
                " Idle CPU of a blocked receive: "
                + ", ".join(
                    f"{v:.2f}\u00a0%" + (f" ({k})" if k is not None and len(idles) > 1 else "")
                    for k, v in idles
                )
                + "."
            )
        array = f" Receiver's array: {first.receiver_array}." if first.receiver_array else ""
        patterns = f" · {', '.join(keys)}" if keys else ""
        lines.append(f"* `{name}`{patterns} ({state}): {first.label}.{array}{idle}")
    return lines


def format_markdown(run: BenchRun, details: bool = True) -> str:
    """The run as markdown: the machine and the host's state, the summary (``_summary``),
    with ``details`` every table per size (round trips, one-way times, p99, ratios,
    floors), and the methods.

    One figure per cell, so that a table of seven sizes fits 100 columns; ``textfit``
    wraps and splits whatever is still wider (``fit_markdown``)."""
    mach = run.machine
    sizes = _sizes(run)
    ordered = _ordered(run)
    # Skipped methods show only in the "Methods" list; failed ones keep their row.
    sized = [m for m in ordered if m.fixed_nbytes is None and m.status != "skipped"]
    fixed = [m for m in ordered if m.fixed_nbytes is not None and m.cells]
    v = mach.get("versions", {})
    present = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    lines = [
        "# shmrdv bench",
        "",
        f"{run.started} · {mach.get('cpu_model')} · {mach.get('cpu_count')} CPUs "
        f"({mach.get('cpu_affinity')} usable) · {mach.get('kernel')} · {mach.get('python')}",
        f"{present} · {run.elapsed_s:.1f} s" + (" · INTERRUPTED" if run.interrupted else ""),
        "",
        f"Settings: {run.config.get('summary', '')}",
        "",
        *_keys_legend(run),
    ]
    if sized and sizes:
        lines += _summary(run, sized)  # it says the host's state
    else:
        lines += [f"Host: {_host(run)}", ""]
    if details:
        lines += _details(run, sized, fixed)
    lines += _methods_list(ordered)
    lines += [
        "",
        "Cells: medians of the per-repetition medians; p99 = the 99th percentile of "
        "every timed handoff. Round trip = the pinger's "
        "perf_counter_ns around one handoff (the array there, the ponger frees it, a 32-byte "
        "ack back by the method's own path). One-way = the ponger's arrival time minus the "
        "pinger's start (CLOCK_MONOTONIC is system-wide). GB/s = bytes / that median. "
        "memcpy has no second process: its round trip is the copy.",
        "",
    ]
    if not details:
        lines += [
            "More: every table per size (one-way times, p99, throughput, fixed cost, page "
            "faults, spread, every ratio) and the floors with --details; every figure with "
            "--json FILE.",
            "",
        ]
    return fit_markdown("\n".join(lines))


def _details(run: BenchRun, sized: list[MethodResult], fixed: list[MethodResult]) -> list[str]:
    """Every table per size, one figure per cell, and the floors at a fixed size."""
    sizes = _sizes(run) if sized else []  # only fixed-size floors ran: no per-size tables
    lines: list[str] = []

    def cell_rows(render: Any, methods: list[MethodResult] | None = None) -> list[list[str]]:
        rows = []
        for m in sized if methods is None else methods:
            row = [m.row]
            for n in sizes:
                c = m.cells.get(n)
                row.append(
                    render(m, n, c) if c is not None else (DASH if m.status == "ok" else m.status)
                )
            rows.append(row)
        return rows

    header = ["method · keys" if _keyed(run) else "method", *(format_size(n) for n in sizes)]

    def section(title: str, render: Any, methods: list[MethodResult] | None = None) -> list[str]:
        rows = cell_rows(render, methods)
        if not any(cell not in ("", DASH) for row in rows for cell in row[1:]):
            return []  # nothing to compare with in this run (memcpy not run, say)
        return [f"## {title}", "", *_table(header, rows), ""]

    if sizes:
        lines += section(
            "Round trip (the array there, the ack back): median",
            lambda m, n, c: format_time(c.rtt_median_ns),
        )
        lines += section("Round trip: p99", lambda m, n, c: format_time(c.rtt_p99_ns))
        lines += section(
            "One-way (until the ponger holds the array): median",
            lambda m, n, c: format_time(c.oneway_median_ns),
        )
        lines += section(
            "Throughput: size / median one-way, GB/s",
            lambda m, n, c: _gbps(n, c.oneway_median_ns).removesuffix(" GB/s"),
        )
        lines += section(
            f"Round trip {TIMES}{BASELINE_COPY}",
            lambda m, n, c: _times(run.ratio(m, n, BASELINE_COPY, "rtt")),
        )
        copying = [m for m in sized if m.name != BASELINE_COPY]
        lines += section(
            f"Fixed cost: round trip {DASH} one {BASELINE_COPY} of the same size (same run)",
            lambda m, n, c: _fixed(run.fixed_cost_ns(m, n)),
            copying,
        )
        if any(
            (cost := run.fixed_cost_ns(m, n)) is not None and cost < 0
            for m in copying
            for n in sizes
        ):
            lines += [FASTER_THAN_COPY_NOTE, ""]
        lines += section(
            "The consumer's minor page faults per handoff, after warm-up"
            + (" (it reads every byte: --touch)" if run.config.get("touch") else ""),
            lambda m, n, c: (
                DASH if c.consumer_faults_per_msg is None else f"{c.consumer_faults_per_msg:,.1f}"
            ),
        )
        lines += section(
            "Spread of the round trip's repetition medians (max/min)",
            lambda m, n, c: f"{c.rtt_spread:.2f}",
        )
        keyed = [m for m in sized if m.keys not in (None, "same")]
        if keyed and any(
            run.ratio_same_keys(m, n, "rtt") is not None for m in keyed for n in sizes
        ):
            lines += section(
                f"Round trip {TIMES}the same method with one key reused (· same)",
                lambda m, n, c: _times(run.ratio_same_keys(m, n, "rtt")),
                keyed,
            )
        for base, compared in [(BASELINE_PEER, sized)] + [
            (b, [m for m in sized if m.name == b or m.baseline == b]) for b in _baselines(run)
        ]:
            if len(compared) < 2 or not any(m.name == base for m in compared):
                continue
            for what, title in (("rtt", "Round trip"), ("oneway", "One-way")):
                lines += section(
                    f"{title} {TIMES}{base}",
                    lambda m, n, c, base=base, what=what: _times(run.ratio(m, n, base, what)),
                    compared,
                )
    if fixed:
        lines += ["## Floors at a fixed size", ""]
        rows = []
        for m in fixed:
            for n, c in sorted(m.cells.items()):
                rows.append(
                    [
                        m.name,
                        format_size(n),
                        format_time(c.rtt_median_ns),
                        format_time(c.rtt_p99_ns),
                        format_time(c.oneway_median_ns),
                        format_time(c.oneway_p99_ns),
                    ]
                )
        lines += _table(
            ["method", "size", "RTT median", "RTT p99", "one-way median", "one-way p99"], rows
        )
        lines.append("")
    return lines


# -- JSON ---------------------------------------------------------------------------------------


def to_json(run: BenchRun) -> dict[str, Any]:
    """Every figure of the run, ratios included, as plain JSON data."""
    methods = []
    for m in _ordered(run):
        d = asdict(m)
        cells = {}
        for n, c in sorted(m.cells.items()):
            cd = asdict(c)
            cd["rtt_spread"] = c.rtt_spread
            cd["gbps_oneway"] = n / c.oneway_median_ns if c.oneway_median_ns > 0 else None
            cd["gbps_rtt"] = n / c.rtt_median_ns if c.rtt_median_ns > 0 else None
            cd["rtt_fixed_cost_ns"] = run.fixed_cost_ns(m, n)
            bases = (BASELINE_COPY, BASELINE_PEER, *_summary_peers(m), m.baseline)
            for base in dict.fromkeys(b for b in bases if b is not None):
                for what in ("rtt", "oneway"):
                    cd[f"{what}_x_{base}"] = run.ratio(m, n, base, what)
            for what in ("rtt", "oneway"):
                cd[f"{what}_x_keys_same"] = run.ratio_same_keys(m, n, what)
            cells[str(n)] = cd
        d["cells"] = cells
        methods.append(d)
    return {
        "format": "shmrdv-bench/2",  # 2: a method once per key pattern, with "keys"
        "started": run.started,
        "elapsed_s": run.elapsed_s,
        "interrupted": run.interrupted,
        "machine": run.machine,
        "config": run.config,
        "units": {"time": "ns", "throughput": "GB/s = 1e9 B/s"},
        "methods": methods,
    }


def write_json(run: BenchRun, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_json(run), f, indent=1)
        f.write("\n")


# -- plot ---------------------------------------------------------------------------------------


def plot_run(run: BenchRun, path: str) -> None:
    """Median round trip against size, log-log, one line per method, into ``path``.

    Raises ``ImportError`` when matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    # More methods than a default colour cycle has colours: every line its own colour and
    # marker, shmrdv's own lines thick (tab20 has 20 colours, the markers cycle by 7).
    cmap = plt.get_cmap("tab20")
    colors = [cmap(k) for k in range(20)]
    markers = "osD^v<>"
    for i, m in enumerate(_ordered(run)):
        if not m.cells:
            continue
        xs = sorted(m.cells)
        ys = [m.cells[n].rtt_median_ns / 1000 for n in xs]
        style = "--" if m.group == "floor" else "-"
        ax.plot(
            xs,
            ys,
            style,
            color=colors[i % len(colors)],
            marker=markers[i % len(markers)],
            linewidth=2.4 if m.name.startswith("shmrdv") else 1.2,
            label=m.row,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("array size (bytes)")
    ax.set_ylabel("median round trip per handoff (µs)")
    ax.set_title(f"shmrdv bench · {run.machine.get('cpu_model')} · {run.started}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_mode(
    label: str,
    args: Any,
    make_config: Callable[[Any], Any],
    run: Callable[[Any, Callable[[str], None]], Any],
    fmt: Callable[[Any], str],
) -> int:
    """A whole-run mode of ``shmrdv bench`` (``--load``, ``--soak``): configure, run with a
    progress line on a terminal, print the report, write ``--json``.

    Returns 0 when the run's checks held (``result.ok``), 1 otherwise, 2 on bad options.
    """

    try:
        cfg = make_config(args)
        cfg.check()
    except ValueError as e:
        print(f"shmrdv bench --{label}: {e}", file=sys.stderr)
        return 2
    tty = sys.stderr.isatty()

    def progress(text: str) -> None:
        if tty:
            sys.stderr.write("\r\x1b[K" + text)
            sys.stderr.flush()

    result = run(cfg, progress)
    if tty:
        sys.stderr.write("\r\x1b[K")
    sys.stdout.write(fit_markdown(fmt(result)))
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: result.to_json(), "machine": describe_machine()}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if result.ok else 1
