"""shmrdv/_rpc/guard.py: TLS, the token, the gate every call passes first, and the
bounds, over a real server on 127.0.0.1 (clients that open calls and never send a
request: ``flood_helpers.silent_call_outcomes``)."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import grpc
import grpc.aio
import numpy as np
import pytest
import rpc_helpers
from flood_helpers import silent_call_outcomes
from helpers import SHMRDV_PATH, wait_for
from rpc_helpers import Pki, StepSource, make_key, make_pki, pull

from shmrdv._errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)
from shmrdv._rpc import messages
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.guard import (
    Limits,
    Parked,
    TLSConfig,
    bearer_metadata,
    check_token,
    descriptor_limit,
    peer_host,
    token_matches,
)
from shmrdv._rpc.messages import GET_STATUS, MARK_RECV_FINISHED, RECV_TENSOR, RECV_TENSOR_SERIES
from shmrdv._rpc.server import RpcServer

# Shared fixtures (tests/rpc_helpers.py): a StepSource, a server on loopback.
source = rpc_helpers.source

TOKEN = "s3cret-token"
# Every method the server serves, and whether its answer is a stream.
METHODS = [
    (RECV_TENSOR, False),
    (GET_STATUS, False),
    (MARK_RECV_FINISHED, False),
    (RECV_TENSOR_SERIES, True),
]


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    with tempfile.TemporaryDirectory() as d:
        made = make_pki(d)
        if made is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        yield made


# -- TLSConfig and token, pure --------------------------------------------------------------


def test_tlsconfig_needs_cert_and_key_together(pki: Pki) -> None:
    with pytest.raises(InvalidArgumentError, match="both cert_chain and private_key"):
        TLSConfig(cert_chain=pki.server_cert)


def test_tlsconfig_client_auth_needs_ca(pki: Pki) -> None:
    with pytest.raises(InvalidArgumentError, match="root_certificates"):
        TLSConfig(pki.server_cert, pki.server_key, require_client_auth=True)


def test_tlsconfig_refuses_non_pem() -> None:
    with pytest.raises(InvalidArgumentError, match="PEM"):
        TLSConfig(root_certificates=b"not a certificate")
    with pytest.raises(InvalidArgumentError, match="PEM bytes"):
        TLSConfig(root_certificates="-----BEGIN CERTIFICATE-----")  # type: ignore[arg-type]


def test_tlsconfig_repr_hides_key(pki: Pki) -> None:
    text = repr(TLSConfig(pki.server_cert, pki.server_key, pki.ca))
    assert "PRIVATE" not in text and "<hidden>" in text


def test_tlsconfig_server_credentials_need_cert(pki: Pki) -> None:
    with pytest.raises(InvalidArgumentError, match="cert_chain and private_key"):
        TLSConfig(root_certificates=pki.ca).server_credentials()


def test_tlsconfig_from_files_reads_pem(pki: Pki, tmp_path: object) -> None:
    d = str(tmp_path)
    paths = {}
    for name, data in (("c.pem", pki.server_cert), ("k.pem", pki.server_key), ("ca.pem", pki.ca)):
        paths[name] = os.path.join(d, name)
        with open(paths[name], "wb") as f:
            f.write(data)
    cfg = TLSConfig.from_files(
        paths["c.pem"], paths["k.pem"], paths["ca.pem"], require_client_auth=True
    )
    assert cfg.cert_chain == pki.server_cert and cfg.root_certificates == pki.ca
    assert cfg.require_client_auth


def test_tlsconfig_from_files_names_missing_file(tmp_path: object) -> None:
    missing = os.path.join(str(tmp_path), "nope.pem")
    with pytest.raises(InvalidArgumentError, match=r"nope\.pem"):
        TLSConfig.from_files(None, None, missing)


@pytest.mark.parametrize("bad", ["", " padded", "tab\there", "ünicode", 42])
def test_token_check_refuses_bad_tokens(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        check_token(bad)  # type: ignore[arg-type]


def test_token_matches_only_the_exact_bearer() -> None:
    assert token_matches(bearer_metadata("abc"), "abc")
    assert not token_matches(bearer_metadata("abd"), "abc")
    assert not token_matches((("authorization", "abc"),), "abc")
    assert not token_matches(None, "abc")
    assert bearer_metadata(None) == ()


# -- token over a real server -----------------------------------------------------------------


def test_token_missing_is_unauthenticated(source: StepSource) -> None:
    with RpcServer("127.0.0.1:0", source, token=TOKEN) as server, RpcClient() as client:
        with pytest.raises(UnauthenticatedError, match="missing or wrong shmrdv token"):
            client.get_status(server.address)
        with pytest.raises(UnauthenticatedError, match=server.address):
            pull(client, server.address, 1, make_key("t"), timeout=5)
        assert source.pending_waiters(1) == 0  # refused before the handler ran


def test_token_wrong_is_unauthenticated(source: StepSource) -> None:
    with (
        RpcServer("127.0.0.1:0", source, token=TOKEN) as server,
        RpcClient(token="wrong") as client,
        pytest.raises(UnauthenticatedError, match="missing or wrong shmrdv token"),
    ):
        client.get_status(server.address, timeout=5)


@pytest.mark.parametrize(
    ("method", "response_stream"), METHODS, ids=[m.rsplit("/", 1)[1] for m, _ in METHODS]
)
def test_token_missing_refuses_a_silent_call_at_once(
    source: StepSource, method: str, response_stream: bool
) -> None:
    """A call that never sends its request message is refused on its headers alone, well
    before the server's first_message_timeout (5 s): it used to wait for a message that
    never came (issue 19 §4)."""
    with RpcServer("127.0.0.1:0", source, token=TOKEN) as server:
        [(code, details, took)] = silent_call_outcomes(
            server.address, method, response_stream=response_stream, timeout=4
        )
    assert code == grpc.StatusCode.UNAUTHENTICATED, details
    assert details == "missing or wrong shmrdv token"
    assert took < 2


def test_token_correct_works(source: StepSource) -> None:
    key = make_key("t")
    with RpcServer("127.0.0.1:0", source, token=TOKEN) as server, RpcClient(token=TOKEN) as client:
        source.send(1, key, np.arange(5))
        got = pull(client, server.address, 1, key, timeout=5)
        assert got.value.tolist() == [0, 1, 2, 3, 4]
        assert client.get_status(server.address)[0].device_type == "CPU"


# -- TLS over a real server ---------------------------------------------------------------------


def test_tls_server_and_client_work(source: StepSource, pki: Pki) -> None:
    key = make_key("tls")
    server_tls = TLSConfig(pki.server_cert, pki.server_key)
    client_tls = TLSConfig(root_certificates=pki.ca)
    with (
        RpcServer("127.0.0.1:0", source, tls=server_tls, token=TOKEN) as server,
        RpcClient(tls=client_tls, token=TOKEN) as client,
    ):
        source.send(3, key, np.eye(3, dtype=np.float32))
        got = pull(client, server.address, 3, key, timeout=10)
        np.testing.assert_array_equal(got.value, np.eye(3, dtype=np.float32))


def test_tls_localhost_name_verifies(source: StepSource, pki: Pki) -> None:
    server_tls = TLSConfig(pki.server_cert, pki.server_key)
    with (
        RpcServer("localhost:0", source, tls=server_tls) as server,
        RpcClient(tls=TLSConfig(root_certificates=pki.ca)) as client,
    ):
        assert client.get_status(server.address, timeout=10)


def test_mtls_with_client_certificate_works(source: StepSource, pki: Pki) -> None:
    server_tls = TLSConfig(pki.server_cert, pki.server_key, pki.ca, require_client_auth=True)
    client_tls = TLSConfig(pki.client_cert, pki.client_key, pki.ca)
    with (
        RpcServer("127.0.0.1:0", source, tls=server_tls) as server,
        RpcClient(tls=client_tls) as client,
    ):
        assert client.get_status(server.address, timeout=10)


def test_mtls_without_client_certificate_fails(source: StepSource, pki: Pki) -> None:
    server_tls = TLSConfig(pki.server_cert, pki.server_key, pki.ca, require_client_auth=True)
    with (
        RpcServer("127.0.0.1:0", source, tls=server_tls) as server,
        RpcClient(tls=TLSConfig(root_certificates=pki.ca)) as client,
    ):
        with pytest.raises(UnavailableError, match=server.address):
            client.get_status(server.address, timeout=5)
        # The retrying stream path gives up at the caller's timeout, saying why.
        with pytest.raises(DeadlineExceededError, match="unavailable"):
            pull(client, server.address, 1, make_key("m"), timeout=0.5)


def test_tls_plaintext_client_fails_unavailable(source: StepSource, pki: Pki) -> None:
    with (
        RpcServer("127.0.0.1:0", source, tls=TLSConfig(pki.server_cert, pki.server_key)) as server,
        RpcClient() as client,
        pytest.raises(UnavailableError, match=server.address),
    ):
        client.get_status(server.address, timeout=5)


def test_tls_client_with_wrong_ca_fails(source: StepSource, pki: Pki) -> None:
    with tempfile.TemporaryDirectory() as d:
        other = make_pki(d)
    assert other is not None
    with (
        RpcServer("127.0.0.1:0", source, tls=TLSConfig(pki.server_cert, pki.server_key)) as server,
        RpcClient(tls=TLSConfig(root_certificates=other.ca)) as client,
        pytest.raises(UnavailableError),
    ):
        client.get_status(server.address, timeout=5)


# -- the bounds ---------------------------------------------------------------------------


_DEFAULT_UNDER = """
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from shmrdv._rpc.guard import Limits
print(Limits().connections())
"""


@pytest.mark.parametrize(("nofile", "connections"), [(16, 4), (256, 64), (1024, 256), (8192, 1024)])
def test_limits_default_connections_are_a_quarter_of_the_descriptor_limit(
    nofile: int, connections: int
) -> None:
    """Connections can never take the descriptors the rest of the process needs."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < nofile:
        pytest.skip(f"the hard descriptor limit is {hard}")
    out = subprocess.run(
        [sys.executable, "-c", _DEFAULT_UNDER, str(nofile)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": SHMRDV_PATH},
        check=True,
    )
    assert int(out.stdout) == connections


def test_limits_bound_the_calls_awaiting_their_request() -> None:
    assert Limits().max_awaiting_request == 1024
    assert Limits(max_concurrent_rpcs=400).max_awaiting_request == 100
    assert Limits(max_concurrent_rpcs=2).max_awaiting_request == 1


def test_limits_given_connections_are_kept() -> None:
    assert Limits(max_connections=3).connections() == 3


def test_limits_refuse_connections_that_would_take_the_descriptors() -> None:
    half = descriptor_limit() // 2
    assert Limits(max_connections=half).connections() == half
    with pytest.raises(InvalidArgumentError, match=f"max_connections={half + 1}.*at most {half}"):
        Limits(max_connections=half + 1)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_connections", 0),
        ("max_connections", -3),
        ("max_connections", 2.0),
        ("max_concurrent_rpcs", 0),
        ("max_concurrent_rpcs", None),
        ("max_concurrent_rpcs", False),
        ("first_message_timeout", 0.0),
        ("first_message_timeout", 3601),
        ("first_message_timeout", float("nan")),
        ("first_message_timeout", None),
    ],
)
def test_limits_refuse_bad_values_naming_them(option: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=option) as info:
        Limits(**{option: value})  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_server_refuses_limits_of_another_type(source: StepSource) -> None:
    with pytest.raises(InvalidArgumentError, match="limits must be a Limits"):
        RpcServer("127.0.0.1:0", source, limits={"max_connections": 4})  # type: ignore[arg-type]


