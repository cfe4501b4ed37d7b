"""``shmrdv bench``: size parsing, and a tiny real run through tools/bench.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import REPO, run_bench, wait_for

from shmrdv._bench.common import format_size, parse_array_size, parse_sizes
from shmrdv._bench.contract import (
    Handler,
    MethodSpec,
    Ponger,
    RoleContext,
    make_stamp,
    pack_ack,
    unpack_ack,
)
from shmrdv._bench.methods import METHODS, register_method
from shmrdv._bench.options import build_parser
from shmrdv._bench.textfit import WIDTH


def _tagged_pids(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``tag``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_parse_size_suffixes() -> None:
    assert parse_array_size("64") == 64
    assert parse_array_size("1k") == 1024
    assert parse_array_size("16M") == 16 << 20
    assert parse_array_size("1g") == 1 << 30
    assert parse_array_size("64KiB") == 64 << 10
    assert parse_sizes("1m,64, 1k,1m") == [64, 1024, 1 << 20]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("", "e.g. 4096, 64k"),
        ("x", "e.g. 4096, 64k"),
        ("1q", "e.g. 4096, 64k"),
        ("10", "must be a multiple of 4 bytes"),
        ("4", "must be at least 8 bytes"),
    ],
)
def test_parse_size_rejects_bad_sizes(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_array_size(bad)


def test_sizes_print_whole_units_whole() -> None:
    assert [format_size(n) for n in (64, 1024, 1536, 16 << 20, 5 << 29)] == [
        "64 B",
        "1 KiB",
        "1.5 KiB",
        "16 MiB",
        "2.5 GiB",
    ]


@pytest.mark.parametrize(
    ("flag", "value", "valid"),
    [
        ("--reps", "0", "from 1 to 1,000"),
        ("--reps", "x", "from 1 to 1,000"),
        ("--budget", "0", "above 0 and up to 3600"),
        ("--budget", "-1", "above 0 and up to 3600"),
        ("--gap-us", "-5", "from 0 to 1e+06"),
        ("--idle-seconds", "601", "from 0 to 600"),
        ("--sizes", "1k,10", "multiple of 4"),
        ("--sizes", "1k,6", "at least 8 bytes"),
        ("--sizes", "32g", "16 GiB"),
        ("--sizes", ",", "no sizes"),
        ("--load-messages", "0", "from 1 to"),
        ("--load-producers", "257", "from 1 to 256"),
        ("--load-keys", "0", "from 1 to"),
        ("--load-max-size", "4x", "e.g. 4096, 64k"),
        ("--load-window", "0", "at least 8"),
        ("--load-seed", "-1", "from 0 to"),
        ("--soak", "0", "from 1 to"),
        ("--soak-max-size", "3", "at least 8"),
    ],
)
def test_options_out_of_range_is_a_usage_error_naming_the_range(
    flag: str, value: str, valid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    parser = build_parser(argparse.ArgumentParser(prog="shmrdv bench"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--quick", f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and valid in err, err


def test_cli_reps_0_is_a_usage_error() -> None:
    # Before: --quick --reps 0 ran 16 s and died with ZeroDivisionError in a child.
    for cmd in (
        [sys.executable, "-m", "shmrdv", "bench", "--quick", "--reps", "0"],
        [sys.executable, str(REPO / "tools" / "bench.py"), "--quick", "--reps", "0"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
        assert proc.returncode == 2, proc.stderr
        assert "argument --reps: 0 is out of range (give an integer from 1 to 1,000)" in (
            proc.stderr
        )
        assert proc.stdout == "" and "Traceback" not in proc.stderr


def test_handler_echoes_stamps_and_crc() -> None:
    import zlib

    import numpy as np

    from shmrdv._bench.contract import KIND_CHECK, KIND_STOP

    a = np.arange(16, dtype=np.float32)
    stamp = make_stamp(7, KIND_CHECK)
    a[0] = a[-1] = stamp
    h = Handler()
    ack = unpack_ack(pack_ack(h(a)))
    assert (ack.head, ack.tail, ack.extra) == (stamp, stamp, zlib.crc32(a.tobytes()))
    assert not h.done
    a[0] = a[-1] = make_stamp(8, KIND_STOP)
    h(a)
    assert h.done


def test_registry_has_the_peers() -> None:
    names = ("memcpy", "mp_pipe_oob", "mp_queue", "shm_per_msg", "grpc_push", "grpc_pull")
    names += ("grpc_pull_piggyback",)
    for name in (*names, "sem_pingpong", "memcpy_shm"):
        assert METHODS[name].available() is None, name
    for name in ("zmq_ipc", "torch_mp", "ray"):
        assert name in METHODS


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_bench_tiny_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    tag = f"SHMRDV_BENCH_TEST_TAG={uuid.uuid4().hex}"
    plot = importlib.util.find_spec("matplotlib") is not None
    cmd = [
        sys.executable,
        str(REPO / "tools" / "bench.py"),
        "--methods=memcpy,memcpy_shm,mp_pipe_oob,sem_pingpong",
        "--sizes=1k,64k",
        "--reps=2",
        "--budget=0.05",
        "--idle-seconds=0.2",
        "--details",
        f"--json={out}",
    ]
    if plot:
        cmd.append(f"--plot={tmp_path / 'bench.png'}")
    env = {**os.environ, tag.split("=")[0]: tag.split("=")[1]}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "## Round trip" in proc.stdout and "| mp_pipe_oob |" in proc.stdout

    data = json.loads(out.read_text())
    machine = data["machine"]
    for field in ("cpu_model", "cpu_count", "kernel", "python", "load_average_start"):
        assert field in machine
    assert machine["versions"]["numpy"] and machine["load_average_end"] is not None
    methods = {m["name"]: m for m in data["methods"]}
    assert {n: m["status"] for n, m in methods.items()} == dict.fromkeys(
        ("memcpy", "memcpy_shm", "mp_pipe_oob", "sem_pingpong"), "ok"
    )
    for name in ("memcpy", "memcpy_shm", "mp_pipe_oob"):
        assert sorted(methods[name]["cells"]) == ["1024", "65536"]
    for size in ("1024", "65536"):
        copy = methods["memcpy"]["cells"][size]
        pipe = methods["mp_pipe_oob"]["cells"][size]
        assert copy["rtt_x_memcpy"] == pytest.approx(1.0)
        assert pipe["rtt_x_mp_pipe_oob"] == pytest.approx(1.0)
        assert pipe["rtt_x_memcpy"] > 1.0
        assert pipe["rtt_median_ns"] >= pipe["oneway_median_ns"] > 0
        assert pipe["rtt_p99_ns"] >= pipe["rtt_min_ns"] > 0
        assert pipe["reps"] == 2 and pipe["checks"] == 4 and pipe["per_rep"] >= 3
        assert pipe["gbps_oneway"] == pytest.approx(int(size) / pipe["oneway_median_ns"])
        assert pipe["rtt_fixed_cost_ns"] == pytest.approx(
            pipe["rtt_median_ns"] - copy["rtt_median_ns"]
        )
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) >= 2:  # --pin is on by default: producer and consumer on two CPUs
        assert data["config"]["pin_cpus"] == usable[:2]
        for name in ("mp_pipe_oob", "sem_pingpong"):
            assert methods[name]["cpus"] == {"pinger": usable[:1], "ponger": usable[1:2]}
        assert methods["memcpy"]["cpus"]["pinger"] == usable[:1]
    assert "## Round trip: p99" in proc.stdout and "## Fixed cost: round trip" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= WIDTH
    assert list(methods["sem_pingpong"]["cells"]) == ["64"]
    assert 0 <= methods["mp_pipe_oob"]["idle_cpu_percent"] < 50
    if plot:
        assert (tmp_path / "bench.png").stat().st_size > 0

    prefix = data["config"]["prefix"]
    assert not [e for e in os.listdir("/dev/shm") if prefix in e]
    # The runner's resource tracker notices the runner's exit a moment later.
    wait_for(lambda: _tagged_pids(tag.split("=")[1]) == [], 5, "the runner's children gone", 0.05)


@pytest.mark.timeout(60)
def test_python_cost_reports_every_operation_against_pickle(tmp_path: Path) -> None:
    out = tmp_path / "pc.json"
    proc = run_bench("--python-cost", "--python-cost-count=50", "--reps=1", f"--json={out}")
    assert proc.returncode == 0, proc.stderr
    assert "shmrdv `recv` (value already there)" in proc.stdout
    data = json.loads(out.read_text())["python-cost"]
    ops = data["ops"]
    assert set(ops) == {"shmrdv_send", "shmrdv_recv", "pipe_send", "pipe_recv", "pickle"}
    for op in ops.values():
        assert op["p99_ns"] >= op["median_ns"] > 0 and op["mean_ns"] > 0
        assert len(op["round_means_ns"]) == 1 and op["x_pickle"] > 0
    assert ops["pickle"]["x_pickle"] == pytest.approx(1.0)
    assert ops["pickle"]["x_pickle_median"] == pytest.approx(1.0)
    assert data["config"]["count"] == 50 and data["pipe_batch"] >= 1
    usable = sorted(os.sched_getaffinity(0))
    assert data["cpus"] == (usable[:2] if len(usable) >= 2 else None)


def test_modes_are_separate_runs() -> None:
    proc = run_bench("--python-cost", "--load")
    assert proc.returncode == 2
    assert "--load and --python-cost are separate runs" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_grpc_methods_are_compared_with_the_pull(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    # grpc_unary is the push's old name; the pull is added as its baseline.
    proc = run_bench(
        "--details",
        "--methods=grpc_unary",
        "--sizes=1k,64k",
        "--reps=1",
        "--budget=0.02",
        "--idle-seconds=0",
        f"--json={out}",
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "## Round trip \u00d7grpc_pull" in proc.stdout
        and "## One-way \u00d7grpc_pull" in proc.stdout
    )
    methods = {m["name"]: m for m in json.loads(out.read_text())["methods"]}
    # The two-call pull is compared with the one-call pull in turn.
    assert set(methods) == {
        "memcpy",
        "mp_pipe_oob",
        "grpc_pull",
        "grpc_pull_piggyback",
        "grpc_push",
    }
    assert all(m["status"] == "ok" for m in methods.values())
    assert methods["grpc_push"]["baseline"] == "grpc_pull"
    assert methods["grpc_pull"]["baseline"] == "grpc_pull_piggyback"
    for size in ("1024", "65536"):
        push = methods["grpc_push"]["cells"][size]
        pull = methods["grpc_pull"]["cells"][size]
        one_call = methods["grpc_pull_piggyback"]["cells"][size]
        assert push["rtt_x_grpc_pull"] == pytest.approx(
            push["rtt_median_ns"] / pull["rtt_median_ns"]
        )
        assert pull["rtt_x_grpc_pull_piggyback"] == pytest.approx(
            pull["rtt_median_ns"] / one_call["rtt_median_ns"]
        )
        for cell in (pull, one_call):
            assert cell["checks"] == 2 and cell["oneway_median_ns"] > 0


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_pending_compares_with_no_pending_in_the_same_run(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = ("--sizes=64", "--reps=1", "--budget=0.02", "--idle-seconds=0", "--no-baselines")
    proc = run_bench("--pending=20", "--details", *args, f"--json={out}")
    assert proc.returncode == 0, proc.stderr
    assert "## Round trip \u00d7shmrdv_send" in proc.stdout
    data = json.loads(out.read_text())
    assert data["config"]["pending"] == 20
    methods = {m["name"]: m for m in data["methods"]}
    assert {n: m["status"] for n, m in methods.items()} == {
        "shmrdv_send": "ok",
        "shmrdv_send_pending": "ok",
    }
    cell = methods["shmrdv_send_pending"]["cells"]["64"]
    assert cell["rtt_x_shmrdv_send"] > 0 and cell["checks"] == 2
    # A method of the mode needs the mode.
    proc = run_bench("--methods=shmrdv_send_pending", *args)
    assert proc.returncode == 2 and "need --pending" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_fan_in_measures_send_and_allocate_against_memcpy(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    proc = run_bench("--fan-in=2", "--sizes=64k", "--fan-in-count=6", "--reps=1", f"--json={out}")
    assert proc.returncode == 0, proc.stderr
    assert "| `allocate`, two stamps written, `send` |" in proc.stdout
    data = json.loads(out.read_text())["fan-in"]
    assert data["config"]["producers"] == 2 and data["config"]["nbytes"] == 64 << 10
    paths = ("send", "allocate", "allocate_fill")
    assert set(data["gbps"]) == set(paths) and data["memcpy_gbps"] > 0
    for path in paths:
        assert len(data["round_gbps"][path]) == 1
        assert data["x_memcpy"][path] == pytest.approx(data["gbps"][path] / data["memcpy_gbps"])
    proc = run_bench("--fan-in=2", "--sizes=1k,64k")
    assert proc.returncode == 2 and "--fan-in takes one size" in proc.stderr


def _planted_ponger_failure(ctx: RoleContext) -> Ponger:
    raise ValueError("planted ponger failure")


def test_a_failing_role_fails_its_method_with_the_cause(tmp_path: Path) -> None:
    from shmrdv._bench import runner

    register_method(
        MethodSpec(
            name="planted_failure",
            label="a ponger that raises while it starts",
            pinger=METHODS["mp_pipe_oob"].pinger,
            ponger=_planted_ponger_failure,
        )
    )
    out = tmp_path / "bench.json"
    try:
        status = runner.main(
            [
                "--methods=planted_failure",
                "--no-baselines",
                "--sizes=1k",
                "--reps=1",
                "--budget=0.05",
                "--idle-seconds=0",
                f"--json={out}",
            ]
        )
    finally:
        del METHODS["planted_failure"]
    assert status == 1
    (method,) = json.loads(out.read_text())["methods"]
    assert method["status"] == "failed"
    # The ponger's traceback, or the pinger's (its link closed) naming the ponger's death.
    reason = method["reason"]
    assert "ValueError: planted ponger failure" in reason or (
        "the ponger had died first: exit code 1" in reason
    ), reason


# -- iceoryx2, --touch, --syscalls, shmrdv_busy (issue 18 §4) --------------------------------

_HAS_IOX = importlib.util.find_spec("iceoryx2") is not None
_IOX_METHODS = ("iceoryx2_send", "iceoryx2_loan", "iceoryx2_poll_send", "iceoryx2_poll_loan")


def _load_methods() -> dict[str, MethodSpec]:
    from shmrdv._bench.selection import registered_methods

    return registered_methods()


def test_iceoryx2_methods_are_registered_with_their_shmrdv_twins() -> None:
    methods = _load_methods()
    twins = dict(
        zip(_IOX_METHODS, ("shmrdv_send", "shmrdv_allocate", "shmrdv_busy", "shmrdv_busy_allocate"))
    )
    for name, twin in twins.items():
        assert methods[name].baseline == twin and twin in methods
        assert (methods[name].available() is None) == _HAS_IOX
        assert "read-only" in methods[name].receiver_array
    assert methods["shmrdv_busy"].baseline == "shmrdv_send"


@pytest.mark.skipif(not _HAS_IOX, reason="iceoryx2 not installed")
@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", _IOX_METHODS)
def test_iceoryx2_hands_the_array_over_as_a_read_only_view(method: str, tmp_path: Path) -> None:
    # Both roles in this process (the ponger on a thread: iceoryx2's waits release the GIL),
    # over real iceoryx2 services in /dev/shm.
    import gc
    import multiprocessing
    import tempfile
    import threading
    import zlib
    from typing import Any

    import numpy as np

    from shmrdv._bench.contract import KIND_CHECK, KIND_STOP, KIND_TIMED
    from shmrdv._bench.iceoryx_methods import iceoryx_pinger, iceoryx_ponger, iceoryx_sweep

    prefix = f"shmrdv_benchtest{os.getpid()}_"
    a_end, b_end = multiprocessing.Pipe()
    seen: list[tuple[bool, int]] = []

    class Recording(Handler):
        def __call__(self, a: Any) -> Any:
            seen.append((a.flags.writeable, a.nbytes))
            return super().__call__(a)

    # Not tmp_path: a listener's socket path must fit in 107 bytes.
    scratch = tempfile.mkdtemp(prefix="iox")

    def ctx(role: str, link: Any) -> RoleContext:
        return RoleContext(role, method, link, {}, prefix, scratch, 1 << 16)

    roles: dict[str, Any] = {"ponger": iceoryx_ponger(ctx("ponger", b_end))}
    errors: list[BaseException] = []

    def serve(ponger: Any) -> None:
        try:
            ponger.serve(Recording(touch=True))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=serve, args=(roles["ponger"],), daemon=True)
    thread.start()
    try:
        roles["pinger"] = pinger = iceoryx_pinger(ctx("pinger", a_end))
        handoffs = [(64, KIND_CHECK), (1 << 16, KIND_TIMED), (1 << 16, KIND_CHECK), (64, KIND_STOP)]
        for seq, (nbytes, kind) in enumerate(handoffs, 1):
            src = np.random.default_rng(seq).random(nbytes // 4, dtype=np.float32)
            src[0] = src[-1] = make_stamp(seq, kind)
            pinger.prepare(src)
            ack = pinger.handoff(src)
            assert (ack.head, ack.tail) == (make_stamp(seq, kind),) * 2
            if kind == KIND_CHECK:
                assert ack.extra == zlib.crc32(src.data)
            elif kind == KIND_TIMED:  # --touch: the largest byte of the array, read in full
                assert ack.extra == int(src.view(np.uint8).max())
        del pinger
        thread.join(10)
        assert not thread.is_alive() and not errors, errors
    finally:
        for role in roles.values():
            role.close()
        roles.clear()
        a_end.close()
        b_end.close()
        shutil.rmtree(scratch, ignore_errors=True)
    assert seen == [(False, 64), (False, 1 << 16), (False, 1 << 16), (False, 64)]
    gc.collect()  # the nodes go with the last reference; their files with them
    iceoryx_sweep(prefix, {})
    assert [e for e in os.listdir("/dev/shm") if e.startswith(prefix)] == []


@pytest.mark.skipif(not _HAS_IOX, reason="iceoryx2 not installed")
def test_iceoryx2_reserves_every_possible_sample_up_front() -> None:
    # The README's claim: a 16 MiB service sized by iceoryx2's defaults is a 34-slot file.
    from shmrdv._bench.iceoryx_methods import reserved_bytes

    mib16 = 16 << 20
    by_default = reserved_bytes(mib16, defaults=True)
    ours = reserved_bytes(mib16, defaults=False)
    assert 34 * mib16 <= by_default < 35 * mib16
    assert 3 * mib16 <= ours < 4 * mib16


@pytest.mark.skipif(not _HAS_IOX, reason="iceoryx2 not installed")
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_iceoryx2_runs_beside_its_shmrdv_twins(tmp_path: Path) -> None:
    out = tmp_path / "i.json"
    proc = run_bench(
        "--methods=iceoryx2_send,iceoryx2_loan,iceoryx2_poll_send",
        "--sizes=64,64k",
        "--reps=1",
        "--budget=0.02",
        "--idle-seconds=0.1",
        "--touch",
        "--details",
        f"--json={out}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "## Round trip \u00d7shmrdv_send" in proc.stdout
    assert "(it reads every byte: --touch)" in proc.stdout
    data = json.loads(out.read_text())
    methods = {m["name"]: m for m in data["methods"]}
    for name in ("iceoryx2_send", "iceoryx2_loan", "iceoryx2_poll_send", "shmrdv_send"):
        assert methods[name]["status"] == "ok", methods[name]
        for cell in methods[name]["cells"].values():
            assert cell["checks"] == 2 and cell["consumer_faults_per_msg"] >= 0
    assert methods["iceoryx2_send"]["idle_cpu_percent"] is not None
    assert methods["iceoryx2_poll_send"]["idle_cpu_percent"] is None  # it spins: not probed
    assert not [e for e in os.listdir("/dev/shm") if data["config"]["prefix"] in e]
    assert "swept" not in proc.stderr  # iceoryx2's own leftover is its method's to remove


_HANDOFF_FLOORS = ("sem_copy", "sem_fill", "spin_copy", "spin_fill")


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_handoff_floors_move_every_size_beside_the_shmrdv_method_they_floor(
    tmp_path: Path,
) -> None:
    out = tmp_path / "f.json"
    proc = run_bench(
        f"--methods={','.join(_HANDOFF_FLOORS)}",
        "--details",
        "--sizes=64,1m",
        "--reps=1",
        "--budget=0.02",
        "--idle-seconds=0.1",
        f"--json={out}",
        timeout=80,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    methods = {m["name"]: m for m in data["methods"]}
    twins = {
        "sem_copy": "shmrdv_send",
        "sem_fill": "shmrdv_allocate",
        "spin_copy": "shmrdv_busy",
        "spin_fill": "shmrdv_busy_allocate",
    }
    for floor, twin in twins.items():
        assert methods[floor]["status"] == "ok", methods[floor]
        assert methods[twin]["status"] == "ok", methods[twin]  # added as its baseline
        assert f"## Round trip \u00d7{twin}" in proc.stdout
        for size in ("64", "1048576"):
            cell = methods[floor]["cells"][size]
            # The CRC check handoffs compared the ponger's view with what was sent.
            assert cell["checks"] == 2 and cell["rtt_median_ns"] > 0
    assert methods["sem_copy"]["idle_cpu_percent"] is not None
    assert methods["spin_copy"]["idle_cpu_percent"] is None  # it spins: not probed
    assert not [e for e in os.listdir("/dev/shm") if data["config"]["prefix"] in e]
    assert "swept" not in proc.stderr  # each floor removed its own segment and semaphores


def test_touch_reads_every_byte_and_faults_are_counted() -> None:
    import mmap

    import numpy as np

    from shmrdv._bench.contract import KIND_FAULTS

    probe = np.zeros(16, np.float32)
    probe[0] = probe[-1] = make_stamp(1, KIND_FAULTS)
    faults = {}
    for touch in (False, True):
        h = Handler(touch=touch)
        with mmap.mmap(-1, 1 << 20) as mm:  # shared anonymous: fresh pages, faulted on read
            fresh = np.frombuffer(mm, np.float32)
            fresh[0] = fresh[-1] = make_stamp(2, KIND_FAULTS)
            before = h(probe).extra
            after = h(fresh).extra
            del fresh
        faults[touch] = after - before
    # 1 MiB is 256 pages; the kernel maps shared memory up to 16 pages per fault.
    assert faults[True] >= 12 and faults[False] <= 6, faults


def test_parse_strace_summary_counts_calls_per_name() -> None:
    from shmrdv._bench.syscalls import parse_strace_summary

    text = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 81.40    0.083195        1039        80        40 futex
  2.79    0.002851           2      1374           read
  0.00    0.000000           0         6           chdir
------ ----------- ----------- --------- --------- ----------------
100.00    0.102209          11      1460        40 total
"""
    assert parse_strace_summary(text) == {"futex": 80, "read": 1374, "chdir": 6}


