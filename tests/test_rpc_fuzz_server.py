"""A running Worker's gRPC server handed garbage (issue 6 §1): the right status code at
once, never a crash or a hang, and it keeps serving valid calls afterwards.

The pure decoders are fuzzed on their own in tests/test_rpc_messages.py; here the bytes go
through a real gRPC server in a real Worker (``transports=("grpc",)``), called over a raw
channel with identity serializers, so what is tested is the whole path a hostile or
broken peer reaches: gRPC's framing and limits, the handlers, the key checks, the
Worker's outboxes. After every batch a real send/recv between two Workers proves the
server still serves.

What each kind of bad input gets:

* bytes that do not parse as the request message, truncated requests, a field declaring
  more bytes than the message holds (up to 2**63), an empty or unparseable key →
  ``INVALID_ARGUMENT``;
* a request over the server's 1 MiB receive limit → ``RESOURCE_EXHAUSTED`` (gRPC's own
  check, before any handler runs: nothing is allocated for it);
* a key whose src is another task → ``INVALID_ARGUMENT`` ("Invalid rendezvous key (src)");
  another incarnation of this task → ``ABORTED``; a step already cleaned up → ``ABORTED``
  at once;
* a well-formed key of a step or edge nobody sends → waits for a value and gets
  ``DEADLINE_EXCEEDED`` at the call's deadline, as TensorFlow's RecvTensor would (it
  cannot know the value will never come). A namespace is not part of a gRPC request:
  the bearer token, not the namespace, is what keeps other jobs out (test_rpc_security);
* an unknown method or service → ``UNIMPLEMENTED`` (gRPC).

The other direction too: a consumer Worker pulling from a peer whose RecvTensor answers
garbage (whole or in chunks) gets ``InvalidArgumentError`` or ``InternalError`` before its
deadline, never a partial array, and receives normally once the peer answers well.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from helpers import CONSUMER, PRODUCER, make_key
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmrdv
from shmrdv._keys import parse_key
from shmrdv._rpc import messages
from shmrdv._rpc.messages import GET_STATUS as GET_STATUS_METHOD
from shmrdv._rpc.messages import MARK_RECV_FINISHED as MARK_RECV_FINISHED_METHOD
from shmrdv._rpc.messages import RECV_TENSOR as RECV_TENSOR_METHOD
from shmrdv._rpc.messages import RECV_TENSOR_SERIES as RECV_TENSOR_SERIES_METHOD

pytestmark = pytest.mark.timeout(120)

# Deadline of one garbage call: a request that happens to be a well-formed key waits this
# long for a value that never comes.
CALL_DEADLINE = 0.3
# How long gRPC may take to answer beyond the deadline before we call it a hang.
ANSWER_SLACK = 2.0

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# What a parse-or-key failure may come back as. DEADLINE_EXCEEDED: the bytes happened to
# form a valid key of this worker, which then waits for a value (see the module docstring).
BAD_REQUEST_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


class Pair:
    """A producer Worker with a gRPC server and a consumer Worker pulling from it."""

    def __init__(self) -> None:
        ns = shmrdv.new_namespace()
        self.producer = shmrdv.Worker(PRODUCER, namespace=ns, transports=("grpc",))
        self.consumer = shmrdv.Worker(CONSUMER, namespace=ns, transports=("grpc",))
        assert self.producer.address is not None
        self.address: str = self.producer.address
        self.channel = grpc.insecure_channel(self.address)
        self._n = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        self.channel.close()
        self.consumer.close()
        self.producer.close()

    def call(
        self, method: str, request: bytes, *, stream: bool = False, deadline: float = CALL_DEADLINE
    ) -> grpc.StatusCode:
        """Call ``method`` with raw bytes; the status code, checked to come back in time."""
        start = time.monotonic()
        try:
            if stream:
                for _ in self.channel.unary_stream(method)(request, timeout=deadline):
                    pass
            else:
                self.channel.unary_unary(method)(request, timeout=deadline)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        elapsed = time.monotonic() - start
        assert elapsed < deadline + ANSWER_SLACK, f"{method} took {elapsed:.2f}s ({code})"
        return code

    def still_serves(self) -> None:
        """A real send/recv between the two Workers, and nothing left waiting in the server."""
        with self._lock:
            self._n += 1
            name = f"check{self._n}"
        key = make_key(name)
        value = np.arange(1000, dtype=np.float32) + self._n
        self.producer.rendezvous(7).send(key, value)
        got = self.consumer.rendezvous(7).recv(key, timeout=10)
        np.testing.assert_array_equal(got.value, value)
        deadline = time.monotonic() + 5
        while self.server_stats()["server_parked"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server_stats()["server_parked"] == 0

    def server_stats(self) -> dict[str, int]:
        stats: dict[str, int] = self.producer.stats()["grpc"]
        return stats


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _valid_request(name: str = "fuzz", step: int = 3, request_id: int = 0) -> bytes:
    return messages.encode_request(step, make_key(name), request_id, chunks=False)


# -- random bytes and mutations through every method -------------------------------------

_METHODS: list[tuple[str, bool]] = [
    (RECV_TENSOR_METHOD, False),
    (RECV_TENSOR_SERIES_METHOD, True),
    (MARK_RECV_FINISHED_METHOD, False),
    (GET_STATUS_METHOD, False),
]


def _expected(method: str, code: grpc.StatusCode) -> bool:
    if method == RECV_TENSOR_METHOD:
        return code in BAD_REQUEST_CODES
    if method == RECV_TENSOR_SERIES_METHOD:  # a well-formed key's series waits, ticking
        return code in BAD_REQUEST_CODES
    if method == GET_STATUS_METHOD:
        return bool(code == grpc.StatusCode.OK)  # GetStatusRequest has no fields: anything goes
    # MarkRecvFinished (also "released"): an id to forget, or a parse error.
    return code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)


def _mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    """Truncations, byte flips, inserted bytes and inflated lengths of a valid message."""
    n = len(seed)
    truncated = st.integers(0, n - 1).map(lambda i: seed[:i])
    flipped = st.tuples(st.integers(0, n - 1), st.integers(0, 255)).map(
        lambda t: seed[: t[0]] + bytes([t[1]]) + seed[t[0] + 1 :]
    )
    inserted = st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=12)).map(
        lambda t: seed[: t[0]] + t[1] + seed[t[0] :]
    )
    # The key field (tag 0x12) declaring more bytes than follow, up to 2**63.
    key_bytes = make_key("fuzz").encode()
    inflated = st.integers(len(key_bytes) + 1, 2**63).map(
        lambda k: _varint(3 << 3) + _varint(3) + b"\x12" + _varint(k) + key_bytes
    )
    return st.one_of(truncated, flipped, inserted, inflated)


_ANY_INPUT = st.one_of(
    st.binary(max_size=300),
    _mutations(_valid_request()),
    _mutations(_valid_request(request_id=12345)),
)


@FUZZ
@given(data=_ANY_INPUT, which=st.sampled_from(_METHODS))
@pytest.mark.slow
def test_server_fuzz_answers_every_method_with_the_right_code(
    pair: Pair, data: bytes, which: tuple[str, bool]
) -> None:
    method, stream = which
    code = pair.call(method, data, stream=stream)
    assert _expected(method, code), f"{method} answered {code} to {data!r}"


@pytest.mark.timeout(60)
def test_server_fuzz_keeps_serving_after_garbage(pair: Pair) -> None:
    # Runs after the fuzz test in file order, and on its own: the server still serves
    # and no call it refused left a waiter or a value in the producer.
    pair.still_serves()
    stats = pair.server_stats()
    assert stats["server_parked"] == 0 and stats["outbox_parked"] == 0
    assert stats["outbox_values"] == 0


# -- specific bad inputs ------------------------------------------------------------------


def test_server_every_truncation_is_invalid_argument(pair: Pair) -> None:
    request = _valid_request(request_id=99)
    for cut in range(len(request)):
        # Cut right after the key field, what is left is a complete request (no
        # request_id) for a key nobody sends: it waits (a series needs a request_id).
        # Every other cut is malformed.
        try:
            parse_key(messages.decode_request(request[:cut]).rendezvous_key)
            waits = True
        except shmrdv.InvalidArgumentError:
            waits = False
        for method, stream in _METHODS[:2]:
            code = pair.call(method, request[:cut], stream=stream)
            expected = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if waits and not stream
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            assert code == expected, (cut, method, code)
    pair.still_serves()


@pytest.mark.parametrize(
    "declared",
    [
        1 << 10,
        1 << 20,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) + 5,
        (1 << 63) - 1,
        1 << 63,
        (1 << 64) - 1,
    ],
    ids=lambda n: f"len{n:#x}",
)
def test_server_length_larger_than_message_is_invalid_argument(pair: Pair, declared: int) -> None:
    key = make_key("x").encode()
    for field in (b"\x12", b"\x22", b"\x2a", b"\x32"):  # key, client/server locality, options
        request = _varint(1 << 3) + _varint(3) + field + _varint(declared) + key
        for method, stream in _METHODS[:2]:
            assert pair.call(method, request, stream=stream) == grpc.StatusCode.INVALID_ARGUMENT
    pair.still_serves()


def test_server_request_over_receive_limit_is_resource_exhausted(pair: Pair) -> None:
    # A key field honestly 2 MiB long: refused by gRPC's receive limit before parsing.
    # (A longer deadline: 2 MiB must cross HTTP/2 flow control before gRPC can refuse it.)
    request = b"\x12" + _varint(2 << 20) + b"a" * (2 << 20)
    for method, stream in _METHODS[:2]:
        code = pair.call(method, request, stream=stream, deadline=10.0)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    pair.still_serves()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"",  # no key at all
        messages.encode_request(3, "", 0),
        messages.encode_request(3, "a;b;c", 0),
        messages.encode_request(3, make_key("x").replace("task:0", "task:zero"), 0),
        b"\x12\x04\xff\xfe\xfd\xfc",  # a key that is not UTF-8
        b"\x08" + b"\xff" * 11,  # a varint longer than 10 bytes
        b"\x0f",  # wire type 7 does not exist
        b"\x12",  # a tag without its length
    ],
    ids=[
        "empty",
        "empty_key",
        "three_parts",
        "bad_task",
        "not_utf8",
        "long_varint",
        "wire7",
        "no_len",
    ],
)
def test_server_malformed_request_is_invalid_argument(pair: Pair, request_bytes: bytes) -> None:
    for method, stream in _METHODS[:2]:
        code = pair.call(method, request_bytes, stream=stream)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, code
    pair.still_serves()


def test_server_key_of_another_task_is_invalid_argument(pair: Pair) -> None:
    for src in (CONSUMER, "/job:worker/replica:0/task:10", "/job:ps/replica:0/task:0"):
        request = messages.encode_request(3, make_key("x", src=src), 0)
        with pytest.raises(grpc.RpcError) as info:
            pair.channel.unary_unary(RECV_TENSOR_METHOD)(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Invalid rendezvous key (src)" in (info.value.details() or "")
    pair.still_serves()


def test_server_key_of_another_incarnation_is_aborted_naming_the_task(pair: Pair) -> None:
    other = pair.producer.incarnation ^ 0x5A5A
    request = messages.encode_request(3, make_key("x", incarnation=other), 0)
    with pytest.raises(grpc.RpcError) as info:
        pair.channel.unary_unary(RECV_TENSOR_METHOD)(request, timeout=5)
    assert info.value.code() == grpc.StatusCode.ABORTED
    details = info.value.details() or ""
    assert "different device incarnation" in details and PRODUCER in details
    pair.still_serves()


def test_server_key_of_a_cleaned_up_step_is_aborted_at_once(pair: Pair) -> None:
    pair.producer.cleanup(11)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        pair.channel.unary_unary(RECV_TENSOR_METHOD)(
            messages.encode_request(11, make_key("x"), 0), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert time.monotonic() - start < 1.0
    pair.still_serves()


@pytest.mark.parametrize("step", [0, -1, 2**63 - 1, -(2**63), 12345])
def test_server_key_of_a_step_nobody_sends_waits_until_the_deadline(pair: Pair, step: int) -> None:
    start = time.monotonic()
    code = pair.call(RECV_TENSOR_METHOD, messages.encode_request(step, make_key("nobody"), 0))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start >= CALL_DEADLINE * 0.9
    pair.still_serves()


@pytest.mark.parametrize(
    "method",
    [
        "/tensorflow.WorkerService/NoSuchMethod",
        "/tensorflow.WorkerService/RunGraph",
        "/tensorflow.grpc.WorkerService/RecvTensor",  # the generated-stub path TF never serves
        "/shmrdv.Rendezvous/Nope",
        "/nope.Nope/Nope",
    ],
)
def test_server_unknown_method_is_unimplemented(pair: Pair, method: str) -> None:
    assert pair.call(method, _valid_request()) == grpc.StatusCode.UNIMPLEMENTED
    pair.still_serves()


@pytest.mark.slow
def test_server_garbage_in_parallel_does_not_starve_valid_calls(pair: Pair) -> None:
    bad: list[tuple[str, bytes, bool]] = []
    for i in range(100):
        bad.append((RECV_TENSOR_METHOD, bytes([i]) * (i + 1), False))
        bad.append((RECV_TENSOR_SERIES_METHOD, _valid_request(f"nobody{i}", step=9), True))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(pair.call, m, r, stream=s) for m, r, s in bad]
        # Valid transfers meanwhile, while up to 16 garbage calls are in flight.
        for _ in range(5):
            pair.still_serves()
        codes = [f.result(timeout=30) for f in futures]
    assert set(codes) <= BAD_REQUEST_CODES
    pair.still_serves()


@pytest.mark.slow
def test_server_requests_for_unused_steps_leave_no_state(pair: Pair) -> None:
    before = pair.server_stats()["outbox_parked"]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(
            pool.map(
                lambda s: pair.call(
                    RECV_TENSOR_METHOD, messages.encode_request(s, make_key("n"), 0)
                ),
                range(1000, 1200),
            )
        )
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    pair.still_serves()
    assert pair.server_stats()["outbox_parked"] == before == 0
    assert pair.server_stats()["outbox_values"] == 0


# -- the other direction: a consumer Worker pulling from a peer that answers garbage ---------


class GarbagePeer:
    """A raw gRPC server on the producer's address whose RecvTensor answers whatever
    messages the test sets: the first to the call, the others to the calls for the
    chunks at 1 KiB, 2 KiB, ... (a broken or hostile peer, not shmrdv's server)."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []
        handlers = [
            grpc.method_handlers_generic_handler(
                "tensorflow.WorkerService",
                {"RecvTensor": grpc.unary_unary_rpc_method_handler(self._recv)},
            ),
        ]
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers(handlers)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _recv(self, request: bytes, context: Any) -> bytes:
        index = messages.decode_request(request).offset // 1024
        answers = list(self.messages)
        return answers[index] if index < len(answers) else b""

    def close(self) -> None:
        self.server.stop(0).wait(5)


@pytest.fixture(scope="module")
def garbage_peer() -> Iterator[tuple[GarbagePeer, shmrdv.Worker]]:
    peer = GarbagePeer()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        own = f"127.0.0.1:{s.getsockname()[1]}"
    cluster = {"worker": [f"127.0.0.1:{peer.port}", own]}
    consumer = shmrdv.Worker(
        CONSUMER, cluster=cluster, namespace=shmrdv.new_namespace(), transports=("grpc",)
    )
    try:
        yield peer, consumer
    finally:
        consumer.close()
        peer.close()


_GOOD_STREAM = list(
    messages.encode_value(np.arange(600, dtype=np.int32), False, chunk_bytes=1024).chunks
)


def _stream_mutations() -> st.SearchStrategy[list[bytes]]:
    one = st.one_of(
        st.binary(max_size=120), _mutations(_GOOD_STREAM[0]), _mutations(_GOOD_STREAM[1])
    )
    replaced = st.tuples(st.integers(0, len(_GOOD_STREAM) - 1), one).map(
        lambda t: [*_GOOD_STREAM[: t[0]], t[1], *_GOOD_STREAM[t[0] + 1 :]]
    )
    dropped = st.integers(0, len(_GOOD_STREAM) - 1).map(
        lambda i: _GOOD_STREAM[:i] + _GOOD_STREAM[i + 1 :]
    )
    return st.one_of(replaced, dropped, st.lists(st.binary(max_size=60), max_size=4))


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(messages=_stream_mutations())
def test_consumer_fuzz_garbage_answers_are_refused_never_partial(
    garbage_peer: tuple[GarbagePeer, shmrdv.Worker], messages: list[bytes]
) -> None:
    peer, consumer = garbage_peer
    peer.messages = messages
    start = time.monotonic()
    # Only shmrdv's errors come out, in time; a mutation may still be a well-formed answer
    # (a flipped data byte), and an assembly refuses chunks that do not make up the
    # tensor their first declares (test_rpc_messages), so what is accepted is a whole one.
    with contextlib.suppress(shmrdv.InvalidArgumentError, shmrdv.InternalError):
        consumer.rendezvous(1).recv(make_key("g"), timeout=2.0)
    assert time.monotonic() - start < 2.0 + ANSWER_SLACK


def test_consumer_garbage_peer_then_good_answers_are_received(
    garbage_peer: tuple[GarbagePeer, shmrdv.Worker],
) -> None:
    peer, consumer = garbage_peer
    peer.messages = [b"\xff\xff"]
    with pytest.raises(shmrdv.InternalError, match="bad RecvTensor answer for"):
        consumer.rendezvous(1).recv(make_key("g"), timeout=2.0)
    peer.messages = _GOOD_STREAM
    got = consumer.rendezvous(1).recv(make_key("g"), timeout=5.0).value
    np.testing.assert_array_equal(got, np.arange(600, dtype=np.int32))
