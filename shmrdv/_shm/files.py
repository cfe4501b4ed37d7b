"""Files in /dev/shm: the one "is this file ours" check, and ``Segment``, a file mapped.

Another user can plant any name in the world-writable /dev/shm before the real creator
comes (research/pitfalls.md §7). ``open_checked`` is the only way shmrdv opens a name it
did not just create: ``O_NOFOLLOW`` (a planted symlink is refused), ``O_NONBLOCK`` (a planted
FIFO, or a file under a lease, fails at once instead of blocking for the lease-break time),
``O_NOCTTY``, ``O_CLOEXEC``; then ``fstat`` of the descriptor for type, owner, mode and size
(``is_ours``: a regular file of this user, no group or other permission bits).

``Segment`` is the only thing that creates, maps, renames and unlinks segment files. It
never uses ``multiprocessing.shared_memory``, whose resource tracker unlinks segments it
merely attached on Python 3.11 (cpython#82300, pitfalls.md §1). Space is reserved with
``os.posix_fallocate`` before mapping, so a full /dev/shm is a ``ResourceExhaustedError``,
never a SIGBUS (§2); attaching takes ``fstat``'s size, and ``check_size`` looks again
before data is touched (a peer may truncate a file under a mapping). Files are created
``O_EXCL`` with mode 0600. ``close()`` is not ``unlink()``: arrays made by ``view`` and
``lend`` keep the mapping alive (through an owner array, their numpy ``base``) until they
are collected. A ``Segment`` is not thread-safe: its owner serialises calls.
"""

from __future__ import annotations

import atexit
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

__all__ = [
    "OPEN_FLAGS",
    "Segment",
    "is_ours",
    "move_noreplace",
    "open_checked",
    "peek_header",
    "refuse_foreign",
]

_log = logging.getLogger("shmrdv.shm.files")

#: Added to every open of a name another user could have planted (see the docstring).
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_ACCESS = os.O_RDONLY | os.O_WRONLY | os.O_RDWR
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MODE = 0o600
#: fallocate failures that mean "no room": the tmpfs is full (ENOSPC), the size is beyond a
#: file size limit (EFBIG), or the memory cgroup refused the pages (ENOMEM).
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.ENOMEM)
_NO_FDS = (errno.EMFILE, errno.ENFILE)


# --- is it ours ----------------------------------------------------------------------------


