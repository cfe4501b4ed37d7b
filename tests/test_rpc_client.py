"""RpcClient against a real RpcServer on 127.0.0.1 (and one in a child process)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import rpc_helpers
from helpers import free_port, wait_for
from rpc_helpers import INCARNATION, TASK, StepSource, make_key, pull

from shmrdv._errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from shmrdv._rendezvous import Received
from shmrdv._rpc.client import RpcClient
from shmrdv._rpc.server import RpcServer

_TESTS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TESTS)

# Shared fixtures (tests/rpc_helpers.py): a StepSource, a server on loopback, a channel.
source = rpc_helpers.source
server = rpc_helpers.server


@pytest.fixture
def client() -> Iterator[RpcClient]:
    with RpcClient() as c:
        yield c


class _Done:
    """A done callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[BaseException | None, Received | None]] = []
        self.event = threading.Event()

    def __call__(self, error: BaseException | None, received: Received | None) -> None:
        self.calls.append((error, received))
        self.event.set()

    def wait(self, timeout: float = 10.0) -> tuple[BaseException | None, Received | None]:
        assert self.event.wait(timeout), "done was not called in time"
        assert len(self.calls) == 1
        return self.calls[0]


# -- values --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        np.arange(10, dtype=np.int32),
        np.array([[True, False]]),
        np.random.default_rng(1).random((3, 4, 5)),
        np.array([1 + 2j], dtype=np.complex128),
        np.full(7, 0.5, dtype=np.float16),
        np.zeros((3, 0), dtype=np.float32),
        np.array(3, dtype=np.int8),
        np.array([b"ab", b"c"], dtype="S2"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
        np.arange(6, dtype=">i4"),
    ],
    ids=[
        "int32",
        "bool",
        "float64",
        "complex128",
        "float16",
        "empty",
        "0-d",
        "bytes",
        "struct",
        "be",
    ],
)
def test_client_round_trips_values(
    source: StepSource, server: RpcServer, client: RpcClient, value: np.ndarray[Any, Any]
) -> None:
    key = make_key("v")
    source.send(1, key, value)
    got = pull(client, server.address, 1, key, timeout=10)
    assert got.value.dtype == value.dtype and got.value.shape == value.shape
    np.testing.assert_array_equal(got.value, value)
    assert not got.is_dead
    assert got.value.flags.writeable  # the receiver owns the assembled array


def test_client_carries_is_dead(source: StepSource, server: RpcServer, client: RpcClient) -> None:
    key = make_key("dead")
    source.send(1, key, np.zeros(4), is_dead=True)
    assert pull(client, server.address, 1, key, timeout=10).is_dead


