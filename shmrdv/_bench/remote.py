"""``shmrdv bench --peer HOST:PORT``: the cross-host round trip against a ``shmrdv serve`` echo.

As iperf's client measures against ``iperf -s``: ``shmrdv serve --listen
HOST:PORT`` runs on one machine (``echo.EchoService``), this on another. Two methods, per
size, in the same run:

* ``shmrdv_grpc``: a ``shmrdv.Worker`` here (``echo.BENCH_TASK``) sends a float32 array on
  the echo key; the echo's Worker receives it (a pull over gRPC, TensorFlow's RecvTensor),
  sends it back, and the Worker here receives it (another pull). The session's two Workers
  are forced over gRPC; the echo side learns this host's address from the ``Open`` call.
* ``grpc_echo``, the baseline: one raw grpcio unary call to the echo's ``Raw`` method with
  the array's bytes (one ``tobytes()`` per call), answered with the same bytes: the same
  data over the same network with nothing of shmrdv.

A cell is ``reps`` repetitions of as many round trips as fit the budget, each repetition
framed by two round trips whose whole array is compared with what was sent; every round
trip checks the stamps in the first and last element. Figures: the median of the
repetitions' medians, the p99 of every timed round trip, and GB/s = 2 x size / median (the
array crosses twice). One-way times are not measured: two hosts have two clocks. The
measuring process is a ``shmrdv._procs.Child`` of the command.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from .._procs import Child, ChildFailed
from .common import GRPC_OPTIONS, format_size, parse_sizes
from .echo import (
    BENCH_TASK,
    CLOSE_METHOD,
    ECHO_TASK,
    MAX_MESSAGE,
    OPEN_METHOD,
    RAW_METHOD,
    echo_keys,
)
from .echo import STEP as ECHO_STEP
from .report import DASH, TIMES, format_sig, format_time

__all__ = [
    "DEFAULT_SIZES",
    "METHODS",
    "RemoteConfig",
    "RemoteResult",
    "config_from_args",
    "format_remote",
    "run_cli",
    "run_remote",
]

BASELINE = "grpc_echo"
METHODS = ("shmrdv_grpc", BASELINE)
LABELS = {
    "shmrdv_grpc": "shmrdv Workers on both hosts forced over gRPC: send, the echo's recv "
    "and send back, recv here (two RecvTensor pulls)",
    BASELINE: "one raw grpcio unary call to the echo with the array's bytes, the same bytes "
    "back (identity serializers; the baseline)",
}
DEFAULT_SIZES = "64,64k,1m,16m"
QUICK_SIZES = "64,64k,1m"
_CONNECT_S = 15.0
F32 = npt.NDArray[np.float32]


@dataclass
class RemoteConfig:
    """What a ``--peer`` run does."""

    peer: str
    sizes: list[int] = field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    reps: int = 3
    budget_s: float = 2.0
    timeout_s: float = 120.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option that makes no sense."""
        from .._cluster import split_host_port

        split_host_port(self.peer)  # InvalidArgumentError (a ValueError) naming it
        too_big = [n for n in self.sizes if n > MAX_MESSAGE - (64 << 10)]
        if too_big:
            raise ValueError(
                f"size {format_size(too_big[0])} is above what the echo peer takes "
                f"({format_size(MAX_MESSAGE - (64 << 10))})"
            )
        if not 1 <= self.reps <= 1000:
            raise ValueError(f"reps must be from 1 to 1000, not {self.reps}")


@dataclass
class RemoteResult:
    config: dict[str, Any]
    local_address: str | None = None
    cells: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    echoed: int | None = None  # what the echo peer counted (its Close answer)
    failure: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None and all(
            len(self.cells.get(m, {})) == len(self.config["sizes"]) for m in METHODS
        )

    def ratio(self, nbytes: int) -> float | None:
        """shmrdv's median round trip over the raw call's at ``nbytes``."""
        m = self.cells.get("shmrdv_grpc", {}).get(nbytes)
        b = self.cells.get(BASELINE, {}).get(nbytes)
        if m is None or b is None or b["rtt_median_ns"] <= 0:
            return None
        return float(m["rtt_median_ns"] / b["rtt_median_ns"])

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "cells": {m: {str(n): c for n, c in cells.items()} for m, cells in self.cells.items()},
            f"rtt_x_{BASELINE}": {str(n): self.ratio(n) for n in self.config["sizes"]},
            "units": {"time": "ns", "throughput": "GB/s = 1e9 B/s, 2 x size / median"},
        }


# -- the measuring child ------------------------------------------------------------------------


def _local_address(host: str, port: int) -> tuple[int, str]:
    """(address family, this host's address on the route to ``host``): where the echo
    reaches this host back. A UDP connect sends nothing; it only picks the route."""
    family, _, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        local: str = s.getsockname()[0]
    return family, local


def _free_port(family: int, address: str) -> int:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        port: int = s.getsockname()[1]
    return port


