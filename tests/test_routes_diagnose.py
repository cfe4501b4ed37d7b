"""A namespace mismatch explains itself: a receive that times out (or waits long, in
``Worker.stats()``) says where its producer's task is alive. Real child processes in two
namespaces; the scan's bounds checked on real files."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
from pathlib import Path

import pytest
from helpers import wait_for

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._routes import explain_absent_producer
from shmrdv._shm.naming import PREFIX, Names
from shmrdv._shm.presence import _MAX_RECORDS, sightings
from shmrdv._transport import Sighting

# A job name of this run's own: other test runs on the host use /job:worker tasks too.
_JOB = f"diag{os.getpid()}x{secrets.token_hex(4)}"
PRODUCER = f"/job:{_JOB}/replica:0/task:0"
CONSUMER = f"/job:{_JOB}/replica:0/task:1"


def _shown(token: str) -> str:
    """The namespace as a diagnosis shows it: as it appears in the objects' names."""
    return Names(token).prefix[len(PREFIX) : -1]


def _key(name: str = "x") -> str:
    return shmrdv.create_key(PRODUCER + "/device:CPU:0", 0, CONSUMER + "/device:CPU:0", name)


def test_diagnose_timeout_names_the_producers_other_namespace() -> None:
    ours, theirs = shmrdv.new_namespace(), shmrdv.new_namespace()
    with (
        ChildWorker(PRODUCER, namespace=theirs),
        shmrdv.Worker(CONSUMER, namespace=ours) as consumer,
        pytest.raises(shmrdv.DeadlineExceededError) as info,
    ):
        consumer.rendezvous(1).recv(_key(), timeout=0.5)
    msg = str(info.value)
    assert f"task {PRODUCER} is alive in namespace id {_shown(theirs)}" in msg, msg
    assert "producer and consumer must share the namespace" in msg
    assert "the waiter was removed" in msg


def test_diagnose_timeout_says_producer_alive_nowhere() -> None:
    with (
        shmrdv.Worker(CONSUMER, namespace=shmrdv.new_namespace()) as consumer,
        pytest.raises(shmrdv.DeadlineExceededError) as info,
    ):
        consumer.rendezvous(1).recv(_key(), timeout=0.3)
    assert f"task {PRODUCER} is not alive anywhere on this host" in str(info.value)


def test_diagnose_timeout_adds_nothing_when_producer_shares_the_namespace() -> None:
    ns = shmrdv.new_namespace()
    with (
        ChildWorker(PRODUCER, namespace=ns),
        shmrdv.Worker(CONSUMER, namespace=ns) as consumer,
        pytest.raises(shmrdv.DeadlineExceededError) as info,
    ):
        consumer.rendezvous(1).recv(_key(), timeout=0.3)
    assert str(info.value).endswith("the waiter was removed"), str(info.value)


def test_diagnose_long_wait_shows_in_stats_and_goes_away(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="shmrdv.worker")
    ours, theirs = shmrdv.new_namespace(), shmrdv.new_namespace()
    with (
        ChildWorker(PRODUCER, namespace=theirs),
        shmrdv.Worker(CONSUMER, namespace=ours) as consumer,
    ):
        rdv = consumer.rendezvous(3)
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                rdv.recv(_key("long"), timeout=10)
            except shmrdv.RendezvousError as e:
                outcome.append(e)

        t = threading.Thread(target=wait)
        t.start()
        try:
            wait_for(lambda: consumer.stats()["waiting"], 10, "a waiting receive", 0.1)
            (entry,) = consumer.stats()["waiting"]
            assert entry["step"] == 3 and entry["key"] == _key("long")
            assert entry["waited_s"] >= 1.0
            assert f"alive in namespace id {_shown(theirs)}" in entry["diagnosis"]
        finally:
            consumer.cleanup(3)  # the blocked receive fails at once
            t.join(10)
        assert not t.is_alive()
        assert isinstance(outcome[0], shmrdv.AbortedError)
        assert consumer.stats()["waiting"] == []
    lines = [r.getMessage() for r in caplog.records if r.name == "shmrdv.worker"]
    assert any("has waited 1s" in m and f"id {_shown(theirs)}" in m for m in lines), lines


