"""Worker: construction, steps, cleanup and tombstones, routing checks, close, stats."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from flood_helpers import silent_call_outcomes
from helpers import wait_for

import shmrdv
from shmrdv import testing
from shmrdv._rpc import messages
from shmrdv._rpc.messages import GET_STATUS as GET_STATUS_METHOD
from shmrdv._rpc.messages import RECV_TENSOR as RECV_TENSOR_METHOD
from shmrdv._worker import _TOMBSTONES

TASK = "/job:worker/replica:0/task:0"
DEV = TASK + "/device:CPU:0"
OTHER = "/job:worker/replica:0/task:10/device:CPU:0"


@pytest.fixture
def worker() -> Iterator[shmrdv.Worker]:
    with shmrdv.Worker(TASK, namespace=shmrdv.new_namespace()) as w:
        yield w


def key(edge: str, src: str = DEV, dst: str = DEV, inc: int = 0) -> str:
    return shmrdv.create_key(src, inc, dst, edge)


def test_worker_namespace_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = shmrdv.new_namespace()
    monkeypatch.setenv("SHMRDV_NAMESPACE", ns)
    with shmrdv.Worker(TASK) as w:
        assert w.namespace == ns


def test_worker_without_namespace_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHMRDV_NAMESPACE", raising=False)
    with pytest.raises(shmrdv.InvalidArgumentError, match="new_namespace"):
        shmrdv.Worker(TASK)


def test_worker_namespace_is_unguessable() -> None:
    tokens = {shmrdv.new_namespace() for _ in range(200)}
    assert len(tokens) == 200
    assert all(len(t) >= 20 and t.isalnum() and t.islower() for t in tokens)


@pytest.mark.parametrize(
    "task", ["", "/job:w", "/cpu:0", "/job:w/replica:0", "not a name", "/job:1bad/task:0"]
)
def test_worker_bad_task_refused(task: str) -> None:
    with pytest.raises(shmrdv.InvalidArgumentError):
        shmrdv.Worker(task, namespace=shmrdv.new_namespace())


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "shm"), "shm", ("SHM",), ()])
def test_worker_bad_transports_refused(transports: object) -> None:
    with pytest.raises(shmrdv.InvalidArgumentError, match="transports"):
        shmrdv.Worker(TASK, namespace=shmrdv.new_namespace(), transports=transports)  # type: ignore[arg-type]


@pytest.mark.parametrize("pool", [-1, True, 1.5, "512"])
def test_worker_bad_shm_pool_bytes_refused(pool: object) -> None:
    with pytest.raises(shmrdv.InvalidArgumentError, match="shm_pool_bytes"):
        shmrdv.Worker(TASK, namespace=shmrdv.new_namespace(), shm_pool_bytes=pool)  # type: ignore[arg-type]


@pytest.mark.parametrize("inc", [0, -1, 2**64, 1.5, True])
def test_worker_bad_incarnation_refused(inc: object) -> None:
    with pytest.raises(shmrdv.InvalidArgumentError, match="incarnation"):
        shmrdv.Worker(TASK, namespace=shmrdv.new_namespace(), incarnation=inc)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("max_connections", 0, "positive int"),
        ("max_connections", True, "positive int"),
        ("max_connections", 10**9, "file descriptors (ulimit -n)"),
        ("max_concurrent_rpcs", 0, "positive int"),
        ("max_concurrent_rpcs", 2.5, "positive int"),
        ("first_message_timeout", 0, "seconds"),
        ("first_message_timeout", -1.0, "seconds"),
        ("first_message_timeout", "5", "seconds"),
    ],
)
def test_worker_bad_server_limits_refused(option: str, value: object, says: str) -> None:
    """Checked at construction, also for a worker that starts no server."""
    with pytest.raises(shmrdv.InvalidArgumentError, match=option) as info:
        shmrdv.Worker(TASK, namespace=shmrdv.new_namespace(), **{option: value})  # type: ignore[arg-type]
    assert says in str(info.value)


def test_worker_server_limits_reach_its_server() -> None:
    """The Worker's options bound its gRPC server: connections, calls, silence."""
    with shmrdv.Worker(
        TASK,
        namespace=shmrdv.new_namespace(),
        transports=("grpc",),
        max_connections=3,
        max_concurrent_rpcs=2,
        first_message_timeout=0.3,
    ) as w:
        assert w.address is not None
        [(code, details, took)] = silent_call_outcomes(w.address, GET_STATUS_METHOD)
        assert code == grpc.StatusCode.UNAVAILABLE and "first_message_timeout" in details
        assert took < 5
        own_connection = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.insecure_channel(w.address, own_connection) for _ in range(5)]
        try:
            status = [ch.unary_unary(GET_STATUS_METHOD) for ch in channels]
            served, refused = [], []
            for i, call in enumerate(status):
                try:
                    call(b"", timeout=10)
                    served.append(i)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    refused.append(i)
            # 3 connections at most (the silent call's may not be gone yet).
            assert 2 <= len(served) <= 3 and served[0] == 0, (served, refused)
            inline = channels[0].unary_unary(RECV_TENSOR_METHOD)
            parked = [
                inline.future(messages.encode_request(1, key(f"parked{i}"), i + 1), timeout=20)
                for i in range(2)
            ]
            wait_for(lambda: w.stats()["grpc"]["server_parked"] == 2, timeout=10, what="2 parked")
            with pytest.raises(grpc.RpcError) as busy:
                status[0](b"", timeout=10)  # a third call in flight
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in parked:
                call.cancel()
        finally:
            for ch in channels:
                ch.close()