def _source(nbytes: int) -> F32:
    src: F32 = np.random.default_rng(nbytes).random(nbytes // 4, dtype=np.float32)
    return src


def _cell(
    handoff: Callable[[F32], npt.NDArray[Any]],
    nbytes: int,
    cfg: RemoteConfig,
    first_seq: int,
) -> tuple[dict[str, Any], int]:
    """Time the round trips of one (method, size); (the cell's figures, the next sequence)."""
    src = _source(nbytes)
    seq = first_seq

    def one(check: bool) -> int:
        nonlocal seq
        seq += 1
        stamp = float(seq % (1 << 23) + 1)  # exact in float32
        src[0] = src[-1] = stamp
        t0 = time.perf_counter_ns()
        a = handoff(src)
        t1 = time.perf_counter_ns()
        if a.nbytes != nbytes or a[0] != stamp or a[-1] != stamp:
            raise RuntimeError(
                f"{format_size(nbytes)}: sent stamp {stamp}, got back {a.nbytes} bytes "
                f"with a[0]={a[0]!r} a[-1]={a[-1]!r}"
            )
        if check and not np.array_equal(a.view(np.float32), src):
            raise RuntimeError(f"{format_size(nbytes)}: the array came back changed")
        return t1 - t0

    budget_ns = cfg.budget_s * 1e9
    started = time.perf_counter()
    warm = [one(True)]
    while len(warm) < 50 and (len(warm) < 3 or sum(warm) < 0.1 * budget_ns):
        warm.append(one(False))
    per = statistics.median(warm[1:])
    n = max(3, min(2000, int(0.9 * budget_ns / cfg.reps / max(per, 1.0))))
    rtts: list[int] = []
    medians: list[float] = []
    for _ in range(cfg.reps):
        one(True)
        rep = [one(False) for _ in range(n)]
        one(True)
        rtts += rep
        medians.append(float(statistics.median(rep)))
    return {
        "nbytes": nbytes,
        "reps": cfg.reps,
        "per_rep": n,
        "rtt_median_ns": float(statistics.median(medians)),
        "rtt_p99_ns": float(np.percentile(rtts, 99)),
        "rtt_min_ns": float(min(rtts)),
        "rtt_rep_medians_ns": medians,
        "elapsed_s": time.perf_counter() - started,
    }, seq


def _client(conn: Connection, cfg: RemoteConfig) -> None:
    import grpc

    import shmrdv

    from .._cluster import split_host_port
    from .._rpc.guard import bearer_metadata

    token = os.environ.get("SHMRDV_TOKEN") or None
    metadata = bearer_metadata(token)
    host, port = split_host_port(cfg.peer)
    try:  # a plain connect first: "refused" at once, where gRPC would retry until its deadline
        socket.create_connection((host, port), timeout=_CONNECT_S).close()
    except OSError as e:
        raise ConnectionError(
            f"nothing answers at {cfg.peer} ({e.strerror or e}): is `shmrdv serve --listen "
            f"HOST:{port}` running there, and the port open?"
        ) from None
    family, local = _local_address(host, port)
    options = [
        *[o for o in GRPC_OPTIONS if "message_length" not in o[0]],
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
    ]
    channel = grpc.insecure_channel(cfg.peer, options=options)

    def control(method: str, body: dict[str, Any]) -> dict[str, Any]:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            answer: dict[str, Any] = json.loads(
                call(json.dumps(body).encode(), timeout=60, metadata=metadata)
            )
        except grpc.RpcError as e:
            name = method.rpartition("/")[2]
            raise ConnectionError(
                f"the echo peer at {cfg.peer} answered {name} with {e.code().name}: {e.details()}"
            ) from None
        return answer

    worker: Any = None
    opened = False
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=_CONNECT_S)
        except grpc.FutureTimeoutError:
            raise ConnectionError(
                f"no echo peer answers at {cfg.peer} within {_CONNECT_S:g} s: is "
                f"`shmrdv serve --listen HOST:{port}` running there, and the port open?"
            ) from None

        bench_port = _free_port(family, local)
        echo_port = control(OPEN_METHOD, {"port": bench_port})["port"]
        opened = True
        bracket = (lambda h: f"[{h}]") if family == socket.AF_INET6 else (lambda h: h)
        cluster = {
            "echo": [f"{bracket(host)}:{echo_port}"],
            "bench": [f"{bracket(local)}:{bench_port}"],
        }
        worker = shmrdv.Worker(
            BENCH_TASK,
            cluster=cluster,
            namespace=shmrdv.new_namespace(),
            transports=("grpc",),
            token=token,
        )
        rdv = worker.rendezvous(ECHO_STEP)
        key_out, key_back = echo_keys(ECHO_TASK, BENCH_TASK)
        raw = channel.unary_unary(RAW_METHOD, request_serializer=None, response_deserializer=None)

        def via_shmrdv(src: F32) -> npt.NDArray[Any]:
            rdv.send(key_out, src)
            value: npt.NDArray[Any] = rdv.recv(key_back, timeout=cfg.timeout_s).value
            return value

        def via_raw(src: F32) -> npt.NDArray[Any]:
            data = raw(src.tobytes(), timeout=cfg.timeout_s, metadata=metadata)
            return np.frombuffer(data, np.float32)

        conn.send(("ready", cluster["bench"][0]))
        seq = 0
        for method, handoff in ((BASELINE, via_raw), ("shmrdv_grpc", via_shmrdv)):
            for nbytes in cfg.sizes:
                conn.send(("progress", f"{method} · {format_size(nbytes)}"))
                cell, seq = _cell(handoff, nbytes, cfg, seq)
                conn.send(("cell", method, nbytes, cell))
        # The echo side first (its channel to this Worker closes before this server stops).
        echoed = control(CLOSE_METHOD, {})["echoed"]
        opened = False
        conn.send(("done", echoed))
    finally:
        if opened:
            try:
                control(CLOSE_METHOD, {})
            except Exception:  # already failing: the first error is the one reported
                pass
        if worker is not None:
            worker.close()
        channel.close()


