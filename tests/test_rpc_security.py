"""TLS and token options of the gRPC transport, over a real server on 127.0.0.1."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import rpc_helpers
from flood_helpers import silent_call_outcomes
from rpc_helpers import Pki, StepSource, make_key, make_pki, pull

from shmrdv._errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.methods import (
    RECV_TENSOR_METHOD,
    RECV_TENSOR_SERIES_METHOD,
    RECV_TENSOR_STREAM_METHOD,
)
from shmrdv._rpc.security import TLSConfig, bearer_metadata, check_token, token_matches
from shmrdv._rpc.server import RpcServer

# Shared fixtures (tests/rpc_helpers.py): a StepSource, a server on loopback, a channel.
source = rpc_helpers.source

TOKEN = "s3cret-token"


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
    ("method", "response_stream"),
    [
        (RECV_TENSOR_METHOD, False),
        (RECV_TENSOR_STREAM_METHOD, True),
        (RECV_TENSOR_SERIES_METHOD, True),
    ],
    ids=["unary", "stream", "series"],
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