def test_worker_incarnation_random_nonzero_or_given() -> None:
    ns = shmrdv.new_namespace()
    seen = set()
    for i in range(5):
        with shmrdv.Worker(f"/job:w/task:{i}", namespace=ns) as w:
            assert 0 < w.incarnation < 2**64
            seen.add(w.incarnation)
    assert len(seen) == 5
    with shmrdv.Worker(TASK, namespace=ns, incarnation=42) as w:
        assert w.incarnation == 42


def test_worker_task_is_canonical(worker: shmrdv.Worker) -> None:
    with shmrdv.Worker("/job:worker/task:3", namespace=worker.namespace) as w:
        assert w.task == "/job:worker/replica:0/task:3"


def test_worker_one_live_worker_per_task(worker: shmrdv.Worker) -> None:
    with pytest.raises(shmrdv.InvalidArgumentError, match="already running") as info:
        shmrdv.Worker(TASK, namespace=worker.namespace)
    text = str(info.value)
    # The holder is this very process, and the message says so; the namespace goes by its id.
    assert (
        f"in this process itself (pid {os.getpid()}, incarnation {worker.incarnation:#x})" in text
    )
    assert f"namespace id {shmrdv.namespace_id(worker.namespace)}" in text
    assert worker.namespace not in text


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_worker_cleanup_between_a_receives_check_and_its_transport_fails_it(
    transport: str,
) -> None:
    """A cleanup that lands after a receive found its step open and before the transport
    took the receive (a thread switch there) fails it at once: no wait, nothing kept."""
    ns, step = shmrdv.new_namespace(), 4
    consumer_task, producer_task = TASK, "/job:worker/replica:0/task:1"
    k = key("racing", src=producer_task + "/device:CPU:0")
    with (
        shmrdv.Worker(consumer_task, namespace=ns, transports=(transport,)) as w,
        shmrdv.Worker(producer_task, namespace=ns, transports=(transport,)),
    ):
        rdv = w.rendezvous(step)
        rdv.recv_future(key("first", src=producer_task + "/device:CPU:0")).cancel()
        [t] = w._active  # the transport the receive goes to, made by the receive above
        start_recv = t.start_recv

        def cleaned_up_first(*args: Any, **kwargs: Any) -> Any:
            w.cleanup(step)  # as another thread would, between the check and this call
            return start_recv(*args, **kwargs)

        t.start_recv = cleaned_up_first  # type: ignore[method-assign]
        began = time.monotonic()
        with pytest.raises(shmrdv.AbortedError, match=f"Cleanup {step}"):
            rdv.recv(k, timeout=20)
        assert time.monotonic() - began < 10  # failed, not timed out
        if transport == "shm":
            assert w.stats()["shm"]["channels"] == 0  # no state made for the step