def test_syscalls_skip_where_strace_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shmrdv._bench.syscalls import count_handoff_syscalls

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no strace on PATH
    c = count_handoff_syscalls("sem_pingpong", 64, 40, pin=None)
    assert c.status == "skipped" and "strace not found" in (c.reason or "")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_syscalls_counts_the_semaphore_floor(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    proc = run_bench("--syscalls=200", "--methods=sem_pingpong", f"--json={out}", timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert "| sem_pingpong | 64 B |" in proc.stdout
    (count,) = json.loads(out.read_text())["syscalls"]
    # A post and a wait each way, at most; a wait that finds the post there needs no futex
    # call (how often depends on timing: 1.32 per round trip was seen in CI), but some do.
    assert count["status"] == "ok" and 0.2 <= count["futex_per_round_trip"] <= 6
    assert count["per_message"] == pytest.approx(count["per_round_trip"] / 2)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_shmrdv_busy_runs_or_names_the_missing_option(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    proc = run_bench(
        "--methods=shmrdv_busy,shmrdv_busy_allocate",
        "--no-baselines",
        "--sizes=64,64k",
        "--reps=1",
        "--budget=0.02",
        "--idle-seconds=0.3",
        f"--json={out}",
    )
    assert proc.returncode == 0, proc.stderr
    methods = {m["name"]: m for m in json.loads(out.read_text())["methods"]}
    import inspect

    import shmrdv

    if "busy_poll" not in inspect.signature(shmrdv.Worker).parameters:
        for m in methods.values():
            assert m["status"] == "skipped" and "no busy_poll option" in m["reason"]
        return
    for m in methods.values():
        assert m["status"] == "ok", m
        assert sorted(m["cells"]) == ["64", "65536"]
        # It polls 0.1 s after a handoff, then blocks: a 0.3 s idle probe is well below 100 %.
        assert m["idle_cpu_percent"] < 80


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_bench_children_log_no_grpc_goaway() -> None:
    # Before: gRPC core printed "chttp2_transport.cc:1403] ... Got goaway [2] ... Cancelling
    # all calls" in 4 runs of 6, when one role's Worker stopped its server first.
    for _ in range(2):
        proc = run_bench(
            "--methods=shmrdv_grpc",
            "--no-baselines",
            "--sizes=64",
            "--reps=1",
            "--budget=0.02",
            "--idle-seconds=0",
            timeout=40,
        )
        assert proc.returncode == 0, proc.stderr
        assert "goaway" not in proc.stderr.lower() and "chttp2" not in proc.stderr, proc.stderr
        assert max(len(line) for line in proc.stderr.splitlines()) <= WIDTH, proc.stderr


def test_grpc_quiet_children_sets_the_verbosity_only_while_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shmrdv._bench.common import grpc_quiet_children

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    with grpc_quiet_children():
        code = "import os; print(os.environ.get('GRPC_VERBOSITY'))"
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=30
        )
        assert child.stdout.strip() == "ERROR"
    assert "GRPC_VERBOSITY" not in os.environ
    monkeypatch.setenv("GRPC_VERBOSITY", "DEBUG")  # the user's own choice is kept
    with grpc_quiet_children():
        assert os.environ["GRPC_VERBOSITY"] == "DEBUG"
    assert os.environ["GRPC_VERBOSITY"] == "DEBUG"


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_pipeline_measures_shmrdv_against_a_raw_grpc_stream(tmp_path: Path) -> None:
    out = tmp_path / "pl.json"
    proc = run_bench(
        "--pipeline", "--pipeline-cases=1k:30,64k:8", "--reps=2", f"--json={out}", timeout=80
    )
    assert proc.returncode == 0, proc.stderr
    assert "## Throughput: MB/s (median of rounds) · tensors/s" in proc.stdout
    assert "goaway" not in proc.stderr.lower(), proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= WIDTH
    data = json.loads(out.read_text())["pipeline"]
    assert data["config"]["cases"] == [[1024, 30], [65536, 8]]
    names = ("grpc_stream", "shmrdv_grpc", "shmrdv_shm")
    assert data["status"] == {n: {"status": "ok", "failure": None} for n in names}
    usable = sorted(os.sched_getaffinity(0))
    assert data["config"]["pin"] == (usable[:2] if len(usable) >= 2 else None)
    for key, (nbytes, count) in (("1024x30", (1024, 30)), ("65536x8", (65536, 8))):
        case = data["cases"][key]
        assert (case["nbytes"], case["count"]) == (nbytes, count)
        base = case["methods"]["grpc_stream"]
        assert base["x_grpc_stream"] == pytest.approx(1.0)
        for m in case["methods"].values():
            assert len(m["round_mbps"]) == 2 and m["mbps"] > 0
            assert m["tensors_per_s"] == pytest.approx(m["mbps"] * 1e6 / nbytes)
            assert m["x_grpc_stream"] == pytest.approx(m["mbps"] / base["mbps"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pipeline-cases=64k"], "give SIZE:COUNT"),
        (["--pipeline-cases=64k:0"], "count must be 1 to 1,000,000"),
        (["--pipeline-cases=6:10"], "at least 8 bytes"),
        (["--methods=grpc_pull"], "unknown pipeline method(s) grpc_pull"),
    ],
)
def test_pipeline_bad_options_are_usage_errors(argv: list[str], message: str) -> None:
    proc = run_bench("--pipeline", *argv)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["grpc_pull", "grpc_pull_piggyback"])
def test_grpc_pull_serves_the_array_as_it_is_at_each_handoff(method: str) -> None:
    # The raw pull pays one tobytes() of the array per handoff, like a producer with a new
    # tensor each time: change the array's contents, and the next handoff carries them (a
    # prebuilt payload would not). grpc_pull's ack comes back in a call of its own,
    # grpc_pull_piggyback's in the next pull.
    import multiprocessing
    import threading
    import zlib

    import numpy as np

    from shmrdv._bench.contract import KIND_CHECK, KIND_STOP

    near, far = multiprocessing.Pipe()
    spec = METHODS[method]
    assert spec.ponger is not None

    def ctx(role: str, link: object) -> RoleContext:
        return RoleContext(role, method, link, {}, "t_", "/tmp", 1 << 16)  # type: ignore[arg-type]

    pinger = spec.pinger(ctx("pinger", near))
    handler = Handler()
    failures: list[BaseException] = []

    def ponger_main() -> None:
        assert spec.ponger is not None
        try:
            ponger = spec.ponger(ctx("ponger", far))
            try:
                ponger.serve(handler)
            finally:
                ponger.close()
        except BaseException as e:  # reported below
            failures.append(e)

    thread = threading.Thread(target=ponger_main, daemon=True)
    thread.start()
    try:
        src = np.arange(16384, dtype=np.float32)
        for seq in range(1, 4):
            src[1:-1] = seq  # new contents each time
            src[0] = src[-1] = make_stamp(seq, KIND_CHECK)
            ack = pinger.handoff(src)
            assert ack.extra == zlib.crc32(src.tobytes()), seq
        src[0] = src[-1] = make_stamp(9, KIND_STOP)
        pinger.handoff(src)
    finally:
        pinger.close()
        thread.join(30)
        near.close()
        far.close()
    assert not thread.is_alive() and not failures, failures