def _record(task: str, pid: int, ns: str) -> bytes:
    return json.dumps(
        {
            "task": task,
            "pid": pid,
            "boot_id": "x",
            "incarnation": 1,
            "started": 0.0,
            "namespace": ns,
            "address": None,
        }
    ).encode()


def test_diagnose_scan_keeps_only_our_private_records(tmp_path: Path) -> None:
    ns = _shown(shmrdv.new_namespace())
    good = tmp_path / f"shmrdv_{ns}_w{'1' * 20}"
    good.write_bytes(_record(PRODUCER, 11, ns))
    good.chmod(0o600)
    shared = tmp_path / f"shmrdv_{ns}_w{'2' * 20}"  # group/other may read: refused
    shared.write_bytes(_record(PRODUCER, 12, ns))
    shared.chmod(0o644)
    big = tmp_path / f"shmrdv_{ns}_w{'3' * 20}"  # far larger than any record: skipped
    big.write_bytes(_record(PRODUCER, 13, ns) + b" " * 8192)
    big.chmod(0o600)
    (tmp_path / f"shmrdv_{ns}_w{'4' * 20}").symlink_to(good)  # never followed
    other = tmp_path / f"shmrdv_{ns}_w{'5' * 20}"  # another task
    other.write_bytes(_record(CONSUMER, 14, ns))
    other.chmod(0o600)
    found = sightings(PRODUCER, ns, shm_dir=str(tmp_path))
    # The one record found is not alive: nobody holds its lock (and its boot id is not ours).
    assert [(s.namespace, s.pid, s.alive, s.ours) for s in found] == [(ns, 11, False, True)]
    assert [s.ours for s in sightings(PRODUCER, "0" * len(ns), shm_dir=str(tmp_path))] == [False]


def test_diagnose_scan_is_bounded(tmp_path: Path) -> None:
    ns = _shown(shmrdv.new_namespace())
    for i in range(_MAX_RECORDS + 20):
        p = tmp_path / f"shmrdv_{ns}_w{i:020x}"
        p.write_bytes(_record(PRODUCER, i + 1, ns))
        os.chmod(p, 0o600)
    assert len(sightings(PRODUCER, ns, shm_dir=str(tmp_path))) == _MAX_RECORDS


def test_diagnose_arecv_timeout_explains_too() -> None:
    with (
        shmrdv.Worker(CONSUMER, namespace=shmrdv.new_namespace()) as consumer,
        pytest.raises(shmrdv.DeadlineExceededError, match="is not alive anywhere on this host"),
    ):
        asyncio.run(consumer.rendezvous(1).arecv(_key(), timeout=0.3))


def test_diagnose_local_timeout_has_no_hint() -> None:
    # Both ends in this worker: the producer is this very process, nothing to explain.
    key = shmrdv.create_key(CONSUMER + "/device:CPU:0", 0, CONSUMER + "/device:CPU:0", "self")
    with (
        shmrdv.Worker(CONSUMER, namespace=shmrdv.new_namespace()) as w,
        pytest.raises(shmrdv.DeadlineExceededError) as info,
    ):
        w.rendezvous(1).recv(key, timeout=0.1)
    assert str(info.value).endswith("the waiter was removed")


def test_diagnose_sentence_from_sightings() -> None:
    seen = [Sighting("aa", 7, True, False), Sighting("bb", 8, False, True)]
    assert "is alive in namespace id aa (pid 7)" in (explain_absent_producer("t", seen) or "")
    assert explain_absent_producer("t", [Sighting("bb", 8, True, True)]) is None
    assert "not alive anywhere" in (explain_absent_producer("t", []) or "")
    assert explain_absent_producer("t", None) is None  # no presence records on this host