def test_worker_rendezvous_same_object_per_step(worker: shmrdv.Worker) -> None:
    assert worker.rendezvous(1) is worker.rendezvous(1)
    assert worker.rendezvous(1) is not worker.rendezvous(2)


@pytest.mark.parametrize("step", [1.0, "1", True, 2**63, -(2**63) - 1])
def test_worker_bad_step_refused(worker: shmrdv.Worker, step: object) -> None:
    for call in (worker.rendezvous, worker.cleanup, worker.is_cleaned_up):
        with pytest.raises(shmrdv.InvalidArgumentError, match="step_id"):
            call(step)  # type: ignore[arg-type]


def test_worker_in_process_no_copy(worker: shmrdv.Worker) -> None:
    rdv = worker.rendezvous(0)
    a = np.arange(5)
    rdv.send(key("x"), a)
    assert rdv.recv(key("x"), timeout=1).value is a
    assert worker.stats()["local"]["sent"] == 1


def test_worker_cleanup_aborts_pending_and_later_calls(worker: shmrdv.Worker) -> None:
    rdv = worker.rendezvous(7)
    box: list[BaseException] = []
    t = threading.Thread(target=lambda: box.append(_recv_error(rdv, key("y"))))
    t.start()
    time.sleep(0.05)
    start = time.monotonic()
    worker.cleanup(7)
    t.join(5)
    assert time.monotonic() - start < 1
    assert isinstance(box[0], shmrdv.AbortedError) and str(box[0]).startswith("Cleanup 7: ")
    # The message says what happened and what to do (a step id is not reused).
    assert "was cleaned up" in str(box[0]) and "new step id" in str(box[0])
    with pytest.raises(shmrdv.AbortedError, match="Cleanup 7"):
        rdv.send(key("y"), np.zeros(1))
    later = worker.rendezvous(7)
    with pytest.raises(shmrdv.AbortedError, match="Cleanup 7"):
        later.recv(key("y"), timeout=1)
    assert worker.is_cleaned_up(7)
    assert worker.rendezvous(8).aborted is None


def test_worker_a_cleaned_up_step_asked_for_again_aborts_it_here_only(ns: str) -> None:
    # The transports forgot step 7 at its cleanup; asking for it again must not make them
    # remember an abort of it for ever (each send would check it, each ask add to it).
    with shmrdv.Worker(TASK, namespace=ns) as worker:
        worker.rendezvous(7).send(key("x", dst=OTHER), np.zeros(1))  # shared memory is up
        worker.cleanup(7)
        for _ in range(3):
            with pytest.raises(shmrdv.AbortedError, match="Cleanup 7"):
                worker.rendezvous(7).send(key("x", dst=OTHER), np.zeros(1))
        shm = next(t for t in worker._active if t.name == "shm")
        assert not shm._consumer._aborted and not shm._consumer.refusing


def _recv_error(rdv: shmrdv.Rendezvous, k: str) -> BaseException:
    try:
        rdv.recv(k, timeout=5)
    except BaseException as e:
        return e
    raise AssertionError("recv returned a value")


@pytest.mark.slow
def test_worker_tombstones_are_bounded(worker: shmrdv.Worker) -> None:
    for step in range(_TOMBSTONES + 10):
        worker.cleanup(step)
    assert worker.stats()["tombstones"] == _TOMBSTONES
    assert not worker.is_cleaned_up(0)
    assert worker.is_cleaned_up(_TOMBSTONES + 9)


