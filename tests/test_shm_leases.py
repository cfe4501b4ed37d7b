"""A planted file under a lease must not stall a worker (issue 13 §1).

Another local user may create a file under a name a worker lists or opens and take a write
lease on it (``fcntl(F_SETLEASE, F_WRLCK)``, allowed to the file's owner). A plain ``open``
of it then blocks for ``/proc/sys/fs/lease-break-time`` (45 s), whatever the caller's
timeout. As root, the test runs the attacker as uid 65534 in a real child process which
plants files under every kind of name the victim opens (computed with the token, as if the
attacker knew it) and re-takes each lease as soon as it is broken. A ``recv`` with a timeout
and an unrelated ``send`` of the same worker from another thread must still keep to their
time.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import CONSUMER, NOBODY, PRODUCER, make_key, remove_planted

import shmrdv
from shmrdv._shm.naming import Names
from shmrdv._shm.reaper import list_objects

ABSENT = "/job:worker/replica:0/task:2"  # only its presence record is planted
BELLLESS = "/job:worker/replica:0/task:3"  # only its doorbell is planted
INCARNATION = 0x1EA5_0000_0000_0001
STEP = 1
#: The slack the issue allows beyond a call's own timeout.
SLACK_S = 0.5

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the attacker as uid 65534"),
]

# The attacker: plant each path (mode 0644), hold a write lease on it and never give it up;
# the kernel removes it lease-break-time after a break began, and it is taken again at once.
_ATTACKER = r"""
import fcntl, os, signal, sys, threading
signal.signal(signal.SIGIO, lambda *a: None)
fds = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.fchmod(fd, 0o644)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    fds.append(fd)
print("ready", flush=True)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.wait(0.005):
    for fd in fds:
        try:
            if fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            pass
"""


@pytest.fixture
def ns(ns: str) -> Iterator[str]:
    """conftest's ``ns``, which differs here only in that root first removes what "nobody"
    planted: ``gc`` leaves another user's objects alone, then collects what is left."""
    yield ns
    remove_planted(ns)


def _planted_paths(names: Names, key: str) -> list[str]:
    """Every kind of name the consumer's or producer's worker opens or lists."""
    inc = INCARNATION
    out = [names.message(STEP, key, inc, seq) for seq in range(3)]
    out.append(names.ring(PRODUCER, inc, CONSUMER))
    # Ring- and message-shaped names of the namespace that no worker made: found by listing.
    out.append(names.prefix + "q" + secrets.token_hex(10))
    out.append(names.prefix + "m" + secrets.token_hex(10))
    out.append(names.presence(ABSENT))
    for slot in range(4):
        out += [names.pool(PRODUCER, inc, slot), names.held(PRODUCER, inc, slot)]
        out.append(names.returned(PRODUCER, inc, slot))
    return [names.path(name) for name in out] + [names.bell_path(BELLLESS)]


def _python_for_nobody() -> str:
    """An interpreter uid 65534 may run (ours may live under root's home)."""
    for exe in (sys.executable, "/usr/bin/python3"):
        try:
            subprocess.run(
                [exe, "-c", "pass"],
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                cwd="/",
                check=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        return exe
    pytest.skip("no Python interpreter that uid 65534 may run")


@pytest.fixture
def attacker(ns: str) -> Iterator[list[str]]:
    names = Names(ns)
    paths = _planted_paths(names, make_key("leased"))
    proc = subprocess.Popen(
        [_python_for_nobody(), "-c", _ATTACKER, *paths],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n", "the attacker could not plant its files"
        yield paths
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _timed(fn: object, results: dict[str, object], name: str) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        try:
            results[name] = fn()  # type: ignore[operator]
        except Exception as e:  # what it raised is judged by the test
            results[name] = e
        results[name + "_s"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_leases_planted_files_do_not_stall_recv_or_send(ns: str, attacker: list[str]) -> None:
    assert all(os.stat(p).st_uid == NOBODY for p in attacker)
    leased = make_key("leased")
    back = make_key("unrelated", src=CONSUMER, dst=PRODUCER)
    absent = make_key("absent", src=ABSENT)
    with (
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        shmrdv.Worker(PRODUCER, namespace=ns, incarnation=INCARNATION) as producer,
    ):
        crdv, prdv = consumer.rendezvous(STEP), producer.rendezvous(STEP)
        results: dict[str, object] = {}
        threads = [
            _timed(lambda: crdv.recv(leased, timeout=2), results, "recv"),
            _timed(lambda: crdv.recv(absent, timeout=2), results, "recv_absent"),
        ]
        time.sleep(0.3)  # both receives are blocked (and looking) now
        threads.append(_timed(lambda: crdv.send(back, np.arange(100_000)), results, "send"))
        threads.append(
            _timed(
                lambda: prdv.send(make_key("x", dst=BELLLESS), np.ones(4)),
                results,
                "bell",
            )
        )
        for thread in threads:
            thread.join(2 + SLACK_S + 1)
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"calls still blocked after {2 + SLACK_S + 1} s: {results}"
        assert results["send_s"] < SLACK_S, results  # type: ignore[operator]
        assert results["bell_s"] < SLACK_S, results  # type: ignore[operator]
        for name in ("recv", "recv_absent"):
            assert results[name + "_s"] < 2 + SLACK_S, results  # type: ignore[operator]
            assert isinstance(results[name], shmrdv.RendezvousError), results
        # The worker still works: the unrelated message arrives, well within its timeout.
        t0 = time.monotonic()
        got = prdv.recv(back, timeout=2)
        assert time.monotonic() - t0 < SLACK_S
        np.testing.assert_array_equal(got.value, np.arange(100_000))
        del got
        # Tools list the namespace without stalling either (they skip the planted files).
        t0 = time.monotonic()
        list_objects(ns)
        assert time.monotonic() - t0 < SLACK_S
        t0 = time.monotonic()
        consumer.cleanup(STEP)  # frees unreceived messages: looks at every message name
        producer.cleanup(STEP)
        assert time.monotonic() - t0 < SLACK_S
