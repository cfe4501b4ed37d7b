"""shmrdv._procs: spawned children with a control pipe, bounded waits, parent-death signal."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection

import pytest
from helpers import wait_for

from shmrdv._procs import Child, ChildFailed, ChildTimeout, reap, wait_for_close


def _echo(conn: Connection) -> None:
    while True:
        msg = conn.recv()
        if msg[0] == "close":
            return
        conn.send(("echo", *msg))


def _raises(conn: Connection) -> None:
    raise ValueError("bad input 42")


def _silent(conn: Connection) -> None:
    wait_for_close(conn)


def _ignores_sigterm(conn: Connection) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send(("ready",))
    time.sleep(60)


def _sigterm_runs_finally(conn: Connection, path: str) -> None:
    try:
        conn.send(("ready",))
        time.sleep(60)
    finally:
        with open(path, "w") as f:
            f.write("closed")


def _middle(conn: Connection) -> None:
    grandchild = Child("grandchild", _silent)
    conn.send(("pid", grandchild.pid))
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_child_messages_round_trip_and_close_cleanly() -> None:
    with Child("echo", _echo) as child:
        child.send(("hi", 1))
        assert child.expect("echo", 10) == ("echo", "hi", 1)
        child.send(("close",))
        assert not child.stop(10)  # exited by itself
        assert child.process.exitcode == 0


def test_child_exception_arrives_with_its_traceback() -> None:
    with Child("raiser", _raises) as child, pytest.raises(ChildFailed) as info:
        child.recv(10)
    assert "raiser failed" in str(info.value)
    assert "ValueError: bad input 42" in str(info.value)


def test_child_death_is_reported_with_its_signal() -> None:
    with Child("victim", _silent) as child:
        child.signal(signal.SIGKILL)
        with pytest.raises(ChildFailed, match="victim died \\(killed by signal 9\\)"):
            child.recv(10)


def test_child_silence_is_a_bounded_timeout() -> None:
    with Child("quiet", _silent) as child:
        t0 = time.monotonic()
        with pytest.raises(ChildTimeout, match=r"no 'ready' from quiet within 0\.3 s"):
            child.expect("ready", 0.3)
        assert time.monotonic() - t0 < 3


def test_stop_terminates_then_kills_a_child_that_ignores_sigterm() -> None:
    child = Child("stubborn", _ignores_sigterm)
    child.expect("ready", 30)
    t0 = time.monotonic()
    assert child.stop(0.1, term_wait=0.5)  # had to be stopped
    assert child.process.exitcode == -signal.SIGKILL
    assert time.monotonic() - t0 < 6


def test_sigterm_unwinds_the_child_so_its_finally_blocks_run(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "closed")
    child = Child("unwinds", _sigterm_runs_finally, path)
    child.expect("ready", 30)
    assert reap([child], 0.0) == 1
    with open(path) as f:
        assert f.read() == "closed"
    child.close()


@pytest.mark.slow
def test_a_child_dies_with_its_parent() -> None:
    with Child("middle", _middle, daemon=False) as middle:
        _, grandchild = middle.expect("pid", 60)
        assert _alive(grandchild)
        middle.signal(signal.SIGKILL)  # no chance to clean up: only PR_SET_PDEATHSIG acts
        wait_for(
            lambda: not _alive(grandchild),
            20,
            f"grandchild {grandchild} dying with its parent",
            0.05,
        )


def test_stop_closes_the_pipe_so_a_waiting_child_exits_by_itself() -> None:
    child = Child("waiter", _silent)
    t0 = time.monotonic()
    assert not child.stop(20)  # EOF ended wait_for_close: no signal needed
    assert child.process.exitcode == 0
    assert time.monotonic() - t0 < 20


def _affinity(conn: Connection) -> None:
    conn.send(("cpus", sorted(os.sched_getaffinity(0))))
    wait_for_close(conn)


def test_cpus_pins_the_child_before_its_target_runs() -> None:
    usable = sorted(os.sched_getaffinity(0))
    with Child("pinned", _affinity, cpus=[usable[-1]]) as pinned, Child("free", _affinity) as free:
        assert pinned.expect("cpus", 30) == ("cpus", [usable[-1]])
        assert free.expect("cpus", 30) == ("cpus", usable)


def test_cpus_outside_the_mask_fail_the_child_and_empty_cpus_are_refused() -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    child = Child("unpinnable", _affinity, cpus=[outside])
    with child, pytest.raises(ChildFailed, match=r"unpinnable failed:(.|\n)*OSError"):
        child.recv(30)
    with pytest.raises(ValueError, match="cpus must name at least one CPU"):
        Child("nowhere", _affinity, cpus=[])


def _reports_progress(conn: Connection, steps: int) -> None:
    for n in range(steps):
        conn.send(("progress", n))
    conn.send(("done", steps))
    wait_for_close(conn)


def test_expect_hands_other_kinds_to_other_and_fails_on_unhandled_ones() -> None:
    seen: list[tuple[object, ...]] = []

    def note(msg: tuple[object, ...]) -> bool:
        seen.append(msg)
        return True

    with Child("reporter", _reports_progress, 3) as child:
        assert child.expect("done", 30, other=note) == ("done", 3)
    assert seen == [("progress", 0), ("progress", 1), ("progress", 2)]
    child = Child("reporter", _reports_progress, 1)
    unhandled = r"expected 'done' from reporter, got \('progress', 0\)"
    with child, pytest.raises(ChildFailed, match=unhandled):
        child.expect("done", 30, other=lambda m: False)