def test_worker_checks_src_and_dst_as_parsed_tasks(worker: shmrdv.Worker) -> None:
    rdv = worker.rendezvous(0)
    # task:10 is not task:1's prefix sibling: TensorFlow's string-prefix trap.
    with shmrdv.Worker("/job:worker/replica:0/task:1", namespace=worker.namespace) as w1:
        r1 = w1.rendezvous(0)
        with pytest.raises(shmrdv.InvalidArgumentError, match=r"Invalid rendezvous key \(src\)"):
            r1.send(key("z", src=OTHER, dst=OTHER), np.zeros(1))
        with pytest.raises(shmrdv.InvalidArgumentError, match=r"Invalid rendezvous key \(dst\)"):
            r1.recv(key("z", src=OTHER, dst=OTHER), timeout=1)
    with pytest.raises(shmrdv.InvalidArgumentError, match=r"\(src\)"):
        rdv.send(key("z", src=OTHER), np.zeros(1))
    with pytest.raises(shmrdv.InvalidArgumentError, match=r"\(dst\)"):
        rdv.recv(key("z", dst=OTHER), timeout=1)


def test_worker_key_of_another_task_says_which_tasks_and_what_to_do(
    worker: shmrdv.Worker,
) -> None:
    rdv = worker.rendezvous(0)
    other_task = "/job:worker/replica:0/task:10"
    with pytest.raises(shmrdv.InvalidArgumentError) as info:
        rdv.recv(key("d", dst=OTHER), timeout=1)
    text = str(info.value)
    assert text.startswith("Invalid rendezvous key (dst): ")  # TensorFlow's words first
    assert f"the key's consumer (dst) is task {other_task}" in text
    assert f"this worker is {TASK}" in text
    assert "call recv on the Worker of the task the key names" in text
    assert f"a dst device of this task (e.g. {TASK}/device:CPU:0)" in text
    with pytest.raises(shmrdv.InvalidArgumentError) as info:
        rdv.send(key("s", src=OTHER), np.zeros(1))
    text = str(info.value)
    assert f"the key's producer (src) is task {other_task}" in text
    assert f"this worker is {TASK}" in text
    assert "call send on the Worker of the task the key names" in text
    # A device without a task (TensorFlow's legacy "/cpu:0") is said to name none.
    with pytest.raises(shmrdv.InvalidArgumentError, match="names no task"):
        rdv.recv(key("l", dst="/cpu:0"), timeout=1)


@contextlib.contextmanager
def _pair_on(path: str) -> Iterator[tuple[shmrdv.Rendezvous, shmrdv.Rendezvous, str]]:
    """(producer's rendezvous, consumer's, the dst device) of step 0 over ``path``: both in
    one worker (in-process), or two workers of this process on shared memory or gRPC."""
    ns = shmrdv.new_namespace()
    if path == "in-process":
        with shmrdv.Worker(TASK, namespace=ns) as w:
            yield w.rendezvous(0), w.rendezvous(0), DEV
        return
    transports = ("grpc",) if path == "grpc" else None
    peer = "/job:worker/replica:0/task:1"
    with (
        shmrdv.Worker(TASK, namespace=ns, transports=transports) as producer,
        shmrdv.Worker(peer, namespace=ns, transports=transports) as consumer,
    ):
        yield producer.rendezvous(0), consumer.rendezvous(0), peer + "/device:CPU:0"


@pytest.mark.parametrize("path", ["in-process", "shm", "grpc"])
def test_worker_refuses_long_keys_and_non_number_timeouts_on_every_path(path: str) -> None:
    # One check, in the core, for every transport: a key the shared-memory path refused
    # (over its header's bound) went out over gRPC and could never be received there;
    # timeout="1" and timeout=True were taken as 1 s.
    from shmrdv._keys import MAX_KEY_BYTES

    with _pair_on(path) as (out, inbox, dst):
        long_key = f"{DEV};0000000000000000;{dst};{'e' * MAX_KEY_BYTES};0:0"
        good = key("good", dst=dst)
        errors: list[str] = []
        for call in (
            lambda: out.send(long_key, np.ones(3)),
            lambda: inbox.recv(long_key, timeout=1),
            lambda: out.allocate(long_key, (3,), np.float64),
        ):
            with pytest.raises(shmrdv.InvalidArgumentError) as info:
                call()
            errors.append(str(info.value))
        for text in errors:
            assert f"is too long: at most {MAX_KEY_BYTES} bytes" in text, text
            assert len(text) < 1000  # the key itself is shortened
        for bad in ("1", True, b"1", -1.0, float("nan")):
            with pytest.raises(shmrdv.InvalidArgumentError, match="timeout must be") as info:
                out.send(good, np.ones(3), timeout=bad)  # type: ignore[arg-type]
            assert repr(bad) in str(info.value)
            with pytest.raises(shmrdv.InvalidArgumentError, match="timeout must be"):
                inbox.recv(good, timeout=bad)  # type: ignore[arg-type]
        # Nothing was sent or left waiting by the refused calls.
        out.send(good, np.full(3, 7.0), timeout=1)
        assert inbox.recv(good, timeout=10).value.tolist() == [7.0, 7.0, 7.0]
        with pytest.raises(shmrdv.DeadlineExceededError):
            inbox.recv(good, timeout=0.2)


