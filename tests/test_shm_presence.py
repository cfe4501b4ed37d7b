"""Presence records: publish, read, the liveness monitor by flock, across real child processes."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import PresenceChild, wait_for

from shmrdv._errors import InternalError, InvalidArgumentError
from shmrdv._shm.naming import SHM_DIR, Names
from shmrdv._shm.presence import Monitor, Presence, PresenceInfo, boot_id, claim, look
from shmrdv._transport import TaskState

TASK = "/job:worker/replica:0/task:1"
OTHER = "/job:worker/replica:0/task:2"


def _info(names: Names, task: str = TASK, incarnation: int = 7) -> PresenceInfo:
    return PresenceInfo(task, os.getpid(), boot_id(), incarnation, time.time(), names.namespace_id)


def read_presence(names: Names, task: str) -> PresenceInfo | None:
    """What ``task``'s record says, read strictly (a corrupt one raises)."""
    return look(names.path(names.presence(task)), strict=True)[1]


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_boot_id_is_cached_uuid() -> None:
    assert boot_id() == boot_id()
    assert len(boot_id()) == 36


def test_presence_publish_read_close(names: Names) -> None:
    info = _info(names)
    with Presence.publish(names, info) as p:
        path = names.path(names.presence(TASK))
        assert p.path == path
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600
        assert read_presence(names, TASK) == info
        assert json.loads(Path(path).read_bytes())["incarnation"] == 7
        assert "pid=" in repr(p)
        # Only the record: the temporary name is gone.
        assert os.listdir(SHM_DIR).count(names.presence(TASK)) == 1
        assert [e for e in os.listdir(SHM_DIR) if names.prefix in e] == [names.presence(TASK)]
    assert not os.path.exists(path)
    assert read_presence(names, TASK) is None
    p.close()  # idempotent


def test_presence_info_json_roundtrip_with_address(names: Names) -> None:
    info = PresenceInfo(TASK, 1, "b", 2**64 - 1, 1.5, names.namespace, "127.0.0.1:2222")
    assert PresenceInfo.from_json(info.to_json(), "x") == info


def test_presence_second_publish_refused_in_process(names: Names) -> None:
    with Presence.publish(names, _info(names)):
        with pytest.raises(InvalidArgumentError, match=f"pid {os.getpid()}"):
            Presence.publish(names, _info(names, incarnation=8))
        current = read_presence(names, TASK)
        assert current is not None and current.incarnation == 7


def test_presence_second_publish_refused_across_processes(names: Names) -> None:
    child = PresenceChild(names, TASK)
    try:
        with pytest.raises(InvalidArgumentError, match=f"already running in pid {child.proc.pid}"):
            Presence.publish(names, _info(names))
    finally:
        assert child.stop() == 0
    assert read_presence(names, TASK) is None


def test_monitor_sees_alive_then_absent_after_clean_exit(names: Names) -> None:
    with Monitor(names) as m:
        assert m.state(TASK) == TaskState("absent")
        child = PresenceChild(names, TASK, incarnation=3)
        try:
            assert m.state(TASK).state == "alive"
            info = m.state(TASK).record
            assert info is not None and info.pid == child.proc.pid and info.incarnation == 3
        finally:
            child.stop()
        assert m.state(TASK).state == "absent"


def test_monitor_sigkilled_child_is_dead_and_replaced(names: Names) -> None:
    child = PresenceChild(names, TASK, incarnation=1)
    with Monitor(names) as m:
        assert m.state(TASK).state == "alive"
        child.kill()
        wait_for(lambda: m.state(TASK).state == "dead", 1.0, "the monitor seeing the peer dead")
        stale = read_presence(names, TASK)
        assert stale is not None and stale.incarnation == 1
        # A new publish replaces the stale record; the monitor notices the new inode.
        with Presence.publish(names, _info(names, incarnation=2)):
            assert m.state(TASK).state == "alive"
            info = m.state(TASK).record
            assert info is not None and info.incarnation == 2 and info.pid == os.getpid()
        assert m.state(TASK).state == "absent"
    child.stop()


def test_monitor_restarted_peer_shows_new_incarnation(names: Names) -> None:
    first = PresenceChild(names, TASK, incarnation=1)
    with Monitor(names) as m:
        info = m.state(TASK).record
        assert info is not None and info.incarnation == 1
        first.kill()
        second = PresenceChild(names, TASK, incarnation=2)
        try:
            assert m.state(TASK).state == "alive"
            info = m.state(TASK).record
            assert info is not None and info.incarnation == 2 and info.pid == second.proc.pid
        finally:
            second.stop()
    first.stop()