def is_ours(st: os.stat_result) -> bool:
    """A regular file of this user with no group/other permission bits."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def refuse_foreign(st: os.stat_result, where: str, what: str) -> None:
    """Raise ``InternalError`` naming ``what`` at ``where`` unless the file is ours."""
    if not stat.S_ISREG(st.st_mode):
        raise InternalError(f"{what} {where} is not a regular file (mode {st.st_mode:#o})")
    if not is_ours(st):
        raise InternalError(
            f"{what} {where} is not ours: owner uid {st.st_uid} (we are {os.geteuid()}), "
            f"mode {stat.S_IMODE(st.st_mode):#o} (want no group/other bits); refusing to use it"
        )


def _owner_hint(path: str) -> str:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return ""
    return f" (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):#o})"


def open_checked(
    path: str, flags: int, what: str, *, max_size: int | None = None
) -> tuple[int, os.stat_result]:
    """Open ``path`` with ``flags`` (``O_RDONLY`` or ``O_RDWR``) and check it is ours.

    Adds ``OPEN_FLAGS``; never creates and never blocks. Returns the descriptor (the caller
    closes it) and its ``fstat``. Raises ``FileNotFoundError`` unchanged when there is no
    such name (callers read that as "not there (yet)"); ``InternalError`` naming ``what``
    and ``path`` for a symlink, a file under another process's lease, anything but a
    regular file of this user without group/other permission bits, or one larger than
    ``max_size`` bytes (nothing is read from it); ``ResourceExhaustedError`` when out of
    file descriptors. The descriptor is closed on every error.
    """
    if flags & (os.O_CREAT | os.O_TRUNC) or flags & ~(_ACCESS | OPEN_FLAGS):
        raise InternalError(f"open_checked of {what} {path}: bad flags {flags:#o}")
    try:
        fd = os.open(path, flags | OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InternalError(f"{what} {path} is a symlink; refusing it") from e
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise InternalError(
                f"{what} {path} is held under a lease by another process{_owner_hint(path)}; "
                "refusing to wait for it"
            ) from e
        if e.errno in _NO_FDS:
            raise ResourceExhaustedError(
                f"cannot open {what} {path}: too many open files ({e.strerror}); "
                "raise the limit (ulimit -n) or close files"
            ) from e
        raise InternalError(f"cannot open {what} {path}: {e}") from e
    try:
        st = os.fstat(fd)
        refuse_foreign(st, path, what)
        if max_size is not None and st.st_size > max_size:
            raise InternalError(
                f"{what} {path} is {st.st_size} bytes, more than {max_size}; refusing it"
            )
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise InternalError(f"cannot stat {what} {path}: {e}") from e
        raise
    return fd, st


def peek_header(path: str) -> Header | None:
    """The header of the segment file at ``path``, read with ``pread`` (nothing is mapped).

    None if it is gone, not ours or holds no valid header (still being written, or
    corrupt). For listings, never for data. Never blocks. Another user's file costs one
    ``lstat`` and is never opened (a flood of planted names must stay cheap to skip).
    """
    try:
        if not is_ours(os.stat(path, follow_symlinks=False)):
            return None
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


# renameat2(2) with RENAME_NOREPLACE (Linux >= 3.15 on tmpfs, glibc >= 2.28): an atomic
# move that refuses an existing target. Plain rename() replaces the target, and as root it
# even replaces another user's file in the sticky /dev/shm. Called without ``argtypes``:
# Python ints and ``bytes`` are already what C takes, and declared types cost a conversion
# per argument per call.
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
    exists. Raises other ``OSError`` s unchanged (``FileNotFoundError`` when ``old`` is gone).
    """
    if _renameat2 is not None:
        if (
            _renameat2(
                _AT_FDCWD,
                old.encode(_FS_ENCODING, _FS_ERRORS),
                _AT_FDCWD,
                new.encode(_FS_ENCODING, _FS_ERRORS),
                _RENAME_NOREPLACE,
            )
            == 0
        ):
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), old, None, new)
    # No renameat2 here: link() refuses an existing name too (pitfalls.md §3); the old name
    # goes right after (both names briefly exist, which no reader minds).
    os.link(old, new, follow_symlinks=False)
    try:
        os.unlink(old)
    except FileNotFoundError:
        pass


# --- segments ------------------------------------------------------------------------------


def _free_bytes() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:  # pragma: no cover - /dev/shm vanished
        return f"unknown ({e})"
    return f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"


def _open_error(e: OSError, what: str) -> Exception:
    """Translate an ``OSError`` of ``open`` / ``mmap`` / ``fstat`` at the edge."""
    if e.errno in _NO_FDS:
        return ResourceExhaustedError(
            f"cannot {what}: too many open files ({e.strerror}); each open shared-memory "
            "segment holds a file descriptor, raise the limit (ulimit -n)"
        )
    if e.errno in _NO_SPACE:
        return ResourceExhaustedError(f"cannot {what}: {e.strerror}; {SHM_DIR} has {_free_bytes()}")
    return InternalError(f"cannot {what}: {e}")


class _EmptyBuffer(bytearray):
    """Stands in for the mapping of a 0-byte segment (``mmap`` cannot map nothing)."""

    __slots__ = ("__weakref__",)


