"""RpcClient edge cases found in review: a server with a concurrency limit, acks at close,
a request the wire cannot carry, and cancel racing a failed call. Real RpcServer and
RpcClient on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
import rpc_helpers
from helpers import wait_for
from rpc_helpers import StepSource, make_key, pull

from shmrdv._errors import DeadlineExceededError, InvalidArgumentError
from shmrdv._rendezvous import Received
from shmrdv._rpc import messages
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.guard import Limits
from shmrdv._rpc.server import RpcServer

# Shared fixtures (tests/rpc_helpers.py): a StepSource, a server on loopback, a channel.
source = rpc_helpers.source


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", [1, 2])
def test_a_server_with_a_call_limit_serves_every_receive(source: StepSource, limit: int) -> None:
    """A client's calls (a series among them) fit a server that takes one or two at once."""
    key = make_key("limited")
    with (
        RpcServer("127.0.0.1:0", source, limits=Limits(max_concurrent_rpcs=limit)) as srv,
        RpcClient() as client,
    ):
        for i in range(4):
            source.send(1, key, np.array([i]))
        got = []
        for _ in range(4):
            got.append(int(pull(client, srv.address, 1, key, timeout=10).value[0]))
            time.sleep(0.2)  # the series' late ack goes meanwhile
        assert got == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_close_sends_the_acks_still_pending(source: StepSource) -> None:
    """Delivered values leave the server's cache when the client closes, not at its TTL."""
    keys = [make_key(f"ack{i}") for i in range(50)]
    with RpcServer("127.0.0.1:0", source) as srv:
        cli = RpcClient()
        arrived = threading.Semaphore(0)
        for k in keys:
            cli.start_recv(srv.address, 1, k, lambda e, r: arrived.release(), timeout=10)
        for i, k in enumerate(keys):
            source.send(1, k, np.array([i]))
        for _ in keys:
            assert arrived.acquire(timeout=10)
        cli.close()  # at once: most acks are still waiting to ride on a next request
        deadline = time.monotonic() + 5
        while srv.stats()["cached"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.stats()["cached"] == 0


@pytest.mark.timeout(30)
def test_a_request_the_wire_cannot_carry_fails_through_done(source: StepSource) -> None:
    with RpcServer("127.0.0.1:0", source) as srv, RpcClient() as cli:
        box: list[BaseException | None] = []
        ev = threading.Event()

        def done(e: BaseException | None, r: Received | None) -> None:
            box.append(e)
            ev.set()

        cli.start_recv(srv.address, 2**63, make_key("huge-step"), done)
        assert ev.wait(10)
        assert isinstance(box[0], InvalidArgumentError)
        assert cli.stats()["receives_pending"] == 0


@pytest.mark.timeout(30)
def test_cancel_racing_a_failed_call_never_strands_the_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cancel()`` answers False only if ``done`` will be called.

    The call to a port where nothing listens fails (UNAVAILABLE); gRPC's thread is made
    slow to report it, and ``cancel()`` runs in that gap. Before the fix ``cancel()``
    said False and the failure was then retried forever: a blocked recv hung.
    """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    original = RpcClient._on_future
    failed = threading.Event()

    def slow_on_future(self: Any, *args: Any) -> None:
        failed.set()
        time.sleep(0.3)
        original(self, *args)

    monkeypatch.setattr(RpcClient, "_on_future", slow_on_future)
    with RpcClient() as cli:
        called = threading.Event()
        cancel = cli.start_recv(f"127.0.0.1:{port}", 1, make_key("race"), lambda e, r: called.set())
        assert failed.wait(10)
        cancelled = cancel()
        if cancelled:
            time.sleep(0.6)  # past the slowed callback and a retry's backoff
            assert not called.is_set()
        else:
            assert called.wait(5), "cancel() said a result was coming; none came"
        deadline = time.monotonic() + 5
        while cli.stats()["receives_pending"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cli.stats()["receives_pending"] == 0


def test_acks_go_at_most_max_acks_per_request() -> None:
    """A server reads at most MAX_ACKS acks from one request: the client puts no more on it."""
    ids = list(range(1, messages.MAX_ACKS + 477))
    request = messages.decode_request(messages.encode_request(1, "k", 1, finished=ids))
    assert list(request.finished) == ids[: messages.MAX_ACKS]


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_value_caught_by_the_deadline_stays_first_in_its_key(source: StepSource) -> None:
    """A large value sent just before the receive's deadline (so taken by the server and
    streamed too late) goes back to the head of its key at once: the next receive gets it,
    before a value sent later."""
    key = make_key("late-big")
    big = np.arange(24 << 20, dtype=np.int64)  # 192 MiB: streamed, for a while
    with RpcServer("127.0.0.1:0", source) as srv, RpcClient() as cli:
        timer = threading.Timer(0.3, lambda: source.send(1, key, big))
        timer.start()
        try:
            first = pull(cli, srv.address, 1, key, timeout=0.5)
        except DeadlineExceededError:
            first = None
        timer.join()
        source.send(1, key, np.array([2]))
        second = pull(cli, srv.address, 1, key, timeout=20)
        if first is None:  # the usual case: the deadline came first
            assert second.value.shape == big.shape and second.value[-1] == big[-1]
            assert int(pull(cli, srv.address, 1, key, timeout=20).value[0]) == 2
        else:
            assert np.array_equal(first.value, big)
            assert int(second.value[0]) == 2
        # At most the last one's, until its ack: the first one's cache entry goes when its
        # release (a MarkRecvFinished sent without waiting) lands, a moment later under load.
        wait_for(lambda: srv.stats()["cached"] <= 1, 5.0, "one cached response")
