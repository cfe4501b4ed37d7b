"""Listing and collecting shmrdv objects: live namespaces are untouched, dead ones go whole."""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import PresenceChild

import shmrdv
from shmrdv._shm import header as layout
from shmrdv._shm import registry
from shmrdv._shm.bell import Bell
from shmrdv._shm.naming import SHM_DIR, Names
from shmrdv._shm.presence import Presence, PresenceInfo, boot_id
from shmrdv._shm.registry import ObjectInfo, collect, list_objects

TASK = "/job:worker/replica:0/task:1"
KEY = (
    "/job:worker/replica:0/task:0/device:CPU:0;0000000000000001;"
    "/job:worker/replica:0/task:1/device:CPU:0;x;0:0"
)


def _fresh() -> Names:
    return Names(secrets.token_hex(13))


def _ours(names: Names, directory: str = SHM_DIR) -> set[str]:
    return {e for e in os.listdir(directory) if names.prefix in e}


@pytest.fixture
def other() -> Iterator[Names]:
    n = _fresh()
    yield n
    for entry in _ours(n):
        os.unlink(os.path.join(SHM_DIR, entry))


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _segments(names: Names, directory: str = SHM_DIR, step_id: int = 3) -> None:
    """A published message with a real header, and an unwritten temp segment."""
    header = layout.Header.build(
        key=KEY,
        dtype=np.dtype("<f4"),
        shape=(4,),
        step_id=step_id,
        seq=0,
        producer_incarnation=1,
        producer_pid=4242,
    )
    buf = bytearray(header.segment_size)
    layout.pack_into(buf, header)
    _write(os.path.join(directory, names.message(step_id, KEY, 1, 0)), bytes(buf))
    _write(os.path.join(directory, names.temp()), bytes(256))


def _by_kind(infos: list[ObjectInfo]) -> dict[str, ObjectInfo]:
    out = {i.kind: i for i in infos}
    assert len(out) == len(infos)
    return out


def test_registry_live_namespace_listed_and_kept(names: Names) -> None:
    worker = PresenceChild(names, TASK, incarnation=5)
    bell = Bell.create(names, TASK)
    try:
        _segments(names)
        infos = list_objects(names.namespace)
        kinds = _by_kind(infos)
        assert set(kinds) == {"presence", "bell", "message", "temp"}
        assert all(i.namespace == names.namespace_id and i.alive for i in infos)
        presence = kinds["presence"]
        assert presence.owner_pid == worker.proc.pid and presence.task == TASK
        assert presence.path == names.path(names.presence(TASK))
        assert kinds["bell"].task == TASK and kinds["bell"].owner_pid == worker.proc.pid
        assert kinds["bell"].name == "sem." + names.bell(TASK)[1:]
        message = kinds["message"]
        assert (message.step_id, message.key, message.owner_pid) == (3, KEY, 4242)
        assert message.size >= 64 and 0 <= message.age_s < 60
        temp = kinds["temp"]
        assert (temp.step_id, temp.key, temp.owner_pid) == (None, None, None)

        assert collect(names.namespace) == []
        assert collect(names.namespace, dry_run=True) == []
        assert len(list_objects(names.namespace)) == 4
    finally:
        bell.close()
        bell.unlink()
        worker.stop()
    # The worker's clean exit removed its record; what is left is a dead namespace's.
    removed = collect(names.namespace)
    assert {i.kind for i in removed} == {"message", "temp"}
    assert not _ours(names)


def test_registry_dead_namespace_collected_whole(names: Names, other: Names) -> None:
    worker = PresenceChild(names, TASK, incarnation=5)
    bell = Bell.create(names, TASK)
    bell.close()
    _segments(names)
    worker.kill()  # leaves its presence record, unlocked
    # Another namespace, alive (in this process) and one dead but not asked for.
    live = Presence.publish(
        other, PresenceInfo(TASK, os.getpid(), boot_id(), 1, time.time(), other.namespace)
    )
    third = _fresh()
    _segments(third)
    try:
        _segments(other)
        infos = list_objects(names.namespace)
        assert {i.kind for i in infos} == {"presence", "bell", "message", "temp"}
        assert not any(i.alive for i in infos)
        assert _by_kind(infos)["presence"].owner_pid == worker.proc.pid

        would = collect(names.namespace, dry_run=True)
        assert [i.name for i in would] == [i.name for i in infos]
        assert len(_ours(names)) == 4

        removed = collect(names.namespace)
        assert [i.name for i in removed] == [i.name for i in infos]
        assert not _ours(names)
        assert len(_ours(other)) == 3
        assert len(_ours(third)) == 2
        assert collect(other.namespace) == []
    finally:
        live.close()
        for entry in _ours(third):
            os.unlink(os.path.join(SHM_DIR, entry))


