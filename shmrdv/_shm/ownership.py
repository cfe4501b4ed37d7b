"""Is a file in /dev/shm ours? The one check every opener makes (research/pitfalls.md §7).

O_EXCL protects the creator; whoever opens an expected name must still make sure the
file was not planted by another user before the real creator came: a regular file, of
this user, with no group or other permission bits.
"""

from __future__ import annotations

import os
import stat

from .._errors import InternalError

__all__ = ["is_ours", "refuse_foreign"]


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
