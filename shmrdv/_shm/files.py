"""Files in /dev/shm: the one "is this file ours" check, and ``Segment``, a file mapped.

Another user can plant any name in the world-writable /dev/shm (research/pitfalls.md §7):
``open_checked`` is the only way shmrdv opens a name it did not just create. ``Segment``
alone creates, maps and unlinks segment files, never through
``multiprocessing.shared_memory``, whose resource tracker unlinks segments it merely
attached on Python 3.11 (cpython#82300). Files are created ``O_EXCL``, mode 0600, and
reserved with ``os.posix_fallocate`` before they are mapped, so a full /dev/shm is a
``ResourceExhaustedError``, never a SIGBUS. A ``Segment`` is not thread-safe: its owner
serialises calls.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import InternalError, ResourceExhaustedError
from .._rendezvous import Closing
from .header import MAGIC, MAX_KEY_BYTES, PREFIX, Header, unpack
from .naming import SHM_DIR, Names

__all__ = ["Segment", "inode", "is_ours", "lstat_ours", "move_noreplace", "open_checked"]
__all__ += ["os_error", "peek_header"]

_log = logging.getLogger("shmrdv.shm.files")

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MODE = 0o600
# No room: the tmpfs is full, a quota or file size limit, or the memory cgroup refused pages.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENOMEM)
_NO_FDS = (errno.EMFILE, errno.ENFILE)


def is_ours(st: os.stat_result) -> bool:
    """A regular file of this user with no group/other permission bits."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def lstat_ours(path: str) -> os.stat_result | None:
    """The ``lstat`` of ``path`` (never an open) if it ``is_ours``, else None (also if there
    is none): how a listing of /dev/shm judges a name before anything opens it."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if is_ours(st) else None


def inode(path: str, *, ours: bool = False) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file named ``path`` (an ``lstat``, never an open), None
    if there is none (or, with ``ours``, it is not ours): whether a name is still the file
    we had, across renames."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return None if ours and not is_ours(st) else (st.st_dev, st.st_ino)


def _free_bytes() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:  # pragma: no cover - /dev/shm vanished
        return f"unknown ({e})"
    return f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"


def os_error(e: OSError, what: str) -> Exception:
    """The error to raise for ``e`` from ``cannot <what>``: out of descriptors or of room in
    /dev/shm is ``ResourceExhaustedError``, anything else ``InternalError``."""
    if e.errno in _NO_FDS:
        return ResourceExhaustedError(
            f"cannot {what}: too many open files ({e.strerror}); each shared-memory segment, "
            "record and doorbell open holds one: raise the limit (ulimit -n) or close files"
        )
    if e.errno in _NO_SPACE:
        return ResourceExhaustedError(
            f"cannot {what}: {e.strerror}; {SHM_DIR} has {_free_bytes()}. In a container, "
            "give it more (docker run --shm-size=...); remove what dead processes left "
            "behind with `python -m shmrdv gc`"
        )
    return InternalError(f"cannot {what}: {e}")


def open_checked(
    path: str, flags: int, what: str, *, max_size: int | None = None
) -> tuple[int, os.stat_result]:
    """Open ``path`` (``O_RDONLY`` or ``O_RDWR``) with ``O_NOFOLLOW | O_NONBLOCK`` (a planted
    FIFO or a leased file fails at once) and check it: the descriptor (the caller's to close)
    and its ``fstat``. Raises ``FileNotFoundError`` unchanged; ``InternalError`` naming
    ``what`` for a symlink, a lease, a file not ``is_ours`` or over ``max_size`` bytes;
    ``ResourceExhaustedError`` when out of descriptors."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InternalError(f"{what} {path} is a symlink; refusing it") from e
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise InternalError(f"{what} {path} is leased by another process; not waiting") from e
        raise os_error(e, f"open {what} {path}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InternalError(f"{what} {path} is not a regular file (mode {st.st_mode:#o})")
        if not is_ours(st):
            raise InternalError(
                f"{what} {path} is not ours: owner uid {st.st_uid} (we are {os.geteuid()}), "
                f"mode {stat.S_IMODE(st.st_mode):#o} (want no group/other bits); refusing it"
            )
        if max_size is not None and st.st_size > max_size:
            raise InternalError(f"{what} {path} is {st.st_size} bytes (> {max_size}); refusing it")
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise InternalError(f"cannot stat {what} {path}: {e}") from e
        raise
    return fd, st


def peek_header(path: str) -> Header | None:
    """The header of the segment file at ``path`` by ``pread`` (for listings, never for data),
    or None if it is gone, not ours or invalid. Another user's file is never opened."""
    if lstat_ours(path) is None:
        return None
    try:
        fd, st = open_checked(path, os.O_RDONLY, "segment")
    except (OSError, InternalError, ResourceExhaustedError):
        return None
    try:
        prefix = os.pread(fd, PREFIX.size, 0)
        if len(prefix) < PREFIX.size or not prefix.startswith(MAGIC):
            return None
        header_len = PREFIX.unpack_from(prefix)[3]
        limit = min(header_len, st.st_size, PREFIX.size + 2 * MAX_KEY_BYTES)
        return unpack(os.pread(fd, limit, 0), st.st_size)
    except (OSError, InternalError):
        return None
    finally:
        os.close(fd)


# renameat2(2) with RENAME_NOREPLACE (Linux >= 3.15 on tmpfs, glibc >= 2.28): an atomic move
# that refuses an existing target, where rename() replaces it (as root, even another user's
# file in the sticky /dev/shm).
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
try:
    _renameat2: Any = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError):  # pragma: no cover - an old libc
    _renameat2 = None
_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()


def move_noreplace(old: str, new: str) -> None:
    """Move the file ``old`` to the name ``new`` atomically; ``FileExistsError`` if ``new``
    exists, other ``OSError`` s unchanged."""
    if _renameat2 is not None:
        old_b, new_b = old.encode(_FS_ENCODING, _FS_ERRORS), new.encode(_FS_ENCODING, _FS_ERRORS)
        if _renameat2(_AT_FDCWD, old_b, _AT_FDCWD, new_b, _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), old, None, new)
    # link() refuses an existing name too; both names exist for a moment, which no reader minds.
    os.link(old, new, follow_symlinks=False)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(old)


class _EmptyBuffer(bytearray):
    """The mapping of a 0-byte file (``mmap`` cannot map nothing)."""

    __slots__ = ("__weakref__",)


class _Owner(np.ndarray):  # type: ignore[type-arg,unused-ignore]
    """The numpy ``base`` of every array a segment makes: numpy lets go of the ``mmap``
    right after building an array, so the mapping is closed only once no owner is alive."""


def _release_mem(
    mem: mmap.mmap | _EmptyBuffer, owner: list[weakref.ref[_Owner]], lent: list[int]
) -> None:
    if isinstance(mem, mmap.mmap) and not (owner and owner[0]() is not None) and not lent[0]:
        try:
            mem.close()
        except BufferError:
            pass  # a memoryview of ``buf`` is alive; the mapping goes when it is released


# Guards every Segment's count of lent arrays (``lend`` and the callbacks, any thread).
_LENT_LOCK = threading.Lock()


class _Lend(weakref.ref):  # type: ignore[type-arg]
    """A ``lend`` array owner's weak reference, calling ``_given_back``: a lighter
    ``weakref.finalize`` that does nothing at exit."""

    __slots__ = ("args", "callback", "lent", "name")

    args: tuple[object, ...]
    callback: Callable[..., object]
    lent: list[int]
    name: str


_LENDS: dict[int, _Lend] = {}  # pending ones by id: keeps each alive until it fires
_EXITING: list[bool] = []  # not empty once the interpreter exits
atexit.register(_EXITING.append, True)


def _given_back(
    ref: _Lend, lends: dict[int, _Lend] = _LENDS, exiting: list[bool] = _EXITING
) -> None:
    # Globals bound as defaults: it may run while the interpreter tears modules down.
    if lends.pop(id(ref), None) is None or exiting:
        return
    try:
        ref.callback(*ref.args)  # counted as lent meanwhile: the mapping cannot be closed
    except Exception:
        _log.exception("release callback of segment %s raised", ref.name)
    finally:
        with _LENT_LOCK:
            ref.lent[0] -= 1


class Segment(Closing):
    """One segment file mapped (``create``, ``attach``). ``close()`` drops this handle's
    mapping, never the name; arrays from ``view`` and ``lend`` keep it until collected.
    ``fd``: the descriptor if ``keep_fd`` (for a cheap ``lseek`` size check), else -1."""

    def __init__(
        self, names: Names, name: str, mem: mmap.mmap | _EmptyBuffer, fd: int, keep_fd: bool
    ) -> None:
        if not keep_fd:
            os.close(fd)
            fd = -1
        self.names = names
        self.name = name
        self.size = len(mem)
        self.fd = fd
        self._mem: mmap.mmap | _EmptyBuffer | None = mem
        self._owner: list[weakref.ref[_Owner]] = []
        self._lent = [0]  # arrays from lend() still alive (a cell their callbacks share)
        self._finalizer = weakref.finalize(self, _release_mem, mem, self._owner, self._lent)
        self._fd_finalizer = None if fd < 0 else weakref.finalize(self, os.close, fd)

    @classmethod
    def create(
        cls, names: Names, size: int, name: str | None = None, *, keep_fd: bool = False
    ) -> Segment:
        """Create, reserve and map a new segment of ``size`` bytes (default: a temp name).
        Raises ``ResourceExhaustedError`` when /dev/shm is full (nothing is left behind) or
        descriptors ran out, ``InternalError`` when the name exists."""
        name = names.temp() if name is None else name
        path = names.path(name)
        fd = -1
        try:
            fd = os.open(path, _CREATE_FLAGS, _MODE)
            os.fchmod(fd, _MODE)  # whatever the umask
            if size > 0:
                os.posix_fallocate(fd, 0, size)
                mem: mmap.mmap | _EmptyBuffer = mmap.mmap(fd, size)
            else:
                mem = _EmptyBuffer()
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if isinstance(e, FileExistsError):
                raise InternalError(
                    f"cannot create segment {name}: the name exists already (a collision, or "
                    "squatted by another process)"
                ) from e
            if isinstance(e, OSError):
                raise os_error(e, f"create segment {name} ({size} bytes)") from e
            raise
        return cls(names, name, mem, fd, keep_fd)

    @classmethod
    def attach(cls, names: Names, name: str, *, keep_fd: bool = False) -> Segment:
        """``open_checked`` and map the segment ``name``. Raises as ``open_checked``."""
        fd, st = open_checked(names.path(name), os.O_RDWR, "segment")
        return cls.map_fd(names, name, fd, st, keep_fd=keep_fd)

    @classmethod
    def map_fd(
        cls, names: Names, name: str, fd: int, st: os.stat_result, *, keep_fd: bool = False
    ) -> Segment:
        """Map the file of ``fd`` (from ``open_checked``, with its ``st``); ``fd`` is closed
        unless ``keep_fd``."""
        try:
            size = st.st_size
            mem: mmap.mmap | _EmptyBuffer = mmap.mmap(fd, size) if size > 0 else _EmptyBuffer()
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError):
                raise os_error(e, f"map segment {name}") from e
            raise
        return cls(names, name, mem, fd, keep_fd)

    @property
    def path(self) -> str:
        return self.names.path(self.name)

    @property
    def closed(self) -> bool:
        return self._mem is None

    @property
    def buf(self) -> mmap.mmap | bytearray:
        """The mapping, for the header; arrays only through ``view`` or ``lend`` (they keep it
        alive). ``InternalError`` once closed."""
        if self._mem is None:
            raise InternalError(f"segment {self.name} is closed")
        return self._mem

    def check_size(self, min_size: int) -> None:
        """Raise ``InternalError`` unless the mapping and the file (one ``fstat``) still hold
        ``min_size`` bytes: touching a page a peer truncated away is a SIGBUS."""
        mem = self.buf
        if min_size > self.size:
            raise InternalError(f"segment {self.name} maps {self.size} bytes, {min_size} needed")
        if isinstance(mem, mmap.mmap):
            try:
                actual = mem.size()  # fstat of the descriptor mmap keeps
            except OSError as e:
                raise InternalError(f"cannot stat segment {self.name}: {e}") from e
            if actual < min_size:
                raise InternalError(
                    f"segment {self.name} was truncated to {actual} bytes under us "
                    f"({min_size} needed): a buggy or hostile process of this user"
                )

    def view(
        self,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        data_offset: int,
        nbytes: int,
        *,
        checked: bool = False,
    ) -> npt.NDArray[Any]:
        """A writable array over the ``nbytes`` at ``data_offset``, no copy, keeping the
        mapping alive (``checked``: the caller just checked the size). Raises as
        ``check_size``."""
        mem = self.buf
        if not checked or data_offset + nbytes > self.size:
            self.check_size(data_offset + nbytes)
        owner = self._owner[0]() if self._owner else None
        if owner is None:
            owner = _Owner((len(mem),), np.uint8, buffer=mem)
            self._owner[:] = [weakref.ref(owner)]
        # An empty array needs no bytes; offset 0 keeps numpy happy whatever the size.
        arr: npt.NDArray[Any] = np.ndarray(
            shape, dtype, buffer=owner, offset=data_offset if nbytes else 0
        )
        return arr

    def lend(
        self,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        data_offset: int,
        nbytes: int,
        callback: Callable[..., object],
        *args: object,
        checked: bool = False,
    ) -> npt.NDArray[Any]:
        """``view`` with an owner of its own: ``callback(*args)`` runs once it and its views
        are collected (in any thread, maybe inside the garbage collector; its exceptions are
        logged)."""
        mem = self.buf
        if not checked or data_offset + nbytes > self.size:
            self.check_size(data_offset + nbytes)
        owner = _Owner((len(mem),), np.uint8, buffer=mem)
        arr: npt.NDArray[Any] = np.ndarray(
            shape, dtype, buffer=owner, offset=data_offset if nbytes else 0
        )
        with _LENT_LOCK:
            self._lent[0] += 1
        ref = _Lend(owner, _given_back)
        ref.lent, ref.name, ref.callback, ref.args = self._lent, self.name, callback, args
        _LENDS[id(ref)] = ref
        return arr

    @property
    def lent(self) -> int:
        """How many arrays ``lend`` made are still alive."""
        return self._lent[0]

    def unlink(self) -> None:
        """Remove the name (a missing file is fine); mappings stay valid until closed."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise InternalError(f"cannot unlink segment {self.name}: {e}") from e

    def unlink_quietly(self) -> None:
        """``unlink``, logging what goes wrong instead of raising it."""
        try:
            self.unlink()
        except InternalError as e:
            _log.warning("%s", e)

    def close(self) -> None:
        """Drop this handle's mapping, now or once its last array is collected (idempotent,
        never raises, never unlinks)."""
        if self._mem is None:
            return
        self._finalizer.detach()
        mem, self._mem = self._mem, None
        _release_mem(mem, self._owner, self._lent)
        if self._fd_finalizer is not None:
            self.fd = -1
            self._fd_finalizer()  # closes the kept descriptor (once)

    def __repr__(self) -> str:
        state = "closed" if self._mem is None else "open"
        return f"<Segment {self.name} {self.size} bytes {state}>"