class _Owner(np.ndarray):  # type: ignore[type-arg,unused-ignore]
    """The bytes of a mapping as an array: the numpy ``base`` of every array a segment makes.

    numpy releases its buffer export on the ``mmap`` right after building an array over it,
    so ``mmap.close()`` would succeed and unmap memory under live arrays. Arrays are built
    over this owner instead: it lives exactly as long as any of them, and the ``Segment``
    closes the ``mmap`` only when no owner is alive.
    """


def _release_mem(
    mem: mmap.mmap | _EmptyBuffer, owner: list[weakref.ref[_Owner]], lent: list[int]
) -> None:
    """Unmap now unless arrays still use the mapping (the last one unmaps it when collected).

    ``owner``: the weak reference to the current owner array of ``view``, if any (a list
    shared with the ``Segment``); ``lent``: how many arrays ``lend`` made are alive.
    """
    if isinstance(mem, mmap.mmap) and not (owner and owner[0]() is not None) and not lent[0]:
        try:
            mem.close()
        except BufferError:
            pass  # someone holds a memoryview of ``buf``; the mapping goes when it is released


# Guards every Segment's count of lent arrays: ``lend`` (the consumer's thread) and the
# weak references' callbacks (any thread) both change it.
_LENT_LOCK = threading.Lock()


class _Lend(weakref.ref):  # type: ignore[type-arg]
    """The weak reference to the owner of one array ``Segment.lend`` made: when the owner
    is collected, ``_given_back`` counts the array back and runs the callback. One C-level
    reference and one entry of ``_LENDS`` (which keeps it alive until it fires), where a
    ``weakref.finalize`` keeps a Python-level registry. Like a ``finalize`` with ``atexit``
    off, it does nothing at interpreter exit."""

    __slots__ = ("args", "callback", "lent", "name")

    args: tuple[object, ...]
    callback: Callable[..., object]
    lent: list[int]
    name: str


# The pending ``_Lend`` s by id, and whether the interpreter is exiting.
_LENDS: dict[int, _Lend] = {}
_EXITING = [False]


def _exiting(flag: list[bool] = _EXITING) -> None:
    flag[0] = True


atexit.register(_exiting)


def _given_back(
    ref: _Lend, lends: dict[int, _Lend] = _LENDS, exiting: list[bool] = _EXITING
) -> None:
    """``_Lend``'s callback (its globals bound as defaults: it may run while the
    interpreter tears modules down)."""
    if lends.pop(id(ref), None) is None or exiting[0]:
        return
    with _LENT_LOCK:
        ref.lent[0] -= 1
    try:
        ref.callback(*ref.args)
    except Exception:
        _log.exception("release callback of segment %s raised", ref.name)


