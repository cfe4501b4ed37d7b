"""``shmrdv bench``'s report as text (issue 20 §4): narrow lines, no negative fixed cost.

Pure: a ``BenchRun`` is built by hand (the figures of a real run with every method and
the seven default sizes) and formatted; nothing is measured.
"""

from __future__ import annotations

import re

import pytest

from shmrdv._bench.report import (
    FASTER_THAN_COPY,
    format_markdown,
    format_range,
    format_time,
    to_json,
)
from shmrdv._bench.results import BenchRun, CellResult, MethodResult
from shmrdv._bench.textfit import WIDTH, fit_markdown, split_table, wrap_line

SIZES = [64, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def _cell(nbytes: int, rtt_ns: float) -> CellResult:
    return CellResult(
        nbytes=nbytes,
        reps=3,
        per_rep=100,
        warmup=3,
        checks=6,
        rtt_median_ns=rtt_ns,
        rtt_p99_ns=rtt_ns * 13.7,
        rtt_min_ns=rtt_ns * 0.8,
        rtt_rep_medians_ns=[rtt_ns, rtt_ns * 1.1, rtt_ns * 0.9],
        oneway_median_ns=rtt_ns * 0.6,
        oneway_p99_ns=rtt_ns * 7.1,
        oneway_rep_medians_ns=[rtt_ns * 0.6] * 3,
        elapsed_s=1.0,
    )


def _method(
    name: str, group: str, per_byte_ns: float, fixed_ns: float, **kw: object
) -> MethodResult:
    m = MethodResult(
        name=name,
        label=f"{name}: a label as long as the longest of the registry, which names the call, "
        "the direction and the serializers, and then some more words",
        group=group,
        status="ok",
        receiver_array="writable view (segment unlinked after use), the consumer's own",
        idle_cpu_percent=0.26,
        **kw,  # type: ignore[arg-type]
    )
    m.cells = {n: _cell(n, fixed_ns + per_byte_ns * n) for n in SIZES}
    return m


def _run() -> BenchRun:
    run = BenchRun(
        machine={
            "cpu_model": "AMD EPYC 7B13 64-Core Processor with a long brand string",
            "cpu_count": 2,
            "cpu_affinity": 2,
            "kernel": "Linux 6.18.44-fc-v1252",
            "python": "CPython 3.11.7",
            "versions": {
                "numpy": "2.4.6",
                "grpcio": "1.85.3",
                "protobuf": "7.36.2",
                "posix_ipc": "1.3.2",
                "pyzmq": "27.3.0",
                "torch": "2.13.0",
                "ray": "2.60.0",
                "matplotlib": "3.10.1",
            },
            "load_average_start": [2.01, 1.19, 0.54],
            "load_average_end": [2.5, 1.3, 0.6],
        },
        config={
            "sizes": SIZES,
            "summary": "sizes "
            + ", ".join(str(n) for n in SIZES)
            + "; repetitions 5 (3 from 64 MiB); 2 s of timed handoffs per cell; 50 µs gap; "
            "pinger (producer) on CPU 0, ponger (consumer) on CPU 1; one-process methods on "
            "CPU 0; idle probe 2 s",
        },
        started="2026-12-04 05:08:00 UTC",
    )
    run.methods = [
        _method("memcpy", "floor", 0.06, 2_000),
        _method("shmrdv_send", "shmrdv", 0.05, 200_000),  # helper threads: under memcpy at 256 MiB
        _method("shmrdv_allocate", "shmrdv", 0.0, 200_000),  # no copy at all
        _method("shmrdv_grpc_pending", "shmrdv", 2.0, 1_400_000, baseline="grpc_pull"),
        _method("mp_pipe_oob", "peer", 1.4, 190_000),
        _method("grpc_pull", "peer", 1.0, 520_000),
    ]
    return run


def test_report_every_line_fits_the_width() -> None:
    text = format_markdown(_run())
    long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not long, "\n".join(long)  # before: rows of 432 characters


def test_report_shows_no_negative_fixed_cost() -> None:
    run = _run()
    allocate = run.method("shmrdv_allocate")
    assert allocate is not None
    assert run.fixed_cost_ns(allocate, 256 << 20) < 0  # the case: faster than a copy
    text = format_markdown(run)
    fixed = text.split("## Fixed cost")[1].split("\n## ")[0]
    assert not re.search(r"-\s*[\d,.]+ ?(µs|ms|s)\b", fixed), fixed  # before: "-11,964 µs"
    allocate = next(r for r in fixed.splitlines() if r.startswith("| shmrdv_allocate |"))
    assert FASTER_THAN_COPY in allocate
    assert f"{FASTER_THAN_COPY}: the round trip took less than one single-threaded memcpy" in (
        " ".join(text.split())
    )
    # The JSON keeps the signed difference: it is data, not a cost.
    cells = {m["name"]: m["cells"] for m in to_json(run)["methods"]}
    assert cells["shmrdv_allocate"][str(256 << 20)]["rtt_fixed_cost_ns"] < 0


def test_report_keeps_every_figure_of_every_size() -> None:
    text = format_markdown(_run())
    for title in ("Round trip (the array there", "Round trip: p99", "One-way (until"):
        section = text.split(f"## {title}")[1].split("\n## ")[0]
        rows = [r for r in section.splitlines() if r.startswith("| shmrdv_grpc_pending |")]
        cells = [c for r in rows for c in r.strip("|").split("|")[1:]]
        assert len(cells) == len(SIZES), section  # split tables keep every column
    assert "## Round trip \u00d7grpc_pull" in text and "## One-way \u00d7mp_pipe_oob" in text


def test_format_time_picks_a_short_unit() -> None:
    assert [format_time(ns) for ns in (2_200, 812_000, 1_370_000, 447e6, 1.17e9)] == [
        "2.20 µs",
        "812 µs",
        "1.37 ms",
        "447 ms",
        "1.17 s",
    ]


def test_wrap_line_indents_a_list_items_continuation() -> None:
    line = "* `grpc_pull` (ok): " + "word " * 40
    out = wrap_line(line, 50)
    assert len(out) > 1 and all(len(x) <= 50 for x in out)
    assert out[0].startswith("* `grpc_pull`") and all(x.startswith("  ") for x in out[1:])
    assert " ".join(" ".join(out).split()) == " ".join(line.split())


def test_split_table_repeats_the_first_column() -> None:
    header = "| method | " + " | ".join(f"size{i}" for i in range(10)) + " |"
    rule = "|" + "---|" * 11
    row = "| shmrdv_allocate | " + " | ".join(f"{i}.{i}{i} ms" for i in range(10)) + " |"
    out = split_table([header, rule, row], 60)
    assert all(len(x) <= 60 for x in out)
    tables = "\n".join(out).split("\n\n")
    assert len(tables) > 1
    for t in tables:
        lines = t.splitlines()
        assert lines[0].startswith("| method |") and lines[2].startswith("| shmrdv_allocate |")
        assert set(lines[1]) == {"|", "-"}
    assert all(f"{i}.{i}{i} ms" in "\n".join(out) for i in range(10))


def test_fit_markdown_leaves_headings_and_code_alone() -> None:
    long = "x" * 150
    text = f"# {long}\n```\n{long}\n```\n{'word ' * 40}"
    out = fit_markdown(text, 80).splitlines()
    assert out[0] == f"# {long}" and out[2] == long
    assert all(len(x) <= 80 for x in out[4:])


def _summary_run() -> BenchRun:
    """A run with shmrdv's send under two key patterns, its gRPC path, and the summary's peers,
    on a host with two busy processes."""
    run = _run()
    run.config["sizes"] = [64, 1 << 20]
    run.config["host"] = {"state": "oversubscribed", "busy_processes": 2, "busy_cpus": None}
    run.methods = [
        _method("memcpy", "floor", 0.06, 2_000),
        _method("shmrdv_send", "shmrdv", 0.05, 40_000, keys="same"),
        _method("shmrdv_send", "shmrdv", 0.05, 80_000, keys="fresh"),
        _method("shmrdv_grpc", "shmrdv", 1.0, 600_000, keys="same", baseline="grpc_pull"),
        _method("mp_pipe_oob", "peer", 1.4, 100_000),
        _method("mp_queue", "peer", 2.0, 120_000),
        _method("grpc_pull", "peer", 1.0, 500_000, baseline="grpc_pull_piggyback"),
        _method("grpc_pull_piggyback", "peer", 1.0, 400_000),
    ]
    return run


def test_summary_comes_first_with_ranges_keys_and_the_host() -> None:
    run = _summary_run()
    text = format_markdown(run, details=False)
    assert text.index("## Summary") < text.index("## Methods")
    assert "## Round trip" not in text and "--details" in text  # the rest on request
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert "Host: oversubscribed (2 busy processes); load average 2.01 → 2.5." in summary
    assert "Keys: same, fresh." in summary
    rows = {
        tuple(c.strip() for c in r.strip("|").split("|")[:2]): [c.strip() for c in r.split("|")]
        for r in summary.splitlines()
        if r.startswith("| 64 B")
    }
    assert set(rows) == {
        ("64 B", "shmrdv_send · same"),
        ("64 B", "shmrdv_send · fresh"),
        ("64 B", "shmrdv_grpc · same"),
        ("64 B", "mp_pipe_oob"),
        ("64 B", "mp_queue"),
        ("64 B", "grpc_pull"),
    }
    # shmrdv_send at 64 B: 40 µs + 3.2 ns; repetition medians x1, x1.1, x0.9: a range.
    send = rows[("64 B", "shmrdv_send · same")]
    assert send[3] == "40.0 µs (36.0\u201344.0)", send
    assert send[5:8] == ["\u00d70.400", "\u00d70.333", ""]  # x Pipe, x Queue, not x raw gRPC
    grpc = rows[("64 B", "shmrdv_grpc · same")]
    assert grpc[5:8] == ["", "", "\u00d71.20"]  # the gRPC path against the raw gRPC job
    assert (
        "* `shmrdv_send · fresh`: \u00d70.0845\u20130.799 a Pipe's round trip at 64 B\u20131 MiB"
        in (" ".join(text.split()))
    )
    fresh = rows[("64 B", "shmrdv_send · fresh")]
    assert fresh[8] == "\u00d72.00"  # x the same key: the same method with one key reused
    assert "faster at every size" in summary


def test_details_follow_the_summary_and_name_the_key_pattern() -> None:
    text = format_markdown(_summary_run(), details=True)
    assert text.index("## Summary") < text.index("## Round trip (the array there")
    assert "| shmrdv_send · fresh |" in text.split("## Round trip: p99")[1]
    same_keys = text.split("## Round trip \u00d7the same method with one key reused")[1]
    assert "| shmrdv_send · fresh | \u00d72.00 |" in same_keys.split("\n## ")[0]
    assert "## Round trip \u00d7grpc_pull_piggyback" in text
    methods = text.split("## Methods")[1]
    assert "* `shmrdv_send` · same, fresh (ok)" in methods
    data = to_json(_summary_run())
    runs = {(m["name"], m["keys"]): m for m in data["methods"]}
    fresh = runs[("shmrdv_send", "fresh")]["cells"]["64"]
    assert fresh["rtt_x_keys_same"] == pytest.approx(2.0, rel=1e-3)
    assert runs[("mp_pipe_oob", None)]["cells"]["64"]["rtt_x_keys_same"] is None
    assert data["config"]["host"]["state"] == "oversubscribed"


def test_format_range_shows_the_median_and_the_spread_in_one_unit() -> None:
    assert format_range(48_100, [45_200, 48_100, 52_300]) == "48.1 µs (45.2\u201352.3)"
    assert format_range(1_370_000, [975_000, 1_370_000, 1_400_000]) == "1.37 ms (0.975\u20131.40)"
    assert format_range(812_000, [812_000]) == "812 µs"
