"""Workers in ``fork`` and ``spawn`` children; a Worker inherited across ``fork`` (issue 3 §5).

A child made by either start method creates its own Worker and exchanges values with a
Worker in this process over shared memory. A Worker the child inherited from its parent
through ``fork`` refuses every call with a clear ``InvalidArgumentError`` and leaves the
parent's objects alone, also when the child exits.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import CONSUMER as CHILD
from helpers import PRODUCER as PARENT
from helpers import make_key

import shmrdv
from shmrdv._shm.naming import SHM_DIR


def _child_echo(ns: str, results: Any) -> None:
    """In the child: a new Worker; send a value, receive one, send it back plus one."""
    try:
        with shmrdv.Worker(CHILD, namespace=ns) as w:
            rdv = w.rendezvous(1)
            rdv.send(make_key("hello", src=CHILD, dst=PARENT), np.arange(5, dtype=np.int64))
            got = rdv.recv(make_key("ping", src=PARENT, dst=CHILD), timeout=20)
            rdv.send(make_key("pong", src=CHILD, dst=PARENT), got.value + 1)
            del got
            w.cleanup(1)
        results.put(("ok", os.getpid()))
    except BaseException as e:
        results.put(("error", f"{type(e).__name__}: {e}"))


def _exchange_with_child(
    ctx: Any, parent: shmrdv.Worker, ns: str, target: Callable[[str, Any], None], ping: Any
) -> tuple[Any, Any]:
    """Run ``target`` (``_child_echo``'s protocol) in a child made by ``ctx``: receive its
    hello, send ``ping``, receive its pong; the child reports ok and exits 0. Returns
    copies of hello's and pong's values."""
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(ns, results))
    proc.start()
    try:
        rdv = parent.rendezvous(1)
        hello = rdv.recv(make_key("hello", src=CHILD, dst=PARENT), timeout=30).value.copy()
        rdv.send(make_key("ping", src=PARENT, dst=CHILD), ping)
        pong = rdv.recv(make_key("pong", src=CHILD, dst=PARENT), timeout=30).value.copy()
        status, detail = results.get(timeout=30)
        assert status == "ok", detail
    finally:
        proc.join(30)
        if proc.exitcode is None:
            proc.kill()
            proc.join(10)
        results.close()
        results.join_thread()
    assert proc.exitcode == 0
    return hello, pong


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_in_child_of_each_start_method(method: str, ns: str) -> None:
    ctx: Any = mp.get_context(method)
    with shmrdv.Worker(PARENT, namespace=ns) as parent:
        hello, pong = _exchange_with_child(
            ctx, parent, ns, _child_echo, np.full(3, 41, dtype=np.int32)
        )
        np.testing.assert_array_equal(hello, np.arange(5))
        assert list(pong) == [42, 42, 42]
        assert parent.stats()["shm"]["received"] == 2
        parent.cleanup(1)


def _child_use_inherited(worker: shmrdv.Worker, results: Any) -> None:
    """In a fork child: every use of the parent's Worker must be refused."""
    outcomes = []
    rdv = worker._steps[7]  # the step's rendezvous, made in the parent before the fork
    calls: dict[str, Callable[[], object]] = {
        "rendezvous": lambda: worker.rendezvous(1),
        "send": lambda: rdv.send(make_key("x", src=PARENT, dst=CHILD), np.zeros(1)),
        "recv": lambda: rdv.recv(make_key("y", src=CHILD, dst=PARENT), timeout=1),
        "cleanup": lambda: worker.cleanup(7),
    }
    for name, call in calls.items():
        try:
            call()
        except shmrdv.InvalidArgumentError as e:
            outcomes.append((name, "refused", str(e)))
        except BaseException as e:
            outcomes.append((name, type(e).__name__, str(e)))
        else:
            outcomes.append((name, "accepted", ""))
    worker.close()  # must touch nothing of the parent's
    results.put(outcomes)


def test_worker_inherited_across_fork_is_refused(ns: str) -> None:
    ctx = mp.get_context("fork")
    with shmrdv.Worker(PARENT, namespace=ns) as parent:
        parent.rendezvous(7)
        objects_before = sorted(e for e in os.listdir(SHM_DIR) if ns in e)
        results = ctx.Queue()
        proc = ctx.Process(target=_child_use_inherited, args=(parent, results))
        proc.start()
        try:
            outcomes = results.get(timeout=30)
        finally:
            proc.join(30)
            results.close()
            results.join_thread()
        assert proc.exitcode == 0
        for name, verdict, message in outcomes:
            assert verdict == "refused", (name, verdict, message)
            assert "fork" in message and "create a new Worker" in message, message
            assert str(os.getpid()) in message  # names the process that created it
        # The child's exit and its close() left the parent's objects in place and working.
        assert sorted(e for e in os.listdir(SHM_DIR) if ns in e) == objects_before
        hello, pong = _exchange_with_child(ctx, parent, ns, _child_echo, np.zeros(1))
        assert hello[4] == 4
        assert pong[0] == 1
        parent.cleanup(1)
        parent.cleanup(7)


def _child_collects_then_echoes(ns: str, results: Any) -> None:
    gc.collect()  # what the parent left uncollected is collected here first
    _child_echo(ns, results)


@pytest.mark.timeout(90)
def test_worker_in_a_fork_child_after_a_grpc_worker_closed(ns: str) -> None:
    """grpcio's objects stay in reference cycles: collected in a fork child, the aio
    server's finalizer joined a poller thread the child has not got, and the child's
    Worker spun there for good. A closed gRPC Worker leaves none of them behind."""
    gc.disable()  # nothing collected behind the test's back: only what close() does
    try:
        with (
            shmrdv.Worker(PARENT, namespace=ns, transports=("grpc", "shm")) as producer,
            shmrdv.Worker(CHILD, namespace=ns, transports=("grpc", "shm")) as consumer,
        ):
            key = make_key("over-grpc", src=PARENT, dst=CHILD)
            producer.rendezvous(1).send(key, np.arange(3))
            assert consumer.rendezvous(1).recv(key, timeout=20).value.tolist() == [0, 1, 2]
            assert consumer.stats()["grpc"]["received"] == 1
        ctx: Any = mp.get_context("fork")
        with shmrdv.Worker(PARENT, namespace=ns) as parent:
            hello, pong = _exchange_with_child(
                ctx, parent, ns, _child_collects_then_echoes, np.zeros(1)
            )
            assert hello[4] == 4
            assert pong[0] == 1
            parent.cleanup(1)
    finally:
        gc.enable()
