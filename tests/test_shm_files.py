"""Tests of shmrdv._shm.files (segments) on the real /dev/shm (a fresh namespace per test)."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import stat
import struct
import textwrap
from pathlib import Path

import numpy as np
import pytest
from header_corruptions import build_header, write_header
from small_shm import run_with_small_dev_shm

from shmrdv._errors import InternalError
from shmrdv._shm import header as layout
from shmrdv._shm.files import Segment, move_noreplace
from shmrdv._shm.naming import SHM_DIR, Names

KEY = (
    "/job:w/replica:0/task:0/device:CPU:0;0000000000000001;"
    "/job:w/replica:0/task:1/device:CPU:0;t;0:0"
)


def _header(shape: tuple[int, ...] = (4, 8), dtype: str = "<f4") -> layout.Header:
    return build_header(
        key=KEY,
        dtype=np.dtype(dtype),
        shape=shape,
        step_id=1,
        seq=0,
        producer_incarnation=1,
        producer_pid=os.getpid(),
    )


def _array(seg: Segment, h: layout.Header) -> np.ndarray:
    return seg.view(h.dtype, h.shape, h.data_offset, h.nbytes)


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_segment_create_attach_zero_copy(names: Names) -> None:
    h = _header()
    with Segment.create(names, h.segment_size) as prod:
        assert prod.name.startswith(names.prefix + "t")
        assert prod.path == f"{SHM_DIR}/{prod.name}" and prod.size == h.segment_size
        write_header(prod.buf, h)
        src = _array(prod, h)
        src[...] = np.arange(32, dtype="<f4").reshape(4, 8)
        with Segment.attach(names, prod.name) as cons:
            got = layout.unpack(cons.buf, cons.size)
            assert got == h
            dst = _array(cons, got)
            assert dst.flags.writeable and dst.flags.aligned
            np.testing.assert_array_equal(dst, np.arange(32, dtype="<f4").reshape(4, 8))
            src[2, 3] = -1.0  # the producer's write is seen without a copy...
            assert dst[2, 3] == -1.0
            dst[0, 0] = 42.0  # ...and so is the consumer's
            assert src[0, 0] == 42.0
            assert dst.ctypes.data % 64 == 0
            del dst
        del src
        prod.unlink()
    assert not os.path.exists(prod.path)


@pytest.mark.parametrize("umask", [0, 0o022, 0o077, 0o777])
def test_segment_create_mode_0600_under_any_umask(names: Names, umask: int) -> None:
    old = os.umask(umask)
    try:
        seg = Segment.create(names, 4096)
    finally:
        os.umask(old)
    with seg:
        st = os.stat(seg.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        assert st.st_blocks * 512 >= 4096  # reserved by fallocate, not sparse
        seg.unlink()


def test_segment_create_existing_name_raises_internal(names: Names) -> None:
    with Segment.create(names, 4096) as seg:
        with pytest.raises(InternalError, match=f"{seg.name}.*exists already"):
            Segment.create(names, 4096, seg.name)
        assert os.path.exists(seg.path)  # the collision did not remove the original
        seg.unlink()


def test_segment_attach_missing_raises_file_not_found(names: Names) -> None:
    with pytest.raises(FileNotFoundError):
        Segment.attach(names, names.temp())


def _plant(names: Names, mode: int, uid: int | None = None) -> str:
    name = names.temp()
    path = names.path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"planted secret" + bytes(4096))
    os.fchmod(fd, mode)
    if uid is not None:
        os.fchown(fd, uid, -1)
    os.close(fd)
    return name


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o660, 0o601])
def test_segment_attach_refuses_group_or_other_permissions(names: Names, mode: int) -> None:
    name = _plant(names, mode)
    path = names.path(name)
    try:
        with pytest.raises(InternalError, match=f"segment .*{name} is not ours.*mode 0o{mode:o}"):
            Segment.attach(names, name)
        assert not _mapped(path)
    finally:
        os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_segment_attach_refuses_other_owner(names: Names) -> None:
    name = _plant(names, 0o600, uid=65534)
    path = names.path(name)
    before = Path(path).read_bytes()
    try:
        with pytest.raises(InternalError, match=r"not ours: owner uid 65534.*refusing"):
            Segment.attach(names, name)
        assert not _mapped(path)
        assert Path(path).read_bytes() == before
    finally:
        os.unlink(path)


def test_segment_attach_refuses_symlink_and_fifo(names: Names) -> None:
    target = Segment.create(names, 4096)
    link = names.temp()
    os.symlink(target.path, names.path(link))
    fifo = names.temp()
    os.mkfifo(names.path(fifo), 0o600)
    try:
        with pytest.raises(InternalError, match=link):
            Segment.attach(names, link)
        with pytest.raises(InternalError, match="not a regular file"):
            Segment.attach(names, fifo)
    finally:
        os.unlink(names.path(link))
        os.unlink(names.path(fifo))
        target.unlink()
        target.close()


def test_segment_check_size_detects_truncation(names: Names) -> None:
    h = _header()
    with Segment.create(names, h.segment_size) as prod:
        write_header(prod.buf, h)
        with Segment.attach(names, prod.name) as cons:
            cons.check_size(h.segment_size)
            os.truncate(prod.path, 100)  # a peer shrinks the file under the reader
            with pytest.raises(InternalError, match="truncated to 100 bytes"):
                cons.check_size(h.segment_size)
            with pytest.raises(InternalError, match="truncated"):
                _array(cons, h)  # checks before touching the data: no SIGBUS
            with pytest.raises(InternalError, match="maps"):
                cons.check_size(h.segment_size + 1)
        prod.unlink()


def test_segment_kept_fd_tells_the_file_size_and_closes_with_it(names: Names) -> None:
    # A ring's size check before every access is an ``lseek`` of a kept descriptor: it
    # must see a truncation as ``check_size`` does, and go with the segment's ``close``.
    gc.collect()  # (what earlier tests left goes first: the count below is this test's)
    before = _fds()
    h = _header()
    with Segment.create(names, h.segment_size, keep_fd=True) as prod:
        assert os.lseek(prod.fd, 0, os.SEEK_END) == h.segment_size
        with Segment.attach(names, prod.name, keep_fd=True) as cons:
            assert cons.fd >= 0 and cons.fd != prod.fd
            os.truncate(prod.path, 100)  # a peer shrinks the file under the reader
            assert os.lseek(cons.fd, 0, os.SEEK_END) == 100
            assert os.lseek(prod.fd, 0, os.SEEK_END) == 100
        assert cons.fd == -1
        prod.unlink()
    assert prod.fd == -1
    with Segment.create(names, 4096) as plain:
        assert plain.fd == -1  # not kept unless asked
        plain.unlink()
    assert _fds() == before
    # A forgotten segment's kept descriptor goes with it.
    seg = Segment.create(names, 4096, keep_fd=True)
    seg.unlink()
    fd = seg.fd
    os.fstat(fd)
    del seg
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_segment_view_is_ndarray_without_a_header_and_checks_the_same(names: Names) -> None:
    # ``allocate`` views its slot straight from the template (no Header built): the same
    # bytes as ``ndarray(header)``, kept alive after close the same way, and the same
    # checks before a byte is touched.
    h = _header((4, 8), "<f4")
    with Segment.create(names, h.segment_size) as prod:
        write_header(prod.buf, h)
        arr = prod.view(h.dtype, h.shape, h.data_offset, h.nbytes, checked=True)
        arr[...] = np.arange(32, dtype="<f4").reshape(4, 8)
        np.testing.assert_array_equal(_array(prod, h), arr)
        assert arr.flags.writeable and arr.ctypes.data % 64 == 0
        with pytest.raises(InternalError, match="maps"):
            prod.view(h.dtype, h.shape, h.segment_size, h.nbytes, checked=True)
        with Segment.attach(names, prod.name) as cons:
            os.truncate(prod.path, 100)  # a peer shrinks the file under the reader
            with pytest.raises(InternalError, match="truncated"):
                cons.view(h.dtype, h.shape, h.data_offset, h.nbytes)  # no SIGBUS
        prod.unlink()
        path = prod.path
    assert _mapped(path)  # kept by the array after close...
    del arr
    gc.collect()
    assert not _mapped(path)  # ...and unmapped with it


def test_segment_move_noreplace_and_unlink(names: Names) -> None:
    seg = Segment.create(names, 4096)
    old = seg.path
    new = names.message(1, KEY, 1, 0)
    move_noreplace(seg.path, names.path(new))
    seg.name = new
    assert not os.path.exists(old) and os.path.exists(seg.path)
    other = Segment.create(names, 64)
    with pytest.raises(FileExistsError):  # never replaces
        move_noreplace(other.path, seg.path)
    other.unlink()
    other.close()
    seg.buf[0:5] = b"hello"
    seg.unlink()
    seg.unlink()  # a missing file is fine
    assert not os.path.exists(seg.path)
    assert seg.buf[0:5] == b"hello"  # the mapping outlives the name
    with pytest.raises(FileNotFoundError):
        move_noreplace(seg.path, names.path(names.temp()))
    seg.close()


def test_segment_close_idempotent_repr_and_closed_errors(names: Names) -> None:
    seg = Segment.create(names, 4096)
    assert repr(seg) == f"<Segment {seg.name} 4096 bytes open>"
    seg.unlink()
    seg.close()
    seg.close()
    assert seg.closed and repr(seg).endswith("closed>")
    assert not _mapped(seg.path)
    for call in (lambda: seg.buf, lambda: seg.check_size(1), lambda: _array(seg, _header())):
        with pytest.raises(InternalError, match="closed"):
            call()


def test_segment_no_fd_leak(names: Names) -> None:
    before = _fds()
    for _ in range(20):
        with Segment.create(names, 8192) as seg, Segment.attach(names, seg.name) as other:
            other.buf[0] = 1
            seg.unlink()
    with pytest.raises(InternalError):
        Segment.create(names, 4096, "../not/there")
    assert _fds() == before


def test_segment_arrays_outlive_close(names: Names) -> None:
    h = _header((1024,), "<f8")
    seg = Segment.create(names, h.segment_size)
    path = seg.path
    arr = _array(seg, h)
    view = arr[10:20]
    seg.unlink()
    seg.close()
    assert _mapped(path)  # kept by the arrays
    arr[:] = 1.5  # no segfault: the memory is still mapped
    assert view.sum() == 15.0
    del arr
    assert _mapped(path)
    del view
    gc.collect()
    assert not _mapped(path)


def test_segment_lend_callback_keeps_the_mapping_its_segment_closes_meanwhile(
    names: Names,
) -> None:
    # A consumer's give-back writes the slot's control word through the kept mapping; the
    # segment may be closed by another thread at that moment (its kept mappings dropped).
    seg = Segment.create(names, 4096)
    mem = seg.buf
    got: list[int] = []

    def give_back(mapping: object) -> None:
        seg.close()  # the race: the mapping's last user is this callback
        struct.pack_into("<Q", mapping, 4088, 7)  # type: ignore[arg-type]
        got.append(struct.unpack_from("<Q", mapping, 4088)[0])  # type: ignore[arg-type]

    arr = seg.lend(np.dtype(np.uint8), (16,), 0, 16, give_back, mem)
    del mem
    del arr
    gc.collect()
    seg.unlink()
    assert got == [7]


def test_segment_arrays_outlive_forgotten_segment(names: Names) -> None:
    h = _header((1024,), "<f8")
    seg = Segment.create(names, h.segment_size)
    _array(seg, h)  # an owner that died: the next array gets a new one
    calls: list[int] = []
    arr = seg.lend(h.dtype, h.shape, h.data_offset, h.nbytes, calls.append, 1)
    seg.unlink()
    del seg
    gc.collect()  # the finalize backstop runs, and must not unmap under arr
    arr[:] = 2.0
    assert arr.sum() == 2048.0 and calls == []
    del arr
    assert calls == [1]


def test_segment_lend_callback_fires_after_last_view(names: Names) -> None:
    h = _header()
    seg = Segment.create(names, h.segment_size)
    calls: list[tuple[str, int]] = []
    arr = seg.lend(
        h.dtype, h.shape, h.data_offset, h.nbytes, lambda t, n: calls.append((t, n)), "gone", 1
    )
    view = arr.T[1:]
    again = _array(seg, h)
    assert seg.lent == 1
    seg.unlink()
    seg.close()
    del arr
    del again
    assert calls == []
    del view
    gc.collect()
    assert calls == [("gone", 1)] and seg.lent == 0


def test_segment_lend_callback_exception_is_logged(
    names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    seg = Segment.create(names, 4096)
    arr = seg.lend(np.dtype(np.uint8), (8,), 0, 8, boom)
    seg.unlink()
    seg.close()
    with caplog.at_level(logging.ERROR, logger="shmrdv.shm.files"):
        del arr
        gc.collect()
    assert "release callback of segment" in caplog.text and "boom" in caplog.text


def test_segment_empty_array_and_zero_size(names: Names) -> None:
    h = _header((0, 3))
    with Segment.create(names, h.segment_size) as seg:
        write_header(seg.buf, h)
        arr = _array(seg, h)
        assert arr.shape == (0, 3) and arr.dtype == np.float32 and arr.flags.writeable
        seg.unlink()
    del arr
    with Segment.create(names, 0) as zero:
        assert zero.size == 0 and len(zero.buf) == 0
        with Segment.attach(names, zero.name) as other:
            assert other.size == 0
            other.check_size(0)
        zero.unlink()


def test_segment_ndarray_outside_segment_raises(names: Names) -> None:
    h = _header((64, 64))
    with Segment.create(names, 4096) as seg:
        with pytest.raises(InternalError, match="needed"):
            _array(seg, h)
        seg.unlink()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_segment_larger_than_2gib(names: Names) -> None:
    size = 2**31 + 4096
    free = shutil.disk_usage(SHM_DIR).free
    if free < 3 * 2**30:
        pytest.skip(f"{SHM_DIR} has only {free} bytes free, the test needs 3 GiB")
    with Segment.create(names, size) as prod:
        prod.buf[size - 5 :] = b"tail!"
        with Segment.attach(names, prod.name) as cons:
            assert cons.size == size
            cons.check_size(size)
            assert cons.buf[size - 5 :] == b"tail!"
        prod.unlink()


_ENOSPC_CHILD = textwrap.dedent(
    """
    import os, re, sys
    from shmrdv._errors import ResourceExhaustedError
    from shmrdv._shm.naming import Names
    from shmrdv._shm.files import Segment

    names = Names("enospc" + "0" * 20)
    try:
        Segment.create(names, 16 << 20)
    except ResourceExhaustedError as e:
        msg = str(e)
        assert "16777216 bytes" in msg, msg
        assert re.search(r"has \\d+ bytes free", msg), msg
        assert "--shm-size" in msg and "shmrdv gc" in msg, msg
    else:
        sys.exit("no ResourceExhaustedError")
    assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
    with Segment.create(names, 1 << 20) as seg:  # still alive, and smaller ones fit
        seg.buf[-1] = 7
        assert seg.buf[-1] == 7
        seg.unlink()
    assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
    print("child ok")
    """
)


@pytest.mark.root
@pytest.mark.timeout(60)
def test_segment_enospc_is_resource_exhausted_not_sigbus() -> None:
    run_with_small_dev_shm(_ENOSPC_CHILD)


def test_segment_lend_gives_each_array_its_own_owner(names: Names) -> None:
    """Each ``lend`` is an array of its own over the kept mapping; each gives the memory
    back (its callback) once it and its views are collected."""
    seg = Segment.create(names, 1 << 20)
    try:
        back: list[int] = []
        f4 = np.dtype(np.float32)
        a = seg.lend(f4, (1024,), 4096, 4096, back.append, 1, checked=True)
        assert a.shape == (1024,) and a.dtype == f4 and seg.lent == 1
        a[:] = 7.0
        assert np.frombuffer(seg.buf, np.float32, 1024, 4096)[0] == 7.0  # its own bytes
        view = a[10:]
        b = seg.lend(f4, (512,), 8192, 2048, back.append, 2, checked=True)
        assert seg.lent == 2
        del a
        gc.collect()
        assert back == [] and seg.lent == 2  # a view keeps it lent
        del view
        gc.collect()
        assert back == [1] and seg.lent == 1
        del b
        gc.collect()
        assert back == [1, 2] and seg.lent == 0
        with pytest.raises(InternalError, match="needed"):
            seg.lend(f4, (1 << 20,), 4096, 4 << 20, back.append, 3, checked=True)
    finally:
        seg.unlink()
        seg.close()
