"""A benchmark run's children: a failure is recorded, not raised, and nothing outlives the run."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from helpers import PRODUCER, make_key

import shmrdv
from shmrdv._bench import children
from shmrdv._bench.children import ChildGroup, Teardown
from shmrdv._procs import ChildFailed, wait_for_close
from shmrdv._shm.reaper import list_objects


def hold_a_value_then_close(conn: Connection, namespace: str) -> None:
    """A child that leaves a segment in the namespace, then closes when told."""
    with shmrdv.Worker(PRODUCER, namespace=namespace) as w:
        w.rendezvous(1).send(make_key("left"), np.zeros(1 << 17, np.uint8))
        conn.send(("ready", os.getpid()))
        wait_for_close(conn)
    conn.send(("bye",))


def fail_after_ready(conn: Connection, namespace: str) -> None:
    conn.send(("ready", os.getpid()))
    raise RuntimeError("this child fails on purpose")


def hang(conn: Connection, namespace: str) -> None:
    """A child that holds a Worker with a value sent and never answers again."""
    with shmrdv.Worker(PRODUCER, namespace=namespace) as w:
        w.rendezvous(1).send(make_key("left"), np.zeros(1 << 17, np.uint8))
        conn.send(("ready", os.getpid()))
        time.sleep(600)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.timeout(120)
def test_children_a_clean_run_says_bye_and_leaves_nothing() -> None:
    outcome = Teardown()
    with children.run(outcome) as run:
        run.group.start("holder", hold_a_value_then_close, run.namespace)
        pid = run.group["holder"].expect("ready", 120.0)[1]
        run.close(["holder"])
        namespace = run.namespace
    assert outcome.failure is None
    assert outcome.processes_stopped == outcome.processes_left == 0
    assert not alive(pid)
    assert list(list_objects(namespace)) == []
    assert outcome.wall_s > 0
    assert outcome.clean == (outcome.leftover_objects == [])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", [fail_after_ready, hang])
def test_children_a_failed_or_hung_child_is_a_failure_not_an_exception(target: Any) -> None:
    outcome = Teardown()
    with children.run(outcome) as run:
        run.group.start("child", target, run.namespace)
        pid = run.group["child"].expect("ready", 120.0)[1]
        run.group["child"].expect("done", 2.0)  # fails (error) or times out (hang)
        pytest.fail("expect should have raised")
    namespace = run.namespace
    assert outcome.failure
    assert not outcome.clean
    assert not alive(pid)
    assert outcome.processes_left == 0
    assert list(list_objects(namespace)) == []
    if target is hang:
        assert outcome.processes_stopped == 1
        assert "done" in outcome.failure
    else:
        assert "on purpose" in outcome.failure


def test_children_other_errors_propagate_after_the_teardown() -> None:
    outcome = Teardown()
    with pytest.raises(ZeroDivisionError), children.run(outcome) as run:
        namespace = run.namespace
        _ = 1 / 0
    assert outcome.failure is None
    assert list(list_objects(namespace)) == []


def _silent(conn: Connection) -> None:
    wait_for_close(conn)


def _raises(conn: Connection) -> None:
    raise ValueError("bad input 42")


def test_children_group_reaps_everything_and_check_alive_names_the_failure() -> None:
    with ChildGroup() as group:
        group.start("a", _silent)
        group.start("b", _raises)
        with pytest.raises(ValueError, match="already started"):
            group.start("a", _silent)
        deadline = time.monotonic() + 30
        with pytest.raises(ChildFailed, match="b failed"):
            while time.monotonic() < deadline:
                group.check_alive()
                time.sleep(0.05)
        group["a"].send(("close",))
        assert group.reap(10) == 0
        assert group.alive() == 0
