"""The echo peer of ``shmrdv serve`` (``shmrdv._bench.echo``), with a real gRPC server on loopback.

Each test drives the service the way ``shmrdv bench --peer`` does: raw grpcio calls to its
control methods, and a real ``shmrdv.Worker`` of ``BENCH_TASK`` for the echo itself.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from helpers import free_port

import shmrdv
from shmrdv._bench.echo import (
    BENCH_TASK,
    BUSY_S,
    CLOSE_METHOD,
    ECHO_TASK,
    OPEN_METHOD,
    RAW_METHOD,
    STEP,
    EchoLoop,
    EchoService,
    echo_keys,
    peer_host,
)
from shmrdv._rpc.guard import bearer_metadata

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def service() -> Iterator[EchoService]:
    with EchoService("127.0.0.1:0") as s:
        yield s


def _call(address: str, method: str, body: bytes, token: str | None = None) -> bytes:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        answer: bytes = call(body, timeout=20, metadata=bearer_metadata(token))
        return answer


def _open(address: str, port: int, token: str | None = None) -> dict[str, object]:
    answer: dict[str, object] = json.loads(
        _call(address, OPEN_METHOD, json.dumps({"port": port}).encode(), token)
    )
    return answer


def test_echo_service_raw_answers_the_same_bytes(service: EchoService) -> None:
    data = np.arange(1 << 16, dtype=np.float32).tobytes()
    assert _call(service.address, RAW_METHOD, data) == data


def test_echo_session_echoes_a_bench_workers_arrays(service: EchoService) -> None:
    port = free_port()
    answer = _open(service.address, port)
    assert answer["task"] == ECHO_TASK
    cluster = {"echo": [f"127.0.0.1:{answer['port']}"], "bench": [f"127.0.0.1:{port}"]}
    ns = shmrdv.new_namespace()
    with shmrdv.Worker(BENCH_TASK, cluster=cluster, namespace=ns, transports=("grpc",)) as w:
        rdv = w.rendezvous(STEP)
        out, back = echo_keys(ECHO_TASK, BENCH_TASK)
        sent = [np.full((3, 5), i, np.int16) for i in range(3)] + [np.arange(300_000.0)]
        for a in sent:
            rdv.send(out, a)
        for a in sent:
            got = rdv.recv(back, timeout=30).value
            assert got.dtype == a.dtype and got.shape == a.shape and (got == a).all()
        closed = json.loads(_call(service.address, CLOSE_METHOD, b"{}"))
    assert closed == {"echoed": len(sent)}
    assert service.sessions == 1


def test_echo_service_takes_one_bench_at_a_time(service: EchoService) -> None:
    _open(service.address, free_port())
    with pytest.raises(grpc.RpcError) as busy:
        _open(service.address, free_port())
    assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "busy" in (busy.value.details() or "") and "127.0.0.1" in (busy.value.details() or "")
    _call(service.address, CLOSE_METHOD, b"{}")
    _open(service.address, free_port())  # free again
    assert service.sessions == 2 and BUSY_S <= 5.0


def test_echo_service_closes_an_idle_session() -> None:
    with EchoService("127.0.0.1:0", idle_s=0.0) as s:
        assert not s.expire_idle()  # nothing open
        _open(s.address, free_port())
        assert "session of 127.0.0.1:" in repr(s)
        assert s.expire_idle()
        assert "no session" in repr(s)


@pytest.mark.parametrize("body", [b"not json", b'{"port": 0}', b"{}", b'{"port": "x"}'])
def test_echo_service_refuses_a_bad_open(service: EchoService, body: bytes) -> None:
    with pytest.raises(grpc.RpcError) as bad:
        _call(service.address, OPEN_METHOD, body)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert service.sessions == 0


def test_echo_service_with_a_token_refuses_calls_without_it() -> None:
    token = "t" * 32
    with EchoService("127.0.0.1:0", token=token) as s:
        for method in (OPEN_METHOD, RAW_METHOD, CLOSE_METHOD):
            for wrong in (None, "u" * 32):
                with pytest.raises(grpc.RpcError) as refused:
                    _call(s.address, method, b'{"port": 9}', wrong)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert s.sessions == 0
        assert _call(s.address, RAW_METHOD, b"abc", token) == b"abc"


def test_echo_service_names_an_address_it_cannot_listen_on() -> None:
    with EchoService("127.0.0.1:0") as s:
        taken = s.address
        with pytest.raises(shmrdv.UnavailableError, match=f"cannot listen on {taken}"):
            EchoService(taken)
    with pytest.raises(shmrdv.InvalidArgumentError, match="not 'host:port'"):
        EchoService("localhost")


ECHO_THREAD = re.compile(r"shmrdv-echo-\d+")


def test_echo_loop_stops_within_a_second_of_close() -> None:
    ns = shmrdv.new_namespace()
    with shmrdv.Worker(ECHO_TASK, namespace=ns) as w:
        loop = EchoLoop(w, [BENCH_TASK])
        assert [t.name for t in threading.enumerate() if ECHO_THREAD.fullmatch(t.name)]
        t0 = time.monotonic()
        loop.close()
        assert time.monotonic() - t0 < 1.0
        # The loop's own thread is gone (a receive it had started may have had helper
        # threads of its transports, which end on their own).
        assert not [t for t in threading.enumerate() if ECHO_THREAD.fullmatch(t.name)]
        assert loop.echoed == 0


def test_peer_host_reads_grpc_peers() -> None:
    assert peer_host("ipv4:10.1.2.3:5678") == "10.1.2.3"
    assert peer_host("ipv6:[::1]:5678") == "[::1]"
    with pytest.raises(ValueError, match="not a TCP peer"):
        peer_host("unix:/tmp/sock")
