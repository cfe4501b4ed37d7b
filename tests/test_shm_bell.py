"""Doorbell semaphores: create/open checks, ring/wait/drain, timeouts, signals, squatting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import posix_ipc
import pytest
from helpers import SHMRDV_PATH

from shmrdv._errors import InternalError
from shmrdv._shm.bell import Bell
from shmrdv._shm.naming import Names

TASK = "/job:worker/replica:0/task:0"


@pytest.fixture
def bell(names: Names) -> Iterator[Bell]:
    b = Bell.create(names, TASK)
    yield b
    b.close()
    b.unlink()


def test_bell_create_open_ring_wait_drain(names: Names, bell: Bell) -> None:
    st = os.stat(names.bell_path(TASK))
    assert st.st_mode & 0o777 == 0o600
    assert bell.pending == 0
    assert not bell.wait(0)
    producer = Bell.open(names, TASK)
    assert producer is not None
    with producer:
        producer.ring()
        assert bell.wait(1)
        assert not bell.wait(0)
        for _ in range(3):
            producer.ring()
        assert bell.pending == 3
        assert bell.drain() == 3
        assert bell.drain() == 0
    assert producer.closed
    assert "open" in repr(bell)


def test_bell_open_absent_is_none(names: Names) -> None:
    assert Bell.open(names, TASK) is None


def test_bell_create_existing_refused_unless_stale(names: Names) -> None:
    first = Bell.create(names, TASK)
    try:
        first.ring()
        with pytest.raises(InternalError, match="already exists"):
            Bell.create(names, TASK)
        second = Bell.create(names, TASK, replace_stale=True)
        try:
            # A fresh, empty semaphore under the name; the old handle's one is now nameless.
            assert second.pending == 0
            opened = Bell.open(names, TASK)
            assert opened is not None
            opened.ring()
            opened.close()
            assert second.wait(0)
            assert first.drain() == 1  # the old, nameless semaphore kept its own post
        finally:
            second.close()
            second.unlink()
    finally:
        first.close()
        first.unlink()


def test_bell_umask_does_not_widen_mode(names: Names) -> None:
    old = os.umask(0)
    try:
        b = Bell.create(names, TASK)
    finally:
        os.umask(old)
    try:
        assert os.stat(names.bell_path(TASK)).st_mode & 0o777 == 0o600
    finally:
        b.close()
        b.unlink()


def test_bell_wait_timeout_accuracy(bell: Bell) -> None:
    for timeout in (0.05, 0.2):
        start = time.monotonic()
        assert not bell.wait(timeout)
        elapsed = time.monotonic() - start
        assert timeout - 0.005 <= elapsed <= timeout + 0.05


def test_bell_wait_woken_by_other_thread(bell: Bell) -> None:
    timer = threading.Timer(0.05, bell.ring)
    timer.start()
    start = time.monotonic()
    assert bell.wait(5)
    assert time.monotonic() - start < 1
    timer.join()


def test_bell_wait_retries_after_signal(bell: Bell) -> None:
    # SIGUSR1 rather than SIGALRM: pytest-timeout owns the process's SIGALRM timer.
    hits: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: hits.append(signum))
    main = threading.get_ident()
    stop = threading.Event()

    def poke() -> None:
        while not stop.wait(0.1):
            signal.pthread_kill(main, signal.SIGUSR1)

    poker = threading.Thread(target=poke)
    poker.start()
    try:
        start = time.monotonic()
        assert not bell.wait(0.5)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        poker.join()
        signal.signal(signal.SIGUSR1, old)
    assert hits, "no signal arrived during the wait"
    assert 0.495 <= elapsed <= 0.6


def test_bell_wait_keyboard_interrupt_propagates(bell: Bell) -> None:
    main = threading.get_ident()
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            bell.wait(5)
        assert time.monotonic() - start < 2
    finally:
        timer.join()
        signal.signal(signal.SIGINT, old)
    assert not bell.wait(0)  # usable afterwards


def test_bell_close_wakes_waiter(names: Names) -> None:
    b = Bell.create(names, TASK)
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(b.wait(None)))
    waiter.start()
    time.sleep(0.05)
    start = time.monotonic()
    b.close()
    waiter.join(5)
    assert not waiter.is_alive()
    assert results == [False]
    assert time.monotonic() - start < 1
    b.close()  # idempotent
    with pytest.raises(InternalError, match="closed"):
        b.wait(0)
    with pytest.raises(InternalError, match="closed"):
        b.ring()
    b.unlink()
    b.unlink()  # missing is fine


def test_bell_ring_across_processes(names: Names, bell: Bell) -> None:
    code = (
        "import sys\n"
        "from shmrdv._shm.naming import Names\n"
        "from shmrdv._shm.bell import Bell\n"
        "b = Bell.open(Names(sys.argv[1]), sys.argv[2])\n"
        "b.ring(); b.ring(); b.close()\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, names.namespace, TASK],
        env=dict(os.environ, PYTHONPATH=SHMRDV_PATH),
        check=True,
        timeout=30,
    )
    assert bell.wait(1)
    assert bell.drain() == 1


def test_bell_saturated_ring_is_swallowed(names: Names) -> None:
    sem = posix_ipc.Semaphore(
        names.bell(TASK),
        posix_ipc.O_CREX,
        mode=0o600,
        initial_value=posix_ipc.SEMAPHORE_VALUE_MAX,
    )
    try:
        b = Bell.open(names, TASK)
        assert b is not None
        with b:
            b.ring()
            assert b.pending == posix_ipc.SEMAPHORE_VALUE_MAX
    finally:
        sem.unlink()
        sem.close()


def test_bell_semaphore_raises_where_ring_copes(names: Names) -> None:
    """``semaphore.release`` is the bare post a sender makes: it raises on a saturated
    counter and on a closed handle, where ``ring`` drops the post or says the handle is
    closed."""
    sem = posix_ipc.Semaphore(
        names.bell(TASK),
        posix_ipc.O_CREX,
        mode=0o600,
        initial_value=posix_ipc.SEMAPHORE_VALUE_MAX - 1,
    )
    try:
        b = Bell.open(names, TASK)
        assert b is not None
        post = b.semaphore.release
        post()
        assert b.pending == posix_ipc.SEMAPHORE_VALUE_MAX
        with pytest.raises(OSError):
            post()
        b.ring()  # swallowed
        b.close()
        with pytest.raises(posix_ipc.ExistentialError):
            post()
        with pytest.raises(InternalError, match="closed"):
            b.ring()
    finally:
        sem.unlink()
        sem.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_bell_of_other_uid_refused(names: Names) -> None:
    sem = posix_ipc.Semaphore(names.bell(TASK), posix_ipc.O_CREX, mode=0o600)
    try:
        os.chown(names.bell_path(TASK), 65534, 65534)
        with pytest.raises(InternalError, match="not ours"):
            Bell.open(names, TASK)
        with pytest.raises(InternalError, match="not ours"):
            Bell.create(names, TASK, replace_stale=True)
        assert os.path.exists(names.bell_path(TASK))  # left alone
    finally:
        sem.unlink()
        sem.close()


def test_bell_with_open_mode_refused(names: Names) -> None:
    sem = posix_ipc.Semaphore(names.bell(TASK), posix_ipc.O_CREX, mode=0o600)
    try:
        os.chmod(names.bell_path(TASK), 0o666)
        with pytest.raises(InternalError, match="mode 0o666"):
            Bell.open(names, TASK)
    finally:
        sem.unlink()
        sem.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_bell_planted_by_other_user_refused(names: Names) -> None:
    code = (
        "import os, sys, posix_ipc\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "posix_ipc.Semaphore(sys.argv[1], posix_ipc.O_CREX, mode=0o666).close()\n"
    )
    subprocess.run([sys.executable, "-c", code, names.bell(TASK)], check=True, timeout=30)
    try:
        with pytest.raises(InternalError, match="not ours"):
            Bell.open(names, TASK)
        with pytest.raises(InternalError, match="not ours"):
            Bell.create(names, TASK)
    finally:
        posix_ipc.unlink_semaphore(names.bell(TASK))
