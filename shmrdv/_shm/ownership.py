"""Is a file in /dev/shm ours? The one open-and-check every opener makes (pitfalls.md §7).

O_EXCL protects the creator; whoever opens an expected name must still make sure the
file was not planted by another user before the real creator came: a regular file, of
this user, with no group or other permission bits. /dev/shm is world-writable, so any
name there may be another user's file, FIFO or symlink, possibly holding a lease.

``open_checked`` is the only way shmrdv opens a name it did not just create:

* ``O_NOFOLLOW``: a planted symlink is refused (ELOOP), never followed;
* ``O_NONBLOCK``: a planted FIFO does not block the open, and a file under a lease
  (``fcntl(F_SETLEASE)``, which only its owner can take) fails at once with EWOULDBLOCK
  instead of blocking for ``/proc/sys/fs/lease-break-time`` (45 s) — issue 13 §1;
* ``O_NOCTTY``: a terminal never becomes our controlling terminal;
* ``O_CLOEXEC``: the descriptor does not leak into ``subprocess`` children;
* then ``fstat`` of the descriptor (not of the path: no race) for type, owner, mode and
  size, before a byte is read, mapped or written.
"""

from __future__ import annotations

import errno
import os
import stat

from .._errors import InternalError, ResourceExhaustedError

__all__ = ["OPEN_FLAGS", "is_ours", "open_checked", "refuse_foreign"]

#: Added to every open of a name another user could have planted (see the docstring).
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_ACCESS = os.O_RDONLY | os.O_WRONLY | os.O_RDWR
_NO_FDS = (errno.EMFILE, errno.ENFILE)


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

    Adds ``OPEN_FLAGS``; never creates (``O_CREAT`` is refused) and never blocks. Returns
    the descriptor (the caller closes it) and its ``fstat``. Raises ``FileNotFoundError``
    unchanged when there is no such name (callers read that as "not there (yet)");
    ``InternalError`` naming ``what`` and ``path`` for a symlink, a file under another
    process's lease or lock, anything but a regular file of this user without group/other
    permission bits, or one larger than ``max_size`` bytes (nothing is read from it);
    ``ResourceExhaustedError`` when out of file descriptors. The descriptor is closed on
    every error.
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