def test_monitor_sigstopped_child_stays_alive(names: Names) -> None:
    child = PresenceChild(names, TASK)
    try:
        with Monitor(names) as m:
            os.kill(child.proc.pid, signal.SIGSTOP)
            try:
                for _ in range(5):
                    assert m.state(TASK).state == "alive"
                    time.sleep(0.05)
            finally:
                os.kill(child.proc.pid, signal.SIGCONT)
            assert m.state(TASK).state == "alive"
    finally:
        assert child.stop() == 0


def test_monitor_forked_grandchild_does_not_keep_dead_parent_alive(names: Names) -> None:
    child = PresenceChild(names, TASK, mode="fork")
    grandchild = int(child.extra)
    try:
        with Monitor(names) as m:
            assert m.state(TASK).state == "alive"
            child.kill()
            os.kill(grandchild, 0)  # still running
            wait_for(
                lambda: m.state(TASK).state == "dead", 1.0, "the monitor seeing the parent dead"
            )
    finally:
        child.stop()  # closes the stdin pipe: the grandchild exits too
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_for(lambda: _gone(grandchild), 5.0, f"pid {grandchild} exiting")
    # The killed child's stale record (unless a sweep of another process took it first).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(names.path(names.presence(TASK)))


def test_presence_forked_child_exit_leaves_parent_record(names: Names) -> None:
    child = PresenceChild(names, TASK, mode="forkexit")
    try:
        assert child.extra == "alive"
        assert read_presence(names, TASK) is not None
    finally:
        assert child.stop() == 0


def test_monitor_same_process_presences_see_each_other(names: Names) -> None:
    with (
        Presence.publish(names, _info(names, TASK)),
        Presence.publish(names, _info(names, OTHER)),
        Monitor(names) as m,
    ):
        assert m.state(TASK).state == "alive"
        assert m.state(OTHER).state == "alive"


def test_monitor_closed_presence_in_process_is_absent(names: Names) -> None:
    p = Presence.publish(names, _info(names))
    with Monitor(names) as m:
        assert m.state(TASK).state == "alive"
        p.close()
        assert m.state(TASK).state == "absent"


def test_presence_dropped_unclosed_is_finalized(names: Names) -> None:
    p = Presence.publish(names, _info(names))
    path = p.path
    del p
    gc.collect()
    assert not os.path.exists(path)


def test_monitor_record_from_other_boot_is_dead(names: Names) -> None:
    info = PresenceInfo(TASK, os.getpid(), "another-boot", 1, time.time(), names.namespace)
    with Presence.publish(names, info), Monitor(names) as m:
        assert m.state(TASK) == TaskState("dead")  # and what it says is not trusted


def _plant(names: Names, task: str = TASK, mode: int = 0o600, uid: int | None = None) -> str:
    path = names.path(names.presence(task))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, _info(names, task).to_json())
    os.fchmod(fd, mode)
    if uid is not None:
        os.fchown(fd, uid, uid)
    os.close(fd)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_presence_record_of_other_uid_refused(names: Names) -> None:
    path = _plant(names, uid=65534)
    try:
        with pytest.raises(InternalError, match="not ours"):
            read_presence(names, TASK)
        with Monitor(names) as m, pytest.raises(InternalError, match="not ours"):
            m.state(TASK)
        with pytest.raises(InternalError, match="not ours"):
            Presence.publish(names, _info(names))
    finally:
        os.unlink(path)


def test_presence_record_with_open_mode_refused(names: Names) -> None:
    path = _plant(names, mode=0o644)
    try:
        with pytest.raises(InternalError, match="mode 0o644"):
            read_presence(names, TASK)
    finally:
        os.unlink(path)


