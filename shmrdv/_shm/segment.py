"""One shared-memory segment: a file in ``/dev/shm``, opened and mapped.

Handle tracking lives here: this module is the only place that creates, opens, maps,
renames and unlinks segment files. It never uses ``multiprocessing.shared_memory``,
whose resource tracker unlinks segments it merely attached on Python 3.11
(cpython#82300, research/pitfalls.md §1); it opens ``/dev/shm/<name>`` with ``os.open``
and maps it with ``mmap`` (Linux: glibc's ``shm_open`` is exactly that file).

Safety rules from research/pitfalls.md:

* §2: space is reserved with ``os.posix_fallocate`` before mapping, so a full ``/dev/shm``
  is a ``ResourceExhaustedError`` and never a SIGBUS; attaching never passes a size (it
  takes ``fstat``'s) and ``check_size`` re-checks it before data is touched.
* §7: files are created ``O_EXCL`` + ``O_NOFOLLOW`` with mode 0600 (``fchmod``: the umask
  cannot widen or narrow it); attaching opens through ``ownership.open_checked``
  (``O_NOFOLLOW | O_NONBLOCK``: a planted file under a lease fails at once) and refuses a
  file of another user or with any group/other permission bit, before reading a byte.

Lifetime: ``close()`` is not ``unlink()``. Arrays made by ``ndarray()`` keep the mapping
alive (through an owner array that is their numpy ``base``) after ``close()``; the memory
is unmapped when the last one is garbage-collected, and ``on_release`` callbacks run then.
Each open mapping holds one file descriptor (CPython's ``mmap`` keeps a ``dup`` of it until
it is unmapped). A ``Segment`` is not thread-safe: its owner serialises calls.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import InternalError, ResourceExhaustedError
from .layout import MAGIC, MAX_KEY_BYTES, PREFIX, Header, unpack
from .naming import SHM_DIR, Names
from .ownership import is_ours, open_checked

__all__ = ["Segment", "move_noreplace"]

_log = logging.getLogger("shmrdv.shm.segment")

_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MODE = 0o600
#: fallocate failures that mean "no room": the tmpfs is full (ENOSPC), the size is beyond a
#: file size limit (EFBIG), or the memory cgroup refused the pages (ENOMEM).
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.ENOMEM)
_NO_FDS = (errno.EMFILE, errno.ENFILE)


class _EmptyBuffer(bytearray):
    """Stands in for the mapping of a 0-byte segment (``mmap`` cannot map nothing)."""

    __slots__ = ("__weakref__",)


class _Owner(np.ndarray):  # type: ignore[type-arg,unused-ignore]
    """The bytes of a mapping as an array: the numpy ``base`` of every array ``ndarray()`` makes.

    numpy releases its buffer export on the ``mmap`` right after building an array over it,
    so ``mmap.close()`` would succeed and unmap memory under live arrays (a segfault on the
    next access). Arrays are built over this owner instead: it is alive exactly as long as
    any of them (numpy does not collapse a view's base through a different subclass), and
    the ``Segment`` only closes the ``mmap`` when no owner is alive.
    """


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


def _release_mem(
    mem: mmap.mmap | _EmptyBuffer, owner: list[weakref.ref[_Owner]], lent: list[int]
) -> None:
    """Unmap now unless arrays still use the mapping (they unmap it when they are collected).

    ``owner`` holds the weak reference to the current owner array, if any: a list shared
    with the ``Segment`` so that the ``weakref.finalize`` backstop sees later ones too;
    ``lent`` (one counter) how many arrays ``lend`` made are alive.
    """
    if isinstance(mem, mmap.mmap) and not (owner and owner[0]() is not None) and not lent[0]:
        try:
            mem.close()
        except BufferError:
            # Someone holds a memoryview of .buf; the mapping goes when it is released.
            pass


def _run_release_callback(
    name: str, callback: Callable[..., object], args: tuple[object, ...]
) -> None:
    try:
        callback(*args)
    except Exception:
        _log.exception("release callback of segment %s raised", name)


# Guards every Segment's count of lent arrays: ``lend`` (the consumer's thread) and the
# finalizers (any thread) both change it, and a miscount could unmap memory under an array.
_LENT_LOCK = threading.Lock()


def _returned(
    lent: list[int], name: str, callback: Callable[..., object], args: tuple[object, ...]
) -> None:
    with _LENT_LOCK:
        lent[0] -= 1
    _run_release_callback(name, callback, args)


class _Lend(weakref.ref):  # type: ignore[type-arg]
    """The weak reference to the owner of one array that ``Segment.lend`` made: when the
    owner is collected, ``_given_back`` counts the array back and runs the callback.

    ``weakref.finalize`` did the same with a Python-level registry: ~2.6 µs per message,
    7 µs once a 16 MiB message has left the caches cold, on the receive's own path. This
    is one C-level reference and one dict entry (``_LENDS``, which keeps it alive until it
    fires). Like a ``finalize`` with ``atexit`` off, it does nothing at interpreter exit.
    """

    __slots__ = ("args", "callback", "lent", "name")

    args: tuple[object, ...]
    callback: Callable[..., object]
    lent: list[int]
    name: str


# The pending ``_Lend`` s, by id (a weak reference to an array hashes as its referent: not
# at all), and whether the interpreter is exiting (set by ``atexit``: from then on nothing
# is given back, as with ``weakref.finalize``).
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
    _returned(ref.lent, ref.name, ref.callback, ref.args)


class Segment:
    """One open shared-memory segment file. Use ``create`` or ``attach``, not the constructor.

    ``close()`` drops this handle's mapping (idempotent); ``unlink()`` removes the name. A
    ``weakref.finalize`` closes a forgotten segment; it never unlinks.
    """

    __slots__ = (
        "__weakref__",
        "_fd",
        "_fd_finalizer",
        "_finalizer",
        "_lent",
        "_mem",
        "_name",
        "_owner",
        "_size",
        "_spare",
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
        self._lent = [0]  # arrays from lend() still alive (a cell their finalizers share)
        # ``prepare_lend``'s array for the next ``lend`` (dtype, shape, offset, owner, array).
        self._spare: tuple[np.dtype[Any], tuple[int, ...], int, _Owner, npt.NDArray[Any]] | None
        self._spare = None
        self._finalizer = weakref.finalize(self, _release_mem, mem, self._owner, self._lent)
        self._fd = fd  # kept for ``fd`` (``keep_fd``), else -1
        self._fd_finalizer = None if fd < 0 else weakref.finalize(self, os.close, fd)

    # --- opening --------------------------------------------------------------------------

    @classmethod
    def create(
        cls, names: Names, size: int, name: str | None = None, *, keep_fd: bool = False
    ) -> Segment:
        """Create, reserve and map a new segment of ``size`` bytes (default name: a temp name).
        ``keep_fd``: keep its descriptor open as ``fd`` (until ``close``).

        Raises ``ResourceExhaustedError`` when ``/dev/shm`` has no room for ``size`` bytes
        (nothing is left behind) or the process is out of file descriptors, and
        ``InternalError`` when the name exists already (squatted, or a collision).
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
        """Open and map the existing segment ``name`` at its current size (``keep_fd``: see
        ``create``).

        Raises ``FileNotFoundError`` unchanged when it does not exist (callers read that as
        "not published yet" or "taken"), ``InternalError`` when it is not a regular file of
        this user with mode 0600 or is under another process's lease (it is then neither
        read nor written), and ``ResourceExhaustedError`` when out of file descriptors.
        Never blocks: the open goes through ``ownership.open_checked``.
        """
        fd, st = open_checked(names.path(name), os.O_RDWR, "segment")
        return cls.map_fd(names, name, fd, st, keep_fd=keep_fd)

    @classmethod
    def map_fd(
        cls, names: Names, name: str, fd: int, st: os.stat_result, *, keep_fd: bool = False
    ) -> Segment:
        """Map the file of ``fd`` (checked by ``open_checked``, which gave ``st``) at its size,
        then close ``fd`` (``keep_fd``: it is the segment's ``fd``, closed by ``close``).
        Raises ``ResourceExhaustedError`` when out of descriptors."""
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

    # --- properties -----------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The bare name (no directory); changes with ``rename``."""
        return self._name

    @name.setter
    def name(self, new_name: str) -> None:
        """Record that another process (or an ``os.rename`` elsewhere) renamed the file."""
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
        the file's size, a system call lighter than ``check_size``'s ``fstat`` (for a check
        before every access of a ring). Closed by ``close``."""
        return self._fd

    @property
    def buf(self) -> mmap.mmap | bytearray:
        """The mapping, for reading and writing the header (``layout.pack_into`` / ``unpack``).

        Make arrays with ``ndarray()`` only: an array built directly over this buffer does
        not keep the mapping alive after ``close()``. Raises ``InternalError`` once closed.
        """
        return self._live_mem()

    def _live_mem(self) -> mmap.mmap | _EmptyBuffer:
        if self._mem is None:
            raise InternalError(f"segment {self._name} is closed")
        return self._mem

    # --- data -----------------------------------------------------------------------------

    def check_size(self, min_size: int) -> None:
        """Raise ``InternalError`` unless the file still holds ``min_size`` bytes (one fstat).

        A peer that truncates a mapped file makes readers of the lost pages die of SIGBUS;
        call this before touching the data. A truncation after the check cannot be
        prevented without sealed memfds (F_SEAL_SHRINK), which need fd passing.
        """
        mem = self._live_mem()
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

    def ndarray(self, header: Header, *, checked: bool = False) -> npt.NDArray[Any]:
        """A writable array over the data ``header`` describes, without a copy.

        The array (and every view of it) keeps the mapping alive after ``close()``. Checks
        the file's size first (``check_size``), unless ``checked`` (the caller's check of a
        moment ago covered the data). Raises ``InternalError`` if the data lies outside the
        segment or the segment is closed.
        """
        return self.view(
            header.dtype, header.shape, header.data_offset, header.nbytes, checked=checked
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
        """``ndarray()`` of the ``nbytes`` of data at ``data_offset`` (what a header says of
        them), with no ``Header`` to build: an ``allocate``'s array."""
        mem = self._live_mem()
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
        # An empty array needs no bytes; offset 0 keeps numpy happy whatever the segment size.
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
        """A writable array of ``dtype`` and ``shape`` over the ``nbytes`` of data at
        ``data_offset``, with an owner of its own.

        ``callback(*args)`` runs once that array and every view of it are collected (in
        whichever thread drops the last one, possibly inside the garbage collector; its
        exceptions are logged), while the mapping stays with this segment: a kept
        mapping lends one array per message. The array keeps the mapping alive after
        ``close()`` as ``ndarray()``'s do. Checks the file's size first, unless ``checked``
        (the caller's ``check_size`` of a moment ago covered the data).
        """
        mem = self._live_mem()
        if not checked:
            self.check_size(data_offset + nbytes)
        offset = data_offset if nbytes else 0
        spare, self._spare = self._spare, None
        if (
            spare is not None
            and spare[2] == offset
            and spare[1] == shape
            and spare[0] == dtype
            and spare[4].nbytes == nbytes
        ):
            owner, arr = spare[3], spare[4]
        else:
            owner = _Owner((len(mem),), np.uint8, buffer=mem)
            arr = np.ndarray(shape, dtype, buffer=owner, offset=offset)
        del spare
        with _LENT_LOCK:
            self._lent[0] += 1
        ref = _Lend(owner, _given_back)
        ref.lent, ref.name, ref.callback, ref.args = self._lent, self._name, callback, args
        _LENDS[id(ref)] = ref
        return arr

    def prepare_lend(
        self, dtype: np.dtype[Any], shape: tuple[int, ...], data_offset: int, nbytes: int
    ) -> None:
        """Make the array (and its owner) of a ``lend`` of that data ahead of it, which then
        only hands it out if it asks for the same. Two array objects made afresh cost ~7 µs
        once a 16 MiB message has left the caches cold; a receive that waits has time for
        them (``NamedMessages.ahead``). The data is not read: the bytes are read through
        the array when it is used. Held until the next ``lend`` or ``close``.
        Raises ``InternalError`` once closed; what does not fit the mapping is not made."""
        mem = self._live_mem()
        if data_offset < 0 or nbytes < 0 or data_offset + nbytes > len(mem):
            return
        offset = data_offset if nbytes else 0
        owner = _Owner((len(mem),), np.uint8, buffer=mem)
        try:
            arr: npt.NDArray[Any] = np.ndarray(shape, dtype, buffer=owner, offset=offset)
        except (TypeError, ValueError):
            return
        if arr.nbytes == nbytes:
            self._spare = (dtype, shape, offset, owner, arr)

    @property
    def lent(self) -> int:
        """How many arrays ``lend`` made are still alive."""
        return self._lent[0]

    def on_release(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback(*args)`` once the mapping is gone: this segment closed (or collected) and
        every array from ``ndarray()`` collected.

        It runs in whichever thread drops the last reference, possibly inside the garbage
        collector: keep it short, and do not let it refer to the arrays or this segment.
        Its exceptions are logged. It does not run at interpreter exit while arrays are
        still alive (their memory may still be read then). Raises ``InternalError`` if closed.
        """
        mem = self._live_mem()
        fin = weakref.finalize(mem, _run_release_callback, self._name, callback, args)
        fin.atexit = False

    # --- names ----------------------------------------------------------------------------

    def rename(self, new_name: str) -> None:
        """Give the file the name ``new_name`` (atomic; replaces an existing ``new_name``).

        Mappings are unaffected. Raises ``FileNotFoundError`` unchanged when the file is no
        longer under its old name (another process took or removed it).
        """
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

    # --- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this handle's mapping (idempotent). Does not unlink.

        Unmaps at once if no array from ``ndarray()`` is alive; otherwise the last of them
        unmaps it when collected. Never raises.
        """
        if self._mem is None:
            return
        self._finalizer.detach()
        self._spare = None  # (its owner exports the mapping)
        mem, self._mem = self._mem, None
        _release_mem(mem, self._owner, self._lent)
        if self._fd_finalizer is not None:
            self._fd = -1
            self._fd_finalizer()  # closes the kept descriptor (once)

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mem is None else "open"
        return f"<Segment {self._name} {self._size} bytes {state}>"


def peek_header(path: str) -> Header | None:
    """The header of the segment file at ``path``, read with ``pread`` (nothing is mapped).

    None if it is gone, not ours (owner, mode, not a regular file, under a lease) or holds
    no valid header (still being written, or corrupt). For listing and finding, never for
    data. Never blocks (``open_checked``). Another user's file costs one ``lstat`` and is
    never opened (a flood of planted names must stay cheap to skip).
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
# even replaces another user's file in the sticky /dev/shm: a planted file, or an
# unreceived message of an earlier run, would be silently destroyed.
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
# No ``argtypes``: every argument is already what C takes (Python ints and ``bytes``
# become ``int`` and ``char *``, and ``int`` is the default ``restype``), and declaring
# them makes ctypes convert each one through its type on every call: 5.0 against 4.6 µs a
# move warm, 15 against 13 µs on caches that a 16 MiB copy emptied, which is where a
# pool-slot handoff makes its three moves.
try:
    _renameat2: Any = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError):  # pragma: no cover - an old libc
    _renameat2 = None
# What ``os.fsencode`` does to a ``str``, without its Python frame (three moves per
# pool-slot handoff).
_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()


def move_noreplace(old: str, new: str) -> None:
    """Move the file ``old`` to the name ``new`` atomically; ``FileExistsError`` if ``new`` exists.

    Raises other ``OSError`` s unchanged (``FileNotFoundError`` when ``old`` is gone).
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
