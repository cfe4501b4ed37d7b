"""``shmrdv bench --pipeline``: a stream of tensors from one producer to one consumer, in order.

By default 1,000 float32 tensors of 64 KiB, then 100 of 16 MiB, from one producer process to
one consumer process that receives them in order, three ways:

* ``grpc_stream``, the baseline: the best raw grpcio way to do the same job. The consumer
  makes one server-streaming call on a channel that reads it in the calling thread
  (``SingleThreadedUnaryStream``); the producer's handler yields the tensors, each the
  ``tobytes()`` of the producer's array as it is then (grpcio's identity serializer takes
  bytes: one copy per tensor, as every real producer pays for a new tensor). The consumer
  views each message with ``np.frombuffer``. HTTP/2 flow control bounds what is in flight.
* ``shmrdv_grpc``: two ``shmrdv.Worker``s forced over gRPC on loopback
  (``transports=("grpc",)``), ``rdv.send`` of each tensor on one key (a FIFO channel),
  ``rdv.recv`` of each in order.
* ``shmrdv_shm``: the same over shared memory (the default transports).

Every tensor carries its sequence number in its first and last element; the consumer
checks every one (order and size) and compares the last of each round with the array the
producer made, after the clock stopped. The shmrdv producer has a backpressure window of
``WINDOW`` bytes (``max_inflight_bytes``): a stream, not a queue's fill.

Throughput of a round = all bytes / (the consumer's arrival of the last tensor - the
producer's start of the first), on CLOCK_MONOTONIC (system-wide); MB = 10**6 bytes. One
untimed round of a few tensors warms each method up; the figure is the median over the
timed rounds. The producer and the consumer are pinned to two CPUs, as in the round trip
(``--pin``, default where two CPUs are usable). Every process is a ``shmrdv._procs.Child``
and the consumer closes before the producer it pulls from.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from .._procs import ChildFailed
from .children import ChildGroup
from .common import GRPC_OPTIONS, format_size, parse_array_size, pin_cpus
from .options import PIPELINE_CASES
from .report import DASH, TIMES, format_sig

__all__ = [
    "DEFAULT_CASES",
    "METHODS",
    "PipelineConfig",
    "PipelineResult",
    "format_pipeline",
    "parse_cases",
    "run_cli",
    "run_pipeline",
]

BASELINE = "grpc_stream"
METHODS = (BASELINE, "shmrdv_grpc", "shmrdv_shm")
LABELS = {
    BASELINE: "raw grpcio server-streaming call (read in the calling thread), one "
    "`tobytes()` per tensor (the baseline)",
    "shmrdv_grpc": 'shmrdv `send` / `recv` on one key, `transports=("grpc",)` (loopback)',
    "shmrdv_shm": "shmrdv `send` / `recv` on one key, shared memory",
}
DEFAULT_CASES = PIPELINE_CASES
WINDOW = 64 << 20  # the shmrdv producer's max_inflight_bytes (the --load default)
WARMUP = 5  # tensors in the untimed round
_STREAM_METHOD = "/shmrdv.bench.Pipeline/Stream"
# The consumer's channel reads the stream in the iterating thread (grpcio's documented
# grpc.experimental.ChannelOptions.SingleThreadedUnaryStream), as a user after throughput
# would: it measured faster than the default channel thread.
_STREAM_OPTIONS = [*GRPC_OPTIONS, ("SingleThreadedUnaryStream", 1)]
_REQUEST = struct.Struct("<QQ")  # nbytes, count
_PRODUCER = "/job:pipeline/replica:0/task:0"
_CONSUMER = "/job:pipeline/replica:0/task:1"
F32 = npt.NDArray[np.float32]


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``SIZE:COUNT,...`` (e.g. ``64k:1000,16m:100``) as (bytes, count) pairs, in order.

    ``ValueError`` naming the part that is wrong."""
    cases = []
    for part in text.split(","):
        if not part.strip():
            continue
        size, sep, count = part.partition(":")
        if not sep:
            raise ValueError(f"pipeline case {part.strip()!r}: give SIZE:COUNT, e.g. 64k:1000")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"pipeline case {part.strip()!r}: {count!r} is no count") from None
        if not 1 <= n <= 1_000_000:
            raise ValueError(f"pipeline case {part.strip()!r}: count must be 1 to 1,000,000")
        cases.append((parse_array_size(size.strip()), n))
    if not cases:
        raise ValueError(f"no pipeline cases (give e.g. {DEFAULT_CASES})")
    return cases