def test_presence_symlink_refused(names: Names, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(_info(names).to_json())
    target.chmod(0o600)
    path = names.path(names.presence(TASK))
    os.symlink(target, path)
    try:
        with pytest.raises(InternalError, match="symlink"):
            read_presence(names, TASK)
        with Monitor(names) as m, pytest.raises(InternalError):
            m.state(TASK)
    finally:
        os.unlink(path)


def test_presence_corrupt_record_refused(names: Names) -> None:
    path = names.path(names.presence(TASK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b'{"task": 1')
    os.close(fd)
    try:
        with pytest.raises(InternalError, match="corrupt"):
            read_presence(names, TASK)
        Path(path).write_bytes(json.dumps({"task": TASK}).encode())
        with pytest.raises(InternalError, match="'pid' is missing"):
            read_presence(names, TASK)
    finally:
        os.unlink(path)


def test_presence_publish_failure_leaves_no_temp(names: Names) -> None:
    with Presence.publish(names, _info(names)):
        for _ in range(3):
            with pytest.raises(InvalidArgumentError):
                Presence.publish(names, _info(names))
        assert [e for e in os.listdir(SHM_DIR) if names.prefix in e] == [names.presence(TASK)]


def test_monitor_shared_between_threads(names: Names) -> None:
    errors: list[BaseException] = []
    seen: set[str] = set()
    stop = threading.Event()

    with Monitor(names) as m:

        def poll() -> None:
            try:
                while not stop.is_set():
                    seen.add(m.state(TASK).state)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=poll) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for incarnation in range(50):
                with Presence.publish(names, _info(names, incarnation=incarnation)):
                    time.sleep(0.001)
        finally:
            stop.set()
            for t in threads:
                t.join(5)
    assert not errors
    assert seen <= {"absent", "alive", "dead"} and "alive" in seen


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fds_on(path: str) -> int:
    """This process's descriptors on ``path`` (unlinked or not): other threads' do not count."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(path)
        except OSError:
            continue  # closed meanwhile
    return count


@pytest.mark.slow
def test_liveness_fds_flat_over_many_jobs_in_one_process() -> None:
    """Each job's liveness descriptors go with its workers (issue 11: +40 fds after 40 jobs).

    Every job sends pool-slot tensors between two workers of this process, so the consumer
    gives slots back, which asks whether the producer lives (its presence record's flock).
    """
    import numpy as np

    import shmrdv

    def job() -> None:
        ns = shmrdv.new_namespace()
        a, b = "/job:j/replica:0/task:0", "/job:j/replica:0/task:1"
        with shmrdv.Worker(a, namespace=ns) as wa, shmrdv.Worker(b, namespace=ns) as wb:
            k = shmrdv.create_key(a + "/device:CPU:0", 0, b + "/device:CPU:0", "x")
            for step in range(3):
                wa.rendezvous(step).send(k, np.ones(1 << 18, np.float32))
                got = wb.rendezvous(step).recv(k, timeout=10)
                assert got.value[0] == 1.0
                del got
                gc.collect()  # the slot goes back: a liveness look at the producer
                wb.cleanup(step)
                wa.cleanup(step)

    job()
    job()
    gc.collect()
    before = _open_fds()
    for _ in range(40):
        job()
    gc.collect()
    assert _open_fds() <= before


def test_monitor_bounded_descriptors_over_restarts(names: Names) -> None:
    """A watched task restarted many times: the monitor keeps one descriptor for it."""
    record = names.path(names.presence(TASK))
    before = _fds_on(record)
    with Monitor(names) as m:
        for inc in range(1, 30):
            info = PresenceInfo(TASK, os.getpid(), boot_id(), inc, time.time(), names.namespace)
            with Presence.publish(names, info):
                state = m.state(TASK)
                assert state.state == "alive" and state.record is not None
                assert state.record.incarnation == inc
            assert m.state(TASK).state == "absent"
            assert _fds_on(record) <= before + 1
    assert _fds_on(record) == before


def test_monitor_closed_still_answers_and_keeps_no_descriptor(names: Names) -> None:
    # A pool slot given back after its Worker closed (in the garbage collector) still asks.
    m = Monitor(names)
    record = names.path(names.presence(TASK))
    with Presence.publish(names, _info(names)):
        before = _fds_on(record)
        assert m.state(TASK).state == "alive"
        assert _fds_on(record) == before + 1
        m.close()
        assert _fds_on(record) == before
        assert m.state(TASK).state == "alive" and m.state(OTHER).state == "absent"
        assert _fds_on(record) == before
    m.close()  # idempotent


def test_claim_takes_a_dead_record_only(names: Names) -> None:
    path = names.path(names.presence(TASK))
    with claim(path) as none:
        assert none.state == "absent" and not none.remove()
    child = PresenceChild(names, TASK, incarnation=4)
    try:
        with claim(path) as live:
            assert live.state == "alive" and live.info is not None and live.info.incarnation == 4
            assert not live.remove()
        child.kill()
        with claim(path) as dead, claim(path) as second:
            assert dead.state == "dead" and dead.info is not None
            assert second.state == "alive"  # one claimer at a time
            # A publisher of the task meanwhile is refused, as by a live owner.
            with pytest.raises(InvalidArgumentError, match="already running"):
                Presence.publish(names, _info(names))
            assert dead.remove()
        assert not os.path.exists(path)
    finally:
        child.stop()