@pytest.mark.parametrize("transports", [None, ("grpc",)], ids=["shm", "grpc"])
def test_worker_sends_memmap_refuses_masked_array(
    tmp_path: Any, transports: tuple[str, ...] | None
) -> None:
    from shmrdv._procs import ChildWorker

    ns = shmrdv.new_namespace()
    peer = "/job:worker/replica:0/task:1"
    with (
        shmrdv.Worker(TASK, namespace=ns, transports=transports) as w,
        ChildWorker(peer, namespace=ns, transports=transports) as child,
    ):
        rdv = w.rendezvous(0)
        mapped = np.memmap(tmp_path / "m", dtype=np.float64, mode="w+", shape=(256, 256))
        mapped[:] = np.arange(256 * 256, dtype=np.float64).reshape(256, 256)
        k = key("mapped", dst=peer + "/device:CPU:0")
        rdv.send(k, mapped)
        testing.assert_same(child.recv(k, timeout=10).value, np.asarray(mapped), "memmap")
        masked = np.ma.masked_array(np.arange(3.0), mask=[True, False, False])
        k = key("masked", dst=peer + "/device:CPU:0")
        with pytest.raises(shmrdv.InvalidArgumentError, match="without the mask"):
            rdv.send(k, masked)
        with pytest.raises(shmrdv.DeadlineExceededError):
            child.recv(k, timeout=0.3)  # nothing of it was sent
        del mapped
        child.close()


def test_worker_incarnation_mismatch_is_aborted(worker: shmrdv.Worker) -> None:
    rdv = worker.rendezvous(0)
    stale = key("w", inc=(worker.incarnation + 1) % 2**64 or 1)
    with pytest.raises(shmrdv.AbortedError, match="incarnation"):
        rdv.send(stale, np.zeros(1))
    with pytest.raises(shmrdv.AbortedError, match="incarnation"):
        rdv.recv(stale, timeout=1)
    ok = key("w", inc=worker.incarnation)
    rdv.send(ok, np.ones(1))
    assert rdv.recv(ok, timeout=1).value[0] == 1


def test_worker_close_is_idempotent_and_aborts(worker: shmrdv.Worker) -> None:
    rdv = worker.rendezvous(3)
    fut = rdv.recv_future(key("c"))
    worker.close()
    worker.close()
    assert worker.closed
    with pytest.raises(shmrdv.AbortedError):
        fut.result(timeout=2)
    with pytest.raises(shmrdv.AbortedError, match="closed"):
        worker.rendezvous(4)
    worker.cleanup(3)  # nothing left to free: a ``finally`` after close does not raise
    worker.cleanup(4)


def test_worker_repr_and_stats(worker: shmrdv.Worker) -> None:
    assert TASK in repr(worker) and "open" in repr(worker)
    stats = worker.stats()
    assert stats["task"] == TASK and "shm" in stats


def test_worker_conformance_in_process() -> None:
    """The battery over one worker's step rendezvous (both ends in the worker)."""
    ns = shmrdv.new_namespace()
    steps = iter(range(1000))

    import contextlib

    @contextlib.contextmanager
    def pair() -> Iterator[testing.RendezvousPair]:
        with shmrdv.Worker(TASK, namespace=ns) as w:
            rdv = w.rendezvous(next(steps))
            yield testing.RendezvousPair(
                producer=rdv, consumer=rdv, make_key=lambda e: shmrdv.create_key(DEV, 0, DEV, e)
            )

    testing.run_conformance(pair)