@dataclass
class PipelineConfig:
    """What a pipeline run does."""

    cases: list[tuple[int, int]] = field(default_factory=lambda: parse_cases(DEFAULT_CASES))
    rounds: int = 3
    methods: tuple[str, ...] = METHODS
    pin: tuple[int, int] | None = None  # (producer CPU, consumer CPU)
    timeout_s: float = 300.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option that makes no sense."""
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(
                f"unknown pipeline method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}"
            )
        if not self.methods:
            raise ValueError(f"no methods (give some of {', '.join(METHODS)})")
        if not 1 <= self.rounds <= 1000:
            raise ValueError(f"rounds must be from 1 to 1000, not {self.rounds}")
        if not self.cases:
            raise ValueError("no cases")

    def case_name(self, nbytes: int, count: int) -> str:
        return f"{format_size(nbytes)} {TIMES} {count:,}"


@dataclass
class MethodFigures:
    """One method: MB/s of every timed round per case (``"<bytes>x<count>"``)."""

    status: str = "not run"  # "ok" or "failed"
    failure: str | None = None
    round_mbps: dict[str, list[float]] = field(default_factory=dict)

    def mbps(self, case: str) -> float | None:
        rounds = self.round_mbps.get(case)
        return float(statistics.median(rounds)) if rounds else None


@dataclass
class PipelineResult:
    config: dict[str, Any]
    methods: dict[str, MethodFigures] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.methods) and all(m.status == "ok" for m in self.methods.values())

    def ratio(self, method: str, case: str) -> float | None:
        """``method``'s MB/s over the baseline's in ``case``."""
        m, b = self.methods.get(method), self.methods.get(BASELINE)
        if m is None or b is None:
            return None
        num, den = m.mbps(case), b.mbps(case)
        return num / den if num is not None and den else None

    def to_json(self) -> dict[str, Any]:
        cases: dict[str, Any] = {}
        for nbytes, count in self.config["cases"]:
            key = _case_key(nbytes, count)
            cases[key] = {
                "nbytes": nbytes,
                "count": count,
                "methods": {
                    name: {
                        "mbps": m.mbps(key),
                        "tensors_per_s": _per_s(m.mbps(key), nbytes),
                        "round_mbps": m.round_mbps.get(key, []),
                        f"x_{BASELINE}": self.ratio(name, key),
                    }
                    for name, m in self.methods.items()
                },
            }
        return {
            "config": self.config,
            "elapsed_s": self.elapsed_s,
            "status": {
                n: {"status": m.status, "failure": m.failure} for n, m in self.methods.items()
            },
            "cases": cases,
            "units": {"throughput": "MB/s = 1e6 B/s"},
        }


def _case_key(nbytes: int, count: int) -> str:
    return f"{nbytes}x{count}"


def _per_s(mbps: float | None, nbytes: int) -> float | None:
    return None if mbps is None else mbps * 1e6 / nbytes


# -- the tensors ------------------------------------------------------------------------------


def _source(nbytes: int) -> F32:
    """The producer's array (the consumer makes the same one to check against)."""
    src: F32 = np.random.default_rng(nbytes).random(nbytes // 4, dtype=np.float32)
    return src


def _stamp(j: int) -> float:
    return float(j % (1 << 23) + 1)  # exact in float32


def _mark(src: F32, j: int) -> None:
    src[0] = src[-1] = _stamp(j)


class _Checker:
    """The consumer's checks: every tensor's size and place in the order, the last one whole."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes = nbytes
        self.count = count
        self.bad: list[str] = []
        self._expected = _source(nbytes)

    def each(self, a: npt.NDArray[Any], j: int) -> None:
        wrong = a.nbytes != self.nbytes or a[0] != _stamp(j) or a[-1] != _stamp(j)
        if wrong and len(self.bad) < 3:
            self.bad.append(f"tensor {j}: {a.nbytes} bytes, stamps {a[0]!r} {a[-1]!r}")

    def last(self, a: npt.NDArray[Any]) -> None:
        _mark(self._expected, self.count - 1)
        if not np.array_equal(a, self._expected):
            self.bad.append(f"tensor {self.count - 1}: its contents differ from the producer's")


# -- shmrdv: one key, a FIFO channel ------------------------------------------------------------


def _transports(method: str) -> tuple[str, ...] | None:
    return ("grpc",) if method == "shmrdv_grpc" else None


def _key() -> str:
    import shmrdv

    return shmrdv.create_key(
        _PRODUCER + "/device:CPU:0", 0, _CONSUMER + "/device:CPU:0", "pipeline"
    )


def _shmrdv_producer(conn: Connection, method: str, namespace: str, max_nbytes: int) -> None:
    import shmrdv

    key = _key()
    with shmrdv.Worker(
        _PRODUCER,
        namespace=namespace,
        transports=_transports(method),
        shm_pool_bytes=max(512 << 20, WINDOW + 4 * max_nbytes),
        max_inflight_bytes=WINDOW,
    ) as w:
        conn.send(("ready", None))
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            if cmd[0] == "cleanup":
                w.cleanup(cmd[1])
                conn.send(("cleaned",))
                continue
            _, step, nbytes, count, timeout = cmd
            rdv = w.rendezvous(step)
            src = _source(nbytes)
            t_first = time.perf_counter_ns()
            for j in range(count):
                _mark(src, j)
                rdv.send(key, src, timeout=timeout)  # one copy: src is the producer's again
            conn.send(("sent", t_first))
    conn.send(("bye",))


def _shmrdv_consumer(conn: Connection, method: str, namespace: str) -> None:
    import shmrdv

    key = _key()
    with shmrdv.Worker(_CONSUMER, namespace=namespace, transports=_transports(method)) as w:
        conn.send(("ready",))
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            if cmd[0] == "cleanup":
                w.cleanup(cmd[1])
                conn.send(("cleaned",))
                continue
            _, step, nbytes, count, timeout, _port = cmd
            rdv = w.rendezvous(step)
            check = _Checker(nbytes, count)
            conn.send(("armed",))
            a: npt.NDArray[Any] | None = None
            for j in range(count):
                a = None  # drop the last one first: its slot goes back to the producer
                a = rdv.recv(key, timeout=timeout).value
                check.each(a, j)
            t_last = time.perf_counter_ns()
            assert a is not None
            check.last(a)
            del a
            conn.send(("received", t_last, check.bad))
    conn.send(("bye",))


# -- grpc_stream: a raw server-streaming call -------------------------------------------------


def _stream_producer(conn: Connection, method: str, namespace: str, max_nbytes: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    firsts: queue.Queue[int] = queue.Queue()

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        nbytes, count = _REQUEST.unpack(request)
        src = _source(nbytes)
        firsts.put(time.perf_counter_ns())
        for j in range(count):
            _mark(src, j)
            yield src.tobytes()  # the bytes of the array as it is now: one copy per tensor

    rpc = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=None, response_serializer=None
    )
    service, name = _STREAM_METHOD.strip("/").split("/")
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {name: rpc}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        conn.send(("ready", port))
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            if cmd[0] == "cleanup":
                conn.send(("cleaned",))
                continue
            timeout = cmd[4]
            try:
                conn.send(("sent", firsts.get(timeout=timeout)))
            except queue.Empty:
                raise TimeoutError(
                    f"no stream call from the consumer within {timeout:g} s"
                ) from None
    finally:
        server.stop(grace=2.0).wait(5.0)
    conn.send(("bye",))


def _stream_consumer(conn: Connection, method: str, namespace: str) -> None:
    import grpc

    channel: Any = None
    try:
        conn.send(("ready",))
        while True:
            cmd = conn.recv()
            if cmd[0] == "close":
                break
            if cmd[0] == "cleanup":
                conn.send(("cleaned",))
                continue
            _, _step, nbytes, count, timeout, port = cmd
            if channel is None:
                channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=_STREAM_OPTIONS)
                grpc.channel_ready_future(channel).result(timeout=30)
            call = channel.unary_stream(
                _STREAM_METHOD, request_serializer=None, response_deserializer=None
            )
            check = _Checker(nbytes, count)
            conn.send(("armed",))
            a: npt.NDArray[Any] | None = None
            j = -1
            for j, data in enumerate(call(_REQUEST.pack(nbytes, count), timeout=timeout)):
                a = np.frombuffer(data, np.float32)
                check.each(a, j)
            t_last = time.perf_counter_ns()
            if j != count - 1 or a is None:
                raise RuntimeError(f"the stream ended after {j + 1} of {count} tensors")
            check.last(a)
            del a
            conn.send(("received", t_last, check.bad))
    finally:
        if channel is not None:
            channel.close()
    conn.send(("bye",))


_ROLES: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    BASELINE: (_stream_producer, _stream_consumer),
    "shmrdv_grpc": (_shmrdv_producer, _shmrdv_consumer),
    "shmrdv_shm": (_shmrdv_producer, _shmrdv_consumer),
}


# -- the run ------------------------------------------------------------------------------------


def _round_timeout(cfg: PipelineConfig, nbytes: int, count: int) -> float:
    return cfg.timeout_s + nbytes * count / 20e6  # generous: 20 MB/s


def _run_method(
    method: str, cfg: PipelineConfig, say: Callable[[str], None], figures: MethodFigures
) -> None:
    import shmrdv

    from .._shm.reaper import collect

    producer_role, consumer_role = _ROLES[method]
    namespace = shmrdv.new_namespace()
    max_nbytes = max(n for n, _ in cfg.cases)
    group = ChildGroup()
    cpus = [None, None] if cfg.pin is None else [[cfg.pin[0]], [cfg.pin[1]]]
    ok = False
    try:
        producer = group.start(
            "producer", producer_role, method, namespace, max_nbytes, cpus=cpus[0]
        )
        consumer = group.start("consumer", consumer_role, method, namespace, cpus=cpus[1])
        port = producer.expect("ready", 180.0)[1]
        consumer.expect("ready", 180.0)
        step = 0
        for nbytes, count in cfg.cases:
            key = _case_key(nbytes, count)
            figures.round_mbps[key] = []
            timeout = _round_timeout(cfg, nbytes, count)
            for r in range(cfg.rounds + 1):  # round 0 (a few tensors) warms the method up
                n = min(WARMUP, count) if r == 0 else count
                say(f"pipeline: {method}, {cfg.case_name(nbytes, count)}, round {r}/{cfg.rounds}")
                step += 1
                consumer.send(("run", step, nbytes, n, timeout, port))
                consumer.expect("armed", timeout)
                producer.send(("run", step, nbytes, n, timeout))
                t_first = producer.expect("sent", timeout)[1]
                _, t_last, bad = consumer.expect("received", timeout)
                if bad:
                    raise ChildFailed(f"wrong tensors: {'; '.join(bad)}")
                for child in (consumer, producer):
                    child.send(("cleanup", step))
                    child.expect("cleaned", 60.0)
                if r > 0:
                    figures.round_mbps[key].append(nbytes * n / 1e6 / ((t_last - t_first) / 1e9))
        for child in (consumer, producer):  # the consumer first: it pulls from the producer
            child.send(("close",))
            child.expect("bye", 60.0)
        ok = True
        figures.status = "ok"
    except ChildFailed as e:
        figures.status = "failed"
        figures.failure = str(e)
    finally:
        group.reap(30.0 if ok else 0.0)
        collect(namespace)


def run_pipeline(
    cfg: PipelineConfig, say: Callable[[str], None] = lambda _: None
) -> PipelineResult:
    """Run every method of ``cfg``; a method's failure is in its figures, never raised."""
    result = PipelineResult(config=asdict(cfg))
    started = time.monotonic()
    for method in cfg.methods:
        figures = result.methods[method] = MethodFigures()
        _run_method(method, cfg, say, figures)
    result.elapsed_s = time.monotonic() - started
    return result


def format_pipeline(r: PipelineResult) -> str:
    """The run as markdown."""
    cfg = r.config
    cases = [(int(n), int(c)) for n, c in cfg["cases"]]
    pin = cfg["pin"]
    names = [f"{format_size(n)} {TIMES} {c:,}" for n, c in cases]
    lines = [
        "# shmrdv bench --pipeline",
        "",
        "One producer process streams float32 tensors to one consumer process, which "
        "receives them in order and checks each; "
        + (f"producer on CPU {pin[0]}, consumer on CPU {pin[1]}" if pin else "not pinned")
        + f"; {cfg['rounds']} timed round(s) per case after a warm-up; {r.elapsed_s:.1f} s.",
        "",
        f"## Throughput: MB/s (median of rounds) · tensors/s · {TIMES}{BASELINE}",
        "",
        "| method | " + " | ".join(names) + " |",
        "|---" * (len(cases) + 1) + "|",
    ]
    for name, m in r.methods.items():
        cells = []
        for n, c in cases:
            key = _case_key(n, c)
            mbps = m.mbps(key)
            if mbps is None:
                cells.append(m.status)
                continue
            ratio = r.ratio(name, key)
            per_s = _per_s(mbps, n) or 0.0
            cells.append(
                f"{format_sig(mbps)} · {format_sig(per_s)}/s"
                + ("" if ratio is None else f" · {TIMES}{format_sig(ratio)}")
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## MB/s of every timed round", ""]
    lines += ["| method | " + " | ".join(names) + " |", "|---" * (len(cases) + 1) + "|"]
    for name, m in r.methods.items():
        rounds = [
            ", ".join(format_sig(x) for x in m.round_mbps.get(_case_key(n, c), [])) or DASH
            for n, c in cases
        ]
        lines.append(f"| {name} | " + " | ".join(rounds) + " |")
    lines += ["", "## Methods", ""]
    lines += [f"* `{name}`: {LABELS[name]}." for name in r.methods]
    lines += [
        "",
        "MB/s = all bytes of a round / (the consumer's arrival of the last tensor - the "
        "producer's start of the first); MB = 10^6 bytes. Every tensor is the producer's "
        f"array as it is at its send: one copy per tensor on every path. shmrdv's producer "
        f"may have {format_size(WINDOW)} unreceived (max_inflight_bytes).",
        "",
    ]
    for name, m in r.methods.items():
        if m.failure:
            lines += [f"{name} FAILED: {m.failure}", ""]
    return "\n".join(lines) + "\n"


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    quick = getattr(args, "quick", False)
    methods = (
        tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else METHODS
    )
    return PipelineConfig(
        cases=parse_cases(args.pipeline_cases or DEFAULT_CASES),
        rounds=args.reps if args.reps is not None else (1 if quick else 3),
        methods=methods,
        pin=pin_cpus(args.pin),
    )


def run_cli(args: argparse.Namespace) -> int:
    """``shmrdv bench --pipeline``: 0 when every method was measured, 1 otherwise."""
    from .report import run_mode

    return run_mode("pipeline", args, config_from_args, run_pipeline, format_pipeline)