# -- the gate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "response_stream"), METHODS, ids=[m.rsplit("/", 1)[1] for m, _ in METHODS]
)
def test_gate_drops_a_silent_call_of_every_method_at_its_deadline(
    source: StepSource, method: str, response_stream: bool
) -> None:
    limits = Limits(first_message_timeout=0.3)
    with RpcServer("127.0.0.1:0", source, limits=limits) as server:
        [(code, details, took)] = silent_call_outcomes(
            server.address, method, response_stream=response_stream
        )
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "first_message_timeout" in details and server.address in details
        assert 0.25 < took < 5, f"dropped after {took:.2f}s for a 0.3s deadline"
        wait_for(lambda: server.stats()["awaiting_request"] == 0, what="the call freed")
        assert server.stats()["silent_calls_dropped"] == 1
        # The server still serves.
        key = make_key("after")
        source.send(1, key, np.arange(3))
        with RpcClient() as client:
            assert pull(client, server.address, 1, key, timeout=10).value.tolist() == [0, 1, 2]


def test_gate_drops_the_oldest_silent_calls_beyond_its_bound(source: StepSource) -> None:
    """40 call slots: at most 10 calls may wait longer than a second for their request.
    Of 30 silent calls, the 20 oldest are dropped once they pass that second (not before:
    a burst of real calls gets time to be read), long before the 5 s deadline; a real
    call on a new connection is served meanwhile."""
    limits = Limits(max_concurrent_rpcs=40)
    assert limits.max_awaiting_request == 10

    async def flood(
        address: str, server: RpcServer
    ) -> tuple[list[tuple[grpc.StatusCode, str, float]], dict[str, int]]:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(address) as ch:
            t0 = loop.time()
            calls = [ch.stream_unary(GET_STATUS)(timeout=20) for _ in range(30)]
            codes = [asyncio.ensure_future(c.code()) for c in calls]
            ended_at: dict[int, float] = {}
            deadline = t0 + 4  # before the gate's deadline (5 s)
            while len(ended_at) < 20 and loop.time() < deadline:
                done, _ = await asyncio.wait(codes, timeout=0.02)
                for i, code in enumerate(codes):
                    if code in done and i not in ended_at:
                        ended_at[i] = loop.time() - t0
            ended = [
                (codes[i].result(), await calls[i].details() or "", took)
                for i, took in ended_at.items()
            ]
            stats = server.stats()
            async with grpc.aio.insecure_channel(address) as fresh:
                await fresh.unary_unary(GET_STATUS)(b"", timeout=10)
            for c in calls:
                c.cancel()
            await asyncio.wait(codes, timeout=10)
            return ended, stats

    with RpcServer("127.0.0.1:0", source, limits=limits) as server:
        ended, stats = asyncio.run(flood(server.address, server))
        assert len(ended) == 20, ended
        assert all(code == grpc.StatusCode.UNAVAILABLE for code, _, _ in ended), ended
        assert all("more than 10 calls were waiting" in details for _, details, _ in ended)
        assert all(0.9 < took < 4 for _, _, took in ended), ended
        assert stats["awaiting_request"] == 10 and stats["crowded_calls_dropped"] == 20
        # Calls their clients cancel are freed at once, not at the deadline (5 s).
        wait_for(lambda: server.stats()["awaiting_request"] == 0, timeout=3, what="freed")
        assert server.stats()["silent_calls_dropped"] == 0


