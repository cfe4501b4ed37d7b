"""A real producer side for the RPC tests, and their shared fixtures.

``StepSource`` is the real ``Outbox`` of a producer without its Worker: what a test sends
goes where a Worker's send puts it, and a tombstone set plays the Worker's cleaned-up
steps. Fixtures (import them into a test module to use them): ``source`` (a
``StepSource`` that sends values over 64 KiB in chunks), ``server`` (a real ``RpcServer``
on loopback serving it) and ``channel`` (a plain gRPC channel to it, receive limit
lifted). ``pull`` is one blocking receive through ``RpcClient.start_recv``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import helpers
import numpy.typing as npt
import pytest
from helpers import CONSUMER, PRODUCER

from shmrdv._errors import AbortedError
from shmrdv._keys import ParsedKey, parse_key
from shmrdv._rendezvous import Received, RecvSlot
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.outbox import Outbox
from shmrdv._rpc.server import RpcServer

TASK = PRODUCER
PEER_TASK = CONSUMER
INCARNATION = 0x2845C575404F86B6
# A raw channel takes responses of any size, as shmrdv's own client does.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 2**31 - 1)]


def make_key(
    name: str,
    *,
    src_task: str = TASK,
    incarnation: int = INCARNATION,
    dst_task: str = PEER_TASK,
) -> ParsedKey:
    """``helpers.make_key`` parsed, with the producer's incarnation by default."""
    return parse_key(helpers.make_key(name, src=src_task, dst=dst_task, incarnation=incarnation))


class StepSource(Outbox):
    """A producer's ``Outbox`` with a tombstone set of cleaned-up steps."""

    def __init__(
        self,
        task: str = TASK,
        incarnation: int = INCARNATION,
        *,
        max_inflight_bytes: int | None = None,
        chunk_bytes: int = 64 << 10,
    ) -> None:
        self.tombstones: set[int] = set()
        super().__init__(
            task,
            incarnation,
            cleaned_up=self.tombstones.__contains__,
            max_inflight_bytes=max_inflight_bytes,
            chunk_bytes=chunk_bytes,
        )

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool = False,
        timeout: float | None = None,
    ) -> None:
        super().send(step_id, key, value, is_dead, timeout)

    def cleanup(self, step_id: int) -> None:
        """Abort the step's parked calls and refuse it from now on (TF: CleanupGraph)."""
        self.tombstones.add(step_id)
        self.abort_step(step_id, AbortedError(f"Cleanup {step_id}"))
        self.cleanup_step(step_id)

    def pending_waiters(self, step_id: int | None = None) -> int:
        """Calls (or series) parked for a value."""
        return self.stats()["outbox_parked"]


# -- TLS material made at test time -------------------------------------------------------


class Pki:
    """A throwaway CA with a server certificate (SAN localhost, 127.0.0.1) and a client one."""

    def __init__(
        self,
        ca: bytes,
        server_cert: bytes,
        server_key: bytes,
        client_cert: bytes,
        client_key: bytes,
    ) -> None:
        self.ca = ca
        self.server_cert = server_cert
        self.server_key = server_key
        self.client_cert = client_cert
        self.client_key = client_key


def make_pki(tmp_dir: str) -> Pki | None:
    """Certificates made with ``cryptography``, else the ``openssl`` CLI; ``None`` if neither."""
    try:
        return _pki_cryptography()
    except ImportError:
        pass
    import shutil

    if shutil.which("openssl") is None:
        return None
    return _pki_openssl(tmp_dir)


def _pki_cryptography() -> Pki:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("shmrdv test CA"))
        .issuer_name(name("shmrdv test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage: x509.ObjectIdentifier) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    server_cert, server_key = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH)
    client_cert, client_key = leaf("shmrdv test client", ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(
        ca_cert.public_bytes(serialization.Encoding.PEM),
        server_cert,
        server_key,
        client_cert,
        client_key,
    )


def _pki_openssl(tmp_dir: str) -> Pki:
    import os
    import subprocess

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30, cwd=tmp_dir)

    def read(name: str) -> bytes:
        with open(os.path.join(tmp_dir, name), "rb") as f:
            return f.read()

    run(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=shmrdv test CA",
    )
    ext = os.path.join(tmp_dir, "san.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for leaf in ("server", "client"):
        run(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            f"{leaf}.key",
            "-out",
            f"{leaf}.csr",
            "-subj",
            f"/CN={leaf}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{leaf}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{leaf}.pem",
            "-days",
            "1",
            "-extfile",
            ext,
        )
    return Pki(
        read("ca.pem"),
        read("server.pem"),
        read("server.key"),
        read("client.pem"),
        read("client.key"),
    )


def pull(
    client: RpcClient,
    address: str,
    step_id: int,
    key: ParsedKey | str,
    *,
    timeout: float | None = None,
) -> Received:
    """One blocking receive the way a Worker makes it: ``start_recv(blocking=True)``
    filling a ``RecvSlot``, the caller waiting on its own call (``wait``); the client's own
    ``timeout`` ends it (raises its error)."""
    slot = RecvSlot()
    client.start_recv(address, step_id, key, slot.done, timeout=timeout, blocking=True)
    give_up = time.monotonic() + (300 if timeout is None else timeout + 30)
    while not slot.filled:
        assert time.monotonic() < give_up, "start_recv never answered"
        if not client.wait(slot.done, 0.2):
            slot.wait(0.2)
    return slot.result()


@pytest.fixture
def source() -> Iterator[StepSource]:
    s = StepSource()
    yield s
    s.close()


@pytest.fixture
def server(source: StepSource) -> Iterator[RpcServer]:
    with RpcServer("127.0.0.1:0", source) as srv:
        yield srv


@pytest.fixture
def channel(server: RpcServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address, CHANNEL_OPTIONS) as ch:
        yield ch