def test_registry_collect_all_namespaces(tmp_path: Path) -> None:
    # A private directory: collect() over every namespace of the real /dev/shm would take
    # other tests' objects.
    directory = str(tmp_path)
    dead, live = _fresh(), _fresh()
    for n in (dead, live):
        _segments(n, directory)
        record = os.path.join(directory, n.presence(TASK))
        _write(record, PresenceInfo(TASK, 1, boot_id(), 1, 0.0, n.namespace).to_json())
    (tmp_path / "unrelated").write_bytes(b"x")
    (tmp_path / "shmrdv_notanamespace").write_bytes(b"x")
    fd = os.open(os.path.join(directory, live.presence(TASK)), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert len(list_objects(shm_dir=directory)) == 6
        removed = collect(shm_dir=directory)
        assert {i.namespace for i in removed} == {dead.namespace_id}
        assert len(removed) == 3
        assert _ours(dead, directory) == set()
        assert len(_ours(live, directory)) == 3
        assert {"unrelated", "shmrdv_notanamespace"} <= set(os.listdir(directory))
    finally:
        os.close(fd)
    assert len(collect(shm_dir=directory)) == 3


def test_registry_corrupt_record_still_counts_by_lock(tmp_path: Path) -> None:
    directory = str(tmp_path)
    n = _fresh()
    record = os.path.join(directory, n.presence(TASK))
    _write(record, b"not json")
    fd = os.open(record, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        [info] = list_objects(shm_dir=directory)
        assert info.alive is True and info.owner_pid is None and info.task is None
        assert collect(shm_dir=directory) == []
    finally:
        os.close(fd)
    [gone] = collect(shm_dir=directory)
    assert gone.kind == "presence" and gone.alive is False


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_registry_other_users_objects_untouched(names: Names) -> None:
    _segments(names)
    foreign = names.path(names.message(9, KEY, 1, 1))
    _write(foreign, bytes(64))
    os.chown(foreign, 65534, 65534)
    try:
        assert foreign not in {i.path for i in list_objects(names.namespace)}
        assert {i.kind for i in collect(names.namespace)} == {"message", "temp"}
        assert os.path.exists(foreign)
    finally:
        os.unlink(foreign)


def test_registry_symlinks_ignored(names: Names, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x")
    link = names.path(names.temp())
    os.symlink(target, link)
    try:
        assert list_objects(names.namespace) == []
        assert collect(names.namespace) == []
        assert os.path.islink(link) and target.exists()
    finally:
        os.unlink(link)


def test_registry_collect_skips_replaced_file(tmp_path: Path) -> None:
    # A file replaced between the listing and its removal (a worker restarting meanwhile)
    # is not taken: removal compares the inode with the listed one.
    directory = str(tmp_path)
    n = _fresh()
    _segments(n, directory)
    entries = registry._scan(directory, n.namespace)
    assert len(entries) == 2
    for entry in entries:
        _write(entry.path + ".new", b"new")  # a new inode while the old one still exists
        os.rename(entry.path + ".new", entry.path)
    assert not any(registry.unlink_if_unused(e.path, e.ino) for e in entries)
    assert len(_ours(n, directory)) == 2
    assert len(collect(shm_dir=directory)) == 2


def test_registry_namespace_may_be_a_token_or_an_id() -> None:
    token = shmrdv.new_namespace()
    nsid = shmrdv.namespace_id(token)
    assert registry.namespace_ids(token) == {nsid}
    # 16 hex characters are also a valid token: both readings are kept.
    assert registry.namespace_ids(nsid) == {nsid, shmrdv.namespace_id(nsid)}
    for bad in ("", "NOT-A-NAMESPACE", "short", "0123456789abcdeF"):
        with pytest.raises(shmrdv.InvalidArgumentError, match="namespace"):
            registry.namespace_ids(bad)