def test_gate_refuses_a_unary_call_that_ends_without_its_request(source: StepSource) -> None:
    with RpcServer("127.0.0.1:0", source) as server:
        [(code, details, took)] = silent_call_outcomes(server.address, GET_STATUS, half_close=True)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "without a request message" in details
        assert took < 5
        assert server.stats()["awaiting_request"] == 0


def test_gate_keeps_the_real_calls_of_a_busy_client(source: StepSource) -> None:
    """900 receives in flight at once, each with its own call, three times as many as may
    wait long for their request: none is taken for silent, not even in the burst (the
    server starts them all before it reads their requests). Fewer than 1,000: beyond,
    gRPC's own overload shedding (``grpc.server.max_pending_requests``) may cancel some."""
    limits = Limits(max_concurrent_rpcs=1200, first_message_timeout=1.0)
    assert limits.max_awaiting_request == 300
    keys = [make_key(f"busy{i}") for i in range(900)]
    with RpcServer("127.0.0.1:0", source, limits=limits) as server:
        with grpc.insecure_channel(server.address, rpc_helpers.CHANNEL_OPTIONS) as channel:
            inline = channel.unary_unary(RECV_TENSOR)
            calls = [
                inline.future(messages.encode_request(1, k.full_key, i + 1), timeout=30)
                for i, k in enumerate(keys)
            ]
            wait_for(lambda: server.stats()["parked"] == len(keys), timeout=20, what="all parked")
            time.sleep(1.2)  # past the gate's deadline: they wait for values, not requests
            for i, k in enumerate(keys):
                source.send(1, k, np.array([i]))
            for i, c in enumerate(calls):
                got = messages.Assembly().feed(c.result(timeout=30))
                assert got is not None and got.value.tolist() == [i]
        stats = server.stats()
        assert stats["silent_calls_dropped"] == 0 and stats["crowded_calls_dropped"] == 0