class Segment(Closing):
    """One open shared-memory segment file. Use ``create`` or ``attach``, not the constructor.

    ``close()`` drops this handle's mapping (idempotent); ``unlink()`` removes the name. A
    ``weakref.finalize`` closes a forgotten segment; it never unlinks.
    """

    __slots__ = (
        "_fd",
        "_fd_finalizer",
        "_finalizer",
        "_lent",
        "_mem",
        "_name",
        "_owner",
        "_size",
        "names",
    )

    def __init__(
        self, names: Names, name: str, mem: mmap.mmap | _EmptyBuffer, size: int, fd: int = -1
    ) -> None:
        self.names = names
        self._name = name
        self._size = size
        self._mem: mmap.mmap | _EmptyBuffer | None = mem
        self._owner: list[weakref.ref[_Owner]] = []
        self._lent = [0]  # arrays from lend() still alive (a cell their callbacks share)
        self._finalizer = weakref.finalize(self, _release_mem, mem, self._owner, self._lent)
        self._fd = fd  # kept for ``fd`` (``keep_fd``), else -1
        self._fd_finalizer = None if fd < 0 else weakref.finalize(self, os.close, fd)

    @classmethod
    def create(
        cls, names: Names, size: int, name: str | None = None, *, keep_fd: bool = False
    ) -> Segment:
        """Create, reserve and map a new segment of ``size`` bytes (default name: a temp
        name). ``keep_fd``: keep its descriptor open as ``fd`` (until ``close``).

        Raises ``ResourceExhaustedError`` when /dev/shm has no room for ``size`` bytes
        (nothing is left behind) or the process is out of descriptors, ``InternalError``
        when the name exists already (squatted, or a collision).
        """
        if size < 0:
            raise InternalError(f"cannot create a segment of {size} bytes")
        if name is None:
            name = names.temp()
        path = names.path(name)
        try:
            fd = os.open(path, _CREATE_FLAGS, _MODE)
        except FileExistsError as e:
            raise InternalError(
                f"cannot create segment {name}: the name exists already (a name collision, "
                "or squatted by another process)"
            ) from e
        except OSError as e:
            raise _open_error(e, f"create segment {name} ({size} bytes)") from e
        try:
            os.fchmod(fd, _MODE)  # the umask must not change it either way
            if size > 0:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno in _NO_SPACE:
                        raise ResourceExhaustedError(
                            f"cannot reserve {size} bytes of shared memory for segment {name}: "
                            f"{e.strerror}; {SHM_DIR} has {_free_bytes()}. In a container, give "
                            "it more (docker run --shm-size=...); remove what dead processes "
                            "left behind with `python -m shmrdv gc`"
                        ) from e
                    raise
                mem: mmap.mmap | _EmptyBuffer = mmap.mmap(fd, size)
            else:
                mem = _EmptyBuffer()
        except BaseException as e:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:  # pragma: no cover - someone removed it already
                pass
            if isinstance(e, OSError):
                raise _open_error(e, f"create segment {name} ({size} bytes)") from e
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        return cls(names, name, mem, size, fd)

    @classmethod
    def attach(cls, names: Names, name: str, *, keep_fd: bool = False) -> Segment:
        """Open (``open_checked``) and map the existing segment ``name`` at its size.

        Raises ``FileNotFoundError`` unchanged when it does not exist (callers read that as
        "not published yet" or "taken"), ``InternalError`` when it is not ours (it is then
        neither read nor written), ``ResourceExhaustedError`` when out of descriptors.
        """
        fd, st = open_checked(names.path(name), os.O_RDWR, "segment")
        return cls.map_fd(names, name, fd, st, keep_fd=keep_fd)

    @classmethod
    def map_fd(
        cls, names: Names, name: str, fd: int, st: os.stat_result, *, keep_fd: bool = False
    ) -> Segment:
        """Map the file of ``fd`` (checked by ``open_checked``, which gave ``st``) at its
        size, then close ``fd`` (``keep_fd``: it is the segment's ``fd``)."""
        try:
            size = st.st_size
            mem: mmap.mmap | _EmptyBuffer = mmap.mmap(fd, size) if size > 0 else _EmptyBuffer()
        except OSError as e:
            os.close(fd)
            raise _open_error(e, f"map segment {name}") from e
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        return cls(names, name, mem, size, fd)

    @property
    def name(self) -> str:
        """The bare name (no directory)."""
        return self._name

    @name.setter
    def name(self, new_name: str) -> None:
        """Record that the file was renamed (by this process or another)."""
        self._name = new_name

    @property
    def path(self) -> str:
        """``/dev/shm/<name>``."""
        return self.names.path(self._name)

    @property
    def size(self) -> int:
        """Bytes mapped (the file's size at create / attach)."""
        return self._size

    @property
    def closed(self) -> bool:
        return self._mem is None

    @property
    def fd(self) -> int:
        """The descriptor kept open (``keep_fd``), or -1: ``os.lseek(fd, 0, os.SEEK_END)`` is
        the file's size, a system call lighter than ``check_size``'s ``fstat``."""
        return self._fd

    @property
    def buf(self) -> mmap.mmap | bytearray:
        """The mapping, for the header. Make arrays with ``view`` or ``lend`` only: an array
        built directly over it does not keep the mapping alive. ``InternalError`` once
        closed."""
        if self._mem is None:
            raise InternalError(f"segment {self._name} is closed")
        return self._mem

    def check_size(self, min_size: int) -> None:
        """Raise ``InternalError`` unless the file still holds ``min_size`` bytes (one
        ``fstat``). A peer that truncates a mapped file makes readers of the lost pages die
        of SIGBUS: call this before touching the data."""
        mem = self.buf
        if min_size > self._size:
            raise InternalError(
                f"segment {self._name} maps {self._size} bytes, {min_size} are needed"
            )
        if isinstance(mem, mmap.mmap):
            try:
                actual = mem.size()  # fstat of the descriptor mmap keeps
            except OSError as e:
                raise InternalError(f"cannot stat segment {self._name}: {e}") from e
            if actual < min_size:
                raise InternalError(
                    f"segment {self._name} was truncated to {actual} bytes under us "
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
        """A writable array over the ``nbytes`` of data at ``data_offset``, without a copy.

        The array (and every view of it) keeps the mapping alive after ``close()``. Checks
        the file's size first, unless ``checked`` (the caller's check of a moment ago
        covered the data). Raises ``InternalError`` if the data lies outside the segment.
        """
        mem = self.buf
        end = data_offset + nbytes
        if checked:
            if end > self._size:
                raise InternalError(f"segment {self._name} maps {self._size} bytes, {end} needed")
        else:
            self.check_size(end)
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
        """``view`` with an owner of its own: ``callback(*args)`` runs once that array and
        every view of it are collected (in whichever thread drops the last one, possibly
        inside the garbage collector; its exceptions are logged), while the mapping stays
        with this segment (a kept mapping lends one array per message)."""
        mem = self.buf
        if not checked:
            self.check_size(data_offset + nbytes)
        elif data_offset + nbytes > self._size:
            raise InternalError(
                f"segment {self._name} maps {self._size} bytes, {data_offset + nbytes} needed"
            )
        owner = _Owner((len(mem),), np.uint8, buffer=mem)
        arr: npt.NDArray[Any] = np.ndarray(
            shape, dtype, buffer=owner, offset=data_offset if nbytes else 0
        )
        with _LENT_LOCK:
            self._lent[0] += 1
        ref = _Lend(owner, _given_back)
        ref.lent, ref.name, ref.callback, ref.args = self._lent, self._name, callback, args
        _LENDS[id(ref)] = ref
        return arr

    @property
    def lent(self) -> int:
        """How many arrays ``lend`` made are still alive."""
        return self._lent[0]

    def rename(self, new_name: str) -> None:
        """Give the file the name ``new_name`` (atomic; replaces an existing ``new_name``).
        Raises ``FileNotFoundError`` unchanged when the file is no longer under its name."""
        try:
            os.rename(self.path, self.names.path(new_name))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise InternalError(f"cannot rename segment {self._name} to {new_name}: {e}") from e
        self._name = new_name

    def unlink(self) -> None:
        """Remove the name (a missing file is fine). Mappings stay valid until closed."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise InternalError(f"cannot unlink segment {self._name}: {e}") from e

    def unlink_quietly(self) -> None:
        """``unlink``, logging what goes wrong instead of raising it."""
        try:
            self.unlink()
        except InternalError as e:
            _log.warning("%s", e)

    def close(self) -> None:
        """Drop this handle's mapping (idempotent; never raises). Does not unlink. Unmaps at
        once unless arrays over it are alive; the last of them unmaps it when collected."""
        if self._mem is None:
            return
        self._finalizer.detach()
        mem, self._mem = self._mem, None
        _release_mem(mem, self._owner, self._lent)
        if self._fd_finalizer is not None:
            self._fd = -1
            self._fd_finalizer()  # closes the kept descriptor (once)

    def __repr__(self) -> str:
        state = "closed" if self._mem is None else "open"
        return f"<Segment {self._name} {self._size} bytes {state}>"
