"""``shmrdv bench``'s own methods under every key pattern: the bytes arrive intact, and the
per-message work of the pattern leaves nothing behind.

Both roles run in this process (the ponger on a thread) over real Workers; the runner's
processes are exercised by the slow test at the end.
"""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import run_bench

from shmrdv._bench.common import KEY_PATTERNS
from shmrdv._bench.contract import KIND_CHECK, KIND_STOP, Handler, RoleContext, make_stamp
from shmrdv._bench.selection import registered_methods

_HANDOFFS = 6


def _roles(method: str, keys: str, namespace: str) -> tuple[Any, Any]:
    spec = registered_methods()[method]
    assert spec.ponger is not None and keys in spec.key_patterns

    def ctx(role: str) -> RoleContext:
        return RoleContext(
            role, method, None, {"namespace": namespace}, "t_", "/tmp", 1 << 16, keys=keys
        )

    ponger = spec.ponger(ctx("ponger"))
    try:
        pinger = spec.pinger(ctx("pinger"))
    except BaseException:
        ponger.close()
        raise
    return pinger, ponger


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys", list(KEY_PATTERNS))
@pytest.mark.parametrize("method", ["shmrdv_send", "shmrdv_allocate", "shmrdv_grpc"])
def test_shmrdv_methods_move_the_bytes_intact_under_every_key_pattern(
    method: str, keys: str, ns: str
) -> None:
    pinger, ponger = _roles(method, keys, ns)
    handler = Handler()
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            ponger.serve(handler)
        except BaseException as e:  # reported below
            failures.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    steps: list[int] = []
    try:
        for seq in range(1, _HANDOFFS + 2):
            kind = KIND_STOP if seq > _HANDOFFS else KIND_CHECK
            src = np.random.default_rng(seq).random(1 << 12, dtype=np.float32)
            src[0] = src[-1] = make_stamp(seq, kind)
            if hasattr(pinger, "prepare"):
                pinger.prepare(src)
            ack = pinger.handoff(src)
            assert (ack.head, ack.tail) == (make_stamp(seq, kind),) * 2
            if kind == KIND_CHECK:
                assert ack.extra == zlib.crc32(src.data), seq
            steps.append(pinger._w.stats()["steps"])
        thread.join(30)
        assert not thread.is_alive() and not failures, failures
        # The step pattern cleans up as it goes: a step 0 and at most the next are open.
        assert max(steps) <= 2, steps
        assert ponger._w.stats()["steps"] <= 3
    finally:
        pinger.close()
        ponger.close()
        thread.join(10)
    assert handler.handled == _HANDOFFS + 1


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_bench_runs_every_key_pattern_and_names_it_in_the_tables_and_json(
    tmp_path: Path,
) -> None:
    out = tmp_path / "k.json"
    proc = run_bench(
        "--methods=shmrdv_send,shmrdv_allocate,shmrdv_grpc",
        "--keys=step,same,fresh",
        "--sizes=64,64k",
        "--reps=1",
        "--budget=0.02",
        "--idle-seconds=0",
        "--details",
        f"--json={out}",
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["config"]["keys"] == ["same", "fresh", "step"]
    runs = {(m["name"], m["keys"]): m for m in data["methods"]}
    for method in ("shmrdv_send", "shmrdv_allocate", "shmrdv_grpc"):
        for keys in KEY_PATTERNS:
            m = runs[(method, keys)]
            assert m["status"] == "ok", m
            for cell in m["cells"].values():
                assert cell["checks"] == 2  # two CRC-checked handoffs around the timed ones
                if keys == "same":
                    assert cell["rtt_x_keys_same"] is None
                else:
                    assert cell["rtt_x_keys_same"] > 0
            assert f"| {method} · {keys} |" in proc.stdout
    for peer in ("mp_pipe_oob", "memcpy", "grpc_pull"):
        assert runs[(peer, None)]["status"] == "ok"
    assert "`fresh`: a new edge name per message" in proc.stdout