def test_peer_host_drops_the_port() -> None:
    assert peer_host("ipv4:10.0.0.1:5123") == "ipv4:10.0.0.1"
    assert peer_host("ipv6:[::1]:80") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_parked_calls_bound_per_connection_per_host_and_in_all() -> None:
    parked = Parked((5, 3, 2), "calls waiting for values", "max_waiting")
    a1, a2, b = "ipv4:10.0.0.1:1", "ipv4:10.0.0.1:2", "ipv4:10.0.0.2:1"
    parked.add(a1, 2)
    why = parked.refusal(a1)
    assert why is not None and "connection ipv4:10.0.0.1:1" in why
    assert parked.refusal(a2) is None  # another connection of the same host
    parked.add(a2, 1)
    why = parked.refusal(a2)
    assert why is not None and "max_waiting_per_peer=3" in why
    parked.add(b, 2)
    why = parked.refusal("ipv4:10.0.0.3:1")
    assert why is not None and "max_waiting=5" in why


def test_parked_calls_leaving_free_their_place() -> None:
    parked = Parked((1, 1, 1), "calls waiting for values", "max_waiting")
    parked.add("ipv4:10.0.0.1:1", 1)
    assert parked.refusal("ipv4:10.0.0.1:1") is not None
    parked.add("ipv4:10.0.0.1:1", -1)
    assert parked.total == 0
    assert parked.refusal("ipv4:10.0.0.1:1") is None