# -- the command ---------------------------------------------------------------------------------


def run_remote(cfg: RemoteConfig, say: Callable[[str], None] = lambda _: None) -> RemoteResult:
    """Measure against the echo peer ``cfg.peer``; a failure is in ``result.failure``."""
    result = RemoteResult(config=asdict(cfg))
    started = time.monotonic()
    child = Child("bench-peer", _client, cfg)
    ok = False
    try:
        result.local_address = child.expect(
            "ready", _CONNECT_S + 120.0, lambda msg: msg[0] == "progress"
        )[1]
        while True:
            msg = child.recv(cfg.timeout_s + 60.0 + 30.0 * cfg.budget_s)
            if msg[0] == "progress":
                say(f"--peer {cfg.peer}: {msg[1]}")
            elif msg[0] == "cell":
                _, method, nbytes, cell = msg
                result.cells.setdefault(method, {})[nbytes] = cell
            elif msg[0] == "done":
                result.echoed = msg[1]
                break
            else:
                raise ChildFailed(f"unexpected message from the measuring process: {msg!r}")
        ok = True
    except ChildFailed as e:
        text = str(e).strip().splitlines()
        result.failure = text[-1] if text else str(e)
    finally:
        child.stop(30.0 if ok else 1.0)
        result.elapsed_s = time.monotonic() - started
    return result


def format_remote(r: RemoteResult) -> str:
    """The run as markdown."""
    cfg = r.config
    lines = [
        f"# shmrdv bench --peer {cfg['peer']}",
        "",
        f"Round trips from this host ({r.local_address or '?'}) to the echo peer at "
        f"{cfg['peer']} (`shmrdv serve --listen`): the array there and back, checked; "
        f"{cfg['reps']} repetition(s) of {cfg['budget_s']:g} s per cell; {r.elapsed_s:.1f} s"
        + ("" if r.echoed is None else f"; the echo's Worker sent {r.echoed:,} arrays back")
        + ".",
        "",
        f"## Round trip: median (p99) · GB/s (2 {TIMES} size / median)",
        "",
        f"| size | shmrdv_grpc | {BASELINE} | shmrdv_grpc {TIMES}{BASELINE} |",
        "|---|---|---|---|",
    ]
    for n in cfg["sizes"]:
        cells = []
        for method in ("shmrdv_grpc", BASELINE):
            c = r.cells.get(method, {}).get(n)
            cells.append(
                DASH
                if c is None
                else f"{format_time(c['rtt_median_ns'])} ({format_time(c['rtt_p99_ns'])}) · "
                f"{format_sig(2 * n / c['rtt_median_ns'])}"
            )
        ratio = r.ratio(n)
        lines.append(
            f"| {format_size(n)} | {cells[0]} | {cells[1]} | "
            + ("" if ratio is None else f"{TIMES}{format_sig(ratio)}")
            + " |"
        )
    lines += ["", "## Methods", ""]
    lines += [f"* `{m}`: {LABELS[m]}." for m in METHODS]
    lines.append("")
    if r.failure:
        lines += [f"FAILED: {r.failure}", ""]
    return "\n".join(lines) + "\n"


def config_from_args(args: argparse.Namespace) -> RemoteConfig:
    quick = getattr(args, "quick", False)
    return RemoteConfig(
        peer=args.peer,
        sizes=args.sizes or parse_sizes(QUICK_SIZES if quick else DEFAULT_SIZES),
        reps=args.reps if args.reps is not None else (1 if quick else 3),
        budget_s=args.budget if args.budget is not None else (0.25 if quick else 2.0),
    )


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --peer HOST:PORT``: 0 when every cell was measured, 1 otherwise."""
    from .report import run_mode

    return run_mode("peer", args, config_from_args, run_remote, format_remote)