def test_client_streams_64mib_tensor(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    key = make_key("big")
    value = np.arange(8 << 20, dtype=np.float64)  # 64 MiB
    source.send(1, key, value)
    got = pull(client, server.address, 1, key, timeout=30)
    assert got.value.nbytes == 64 << 20
    assert np.array_equal(got.value, value)


def test_client_get_status(server: RpcServer, client: RpcClient) -> None:
    (dev,) = client.get_status(server.address)
    assert (dev.name, dev.device_type, dev.incarnation) == (
        f"{TASK}/device:CPU:0",
        "CPU",
        INCARNATION,
    )


# -- waiting, deadlines, cancellation --------------------------------------------------------------


def test_client_waits_for_send(source: StepSource, server: RpcServer, client: RpcClient) -> None:
    key = make_key("later")
    done = _Done()
    client.start_recv(server.address, 1, key, done)
    wait_for(lambda: source.pending_waiters(1) == 1)
    assert not done.calls
    source.send(1, key, np.array([42]))
    error, got = done.wait()
    assert error is None and got is not None and got.value.tolist() == [42]


def test_client_blocked_receiver_calls_itself_then_idles_on_one_call(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    # Issue 19 §1 and the idle-CPU target: a blocked receiver makes short calls of its
    # own (re-made under one request_id while nothing comes), and after about a second
    # of them waits on one long call, so an idle receiver stops costing calls.
    key = make_key("idle")
    result: list[Any] = []
    thread = threading.Thread(
        target=lambda: result.append(pull(client, server.address, 1, key, timeout=20))
    )
    thread.start()
    try:
        wait_for(lambda: server.stats()["calls"] >= 3)  # the receiver's own short calls
        time.sleep(1.5)
        settled = server.stats()["calls"]
        time.sleep(1.0)
        assert server.stats()["calls"] == settled, "an idle blocked receiver kept calling"
        assert source.pending_waiters(1) == 1
        source.send(1, key, np.array([5]))
    finally:
        thread.join(30)
    assert result and result[0].value.tolist() == [5]


def test_client_timeout_is_deadline_exceeded_and_removes_waiter(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    key = make_key("slow")
    with pytest.raises(DeadlineExceededError, match=server.address) as info:
        pull(client, server.address, 1, key, timeout=0.3)
    assert key.full_key in str(info.value)
    wait_for(lambda: source.pending_waiters(1) == 0)
    source.send(1, key, np.array([1]))
    assert pull(client, server.address, 1, key, timeout=5).value.tolist() == [1]


def test_client_cancel_while_waiting_removes_waiter(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    key = make_key("cancel")
    done = _Done()
    cancel = client.start_recv(server.address, 1, key, done)
    wait_for(lambda: source.pending_waiters(1) == 1)
    assert cancel() is True
    assert cancel() is False
    wait_for(lambda: source.pending_waiters(1) == 0)
    wait_for(lambda: client.stats()["receives_pending"] == 0)
    source.send(1, key, np.array([5]))
    assert pull(client, server.address, 1, key, timeout=5).value.tolist() == [5]
    assert done.calls == []  # never called after a successful cancel


def test_client_cancel_after_delivery_is_refused(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    key = make_key("fast")
    source.send(1, key, np.array([1]))
    done = _Done()
    cancel = client.start_recv(server.address, 1, key, done)
    done.wait()
    assert cancel() is False
    assert len(done.calls) == 1


def test_client_cleaned_up_step_is_aborted_at_once(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    source.cleanup(8)
    key = make_key("x")
    t0 = time.monotonic()
    with pytest.raises(AbortedError, match=server.address) as info:
        pull(client, server.address, 8, key, timeout=10)
    assert time.monotonic() - t0 < 1
    assert key.full_key in str(info.value)


def test_client_wrong_src_is_invalid_argument(server: RpcServer, client: RpcClient) -> None:
    key = make_key("x", src_task="/job:worker/replica:0/task:3")
    with pytest.raises(InvalidArgumentError, match="Invalid rendezvous key"):
        pull(client, server.address, 1, key, timeout=5)


def test_client_wrong_incarnation_is_aborted(server: RpcServer, client: RpcClient) -> None:
    with pytest.raises(AbortedError, match="different device incarnation"):
        pull(client, server.address, 1, make_key("x", incarnation=99), timeout=5)


def test_client_acks_release_the_server_cache(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    key = make_key("ack")
    source.send(1, key, np.arange(100))
    pull(client, server.address, 1, key, timeout=5)
    source.send(2, key, np.arange(100))
    pull(client, server.address, 2, key, timeout=5)  # carries the first one's ack
    assert server.stats()["cached"] == 1


# -- unreachable peers, retries ------------------------------------------------------------


def test_client_retries_until_producer_starts(source: StepSource, client: RpcClient) -> None:
    address = f"127.0.0.1:{free_port()}"
    key = make_key("early")
    done = _Done()
    client.start_recv(address, 1, key, done, timeout=20)
    time.sleep(0.3)  # a few refused attempts
    assert not done.calls
    with RpcServer(address, source):
        source.send(1, key, np.array([7]))
        error, got = done.wait()
    assert error is None and got is not None and got.value.tolist() == [7]


def test_client_unreachable_peer_retries_until_cancelled(client: RpcClient) -> None:
    done = _Done()
    cancel = client.start_recv(f"127.0.0.1:{free_port()}", 1, make_key("x"), done)
    time.sleep(0.4)
    assert not done.calls
    assert cancel() is True
    wait_for(lambda: client.stats()["receives_pending"] == 0)
    assert done.calls == []


def test_client_unreachable_peer_times_out_naming_peer(client: RpcClient) -> None:
    address = f"127.0.0.1:{free_port()}"
    key = make_key("x")
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="unavailable") as info:
        pull(client, address, 1, key, timeout=0.5)
    assert time.monotonic() - t0 < 2
    assert address in str(info.value) and key.full_key in str(info.value)


def test_client_get_status_unreachable_is_unavailable(client: RpcClient) -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(UnavailableError, match=address):
        client.get_status(address, timeout=2)


# -- lifetime ------------------------------------------------------------------------------


def test_client_close_fails_pending_and_joins_threads(
    source: StepSource, server: RpcServer
) -> None:
    gc.collect()
    before = threading.active_count()
    client = RpcClient()
    done = _Done()
    client.start_recv(server.address, 1, make_key("pending"), done)
    wait_for(lambda: source.pending_waiters(1) == 1)
    client.close()
    client.close()
    error, _ = done.wait()
    assert isinstance(error, CancelledError)
    wait_for(lambda: source.pending_waiters(1) == 0)
    after_done = _Done()
    client.start_recv(server.address, 1, make_key("late"), after_done)
    assert isinstance(after_done.wait()[0], CancelledError)
    wait_for(lambda: threading.active_count() <= before)


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
@pytest.mark.timeout(30)
def test_client_works_in_forked_child(source: StepSource, server: RpcServer) -> None:
    client = RpcClient()
    try:
        first, second = make_key("parent"), make_key("child")
        source.send(1, first, np.array([1]))
        assert pull(client, server.address, 1, first, timeout=5).value.tolist() == [1]
        source.send(1, second, np.array([2]))
        pid = os.fork()
        if pid == 0:  # the child: one recv on the inherited client, then out
            status = 1
            try:
                got = pull(client, server.address, 1, second, timeout=10)
                status = 0 if got.value.tolist() == [2] else 2
                t0 = time.monotonic()
                server.stop()  # the parent's server: left alone, and no hang
                if time.monotonic() - t0 > 1:
                    status = 3
            finally:
                os._exit(status)
        deadline = time.monotonic() + 20
        while True:
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("forked child did not finish its recv in 20 s")
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0
        # The parent's client still works after the fork.
        source.send(1, first, np.array([3]))
        assert pull(client, server.address, 1, first, timeout=5).value.tolist() == [3]
    finally:
        client.close()


_CHILD_SERVER = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
import numpy as np
from rpc_helpers import StepSource, make_key
from shmrdv._rpc.server import RpcServer
source = StepSource(chunk_bytes=16 << 10)
server = RpcServer("127.0.0.1:0", source).start()
source.send(1, make_key("huge"), np.ones((64 << 20) // 8))
print(server.address, flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(30)
@pytest.mark.slow
def test_client_server_killed_mid_stream_is_unavailable() -> None:
    # 16 KiB chunks: 4,096 of them, fetched a few at a time.
    client = RpcClient()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_SERVER.format(repo=_REPO, tests=_TESTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        address = child.stdout.readline().decode().strip()
        assert address, "the child server did not start"
        done = _Done()
        client.start_recv(address, 1, make_key("huge"), done)
        wait_for(lambda: client.stats()["fetching"] == 1 or bool(done.calls), timeout=10)
        assert not done.calls, "the stream finished before the kill; make it slower"
        os.kill(child.pid, signal.SIGKILL)
        error, got = done.wait(timeout=10)
        assert isinstance(error, UnavailableError)
        assert address in str(error)
        assert got is None
    finally:
        child.kill()
        child.wait(10)
        if child.stdin is not None:
            child.stdin.close()
        if child.stdout is not None:
            child.stdout.close()
        client.close()


def test_client_cancel_racing_the_value_gives_it_back(
    source: StepSource, server: RpcServer, client: RpcClient
) -> None:
    # Cancel just as the value is sent, many times: each value is received exactly once,
    # in order, by this call or a later one; none waits in the server's cache.
    key = make_key("race")
    got: list[int] = []
    for i in range(20):
        done = _Done()
        cancel = client.start_recv(server.address, 1, key, done)
        wait_for(lambda d=done: source.pending_waiters(1) == 1 or bool(d.calls))  # type: ignore[misc]
        source.send(1, key, np.array([i]))
        if not cancel():
            error, received = done.wait()
            assert error is None and received is not None
            got.append(int(received.value[0]))
    while len(got) < 20:
        got.append(int(pull(client, server.address, 1, key, timeout=5).value[0]))
    assert got == list(range(20))


# -- calls and threads ----------------------------------------------------------------------


def test_client_small_value_costs_one_call_each(source: StepSource, server: RpcServer) -> None:
    with RpcClient() as client:
        key = make_key("one-call")
        before = server.stats()["calls"]
        for step in range(1, 5):  # TensorFlow's pattern: the key once per step
            source.send(step, key, np.array([step]))
            got = pull(client, server.address, step, key, timeout=5)
            assert got.value.tolist() == [step] and got.value.flags.writeable
        assert server.stats()["calls"] - before == 4  # one RecvTensor per receive


def test_client_large_value_comes_in_chunks_after_the_unary_call(
    source: StepSource, server: RpcServer
) -> None:
    with RpcClient() as client:
        key = make_key("chunked")
        big = np.arange(100_000, dtype=np.float64)  # 800,000 bytes: 13 chunks of 64 KiB
        source.send(1, key, big)
        source.send(2, key, np.array([7.0]))
        before = server.stats()["calls"]
        got = pull(client, server.address, 1, key, timeout=10)
        np.testing.assert_array_equal(got.value, big)
        assert server.stats()["calls"] - before == 13  # the call, then the other chunks
        wait_for(lambda: server.stats()["cached"] == 0)  # acknowledged at once
        assert pull(client, server.address, 2, key, timeout=5).value.tolist() == [7.0]


def test_client_acks_ride_on_the_next_request(source: StepSource, server: RpcServer) -> None:
    client = RpcClient()
    key = make_key("piggyback")
    for step in range(1, 21):
        source.send(step, key, np.array([step]))
        assert pull(client, server.address, step, key, timeout=5).value.tolist() == [step]
        # Each request carried the previous one's ack: at most the last one is cached.
        assert server.stats()["cached"] <= 1
    client.close()  # the last goes with the client's close
    wait_for(lambda: server.stats()["cached"] == 0)


def test_client_pending_receives_need_no_thread_each(source: StepSource, server: RpcServer) -> None:
    with RpcClient() as client:
        warm = make_key("warm")
        source.send(1, warm, np.array([0]))
        pull(client, server.address, 1, warm, timeout=5)
        before = threading.active_count()
        results: list[tuple[BaseException | None, Received | None]] = []
        all_done = threading.Event()
        lock = threading.Lock()

        def done(error: BaseException | None, received: Received | None) -> None:
            with lock:
                results.append((error, received))
                if len(results) == 32:
                    all_done.set()

        keys = [make_key(f"pending{i}") for i in range(32)]
        for key in keys:
            client.start_recv(server.address, 1, key, done, timeout=20)
        wait_for(lambda: source.pending_waiters() == 32)
        assert threading.active_count() <= before + 2
        for i, key in enumerate(keys):
            source.send(1, key, np.array([i]))
        assert all_done.wait(10)
        assert sorted(int(r.value[0]) for e, r in results if r is not None) == list(range(32))
        assert all(e is None for e, _ in results)


def test_client_done_may_block_without_stalling_other_receives(
    source: StepSource, server: RpcServer
) -> None:
    # A done that waits for another receive of the same client must not deadlock it.
    with RpcClient() as client:
        first, second = make_key("first"), make_key("second")
        inner: list[Received] = []
        finished = threading.Event()

        def done(error: BaseException | None, received: Received | None) -> None:
            inner.append(pull(client, server.address, 1, second, timeout=5))
            finished.set()

        client.start_recv(server.address, 1, first, done, timeout=10)
        source.send(1, first, np.array([1]))
        time.sleep(0.1)
        source.send(1, second, np.array([2]))
        assert finished.wait(10)
        assert inner[0].value.tolist() == [2]


def test_client_timeout_removes_the_waiter(source: StepSource, server: RpcServer) -> None:
    with RpcClient() as client:
        key = make_key("late")
        with pytest.raises(DeadlineExceededError, match="late"):
            pull(client, server.address, 1, key, timeout=0.3)
        wait_for(lambda: source.pending_waiters(1) == 0)
        source.send(1, key, np.array([5]))
        assert pull(client, server.address, 1, key, timeout=5).value.tolist() == [5]
