"""A presence record's contents: what a worker's record in /dev/shm says, read without
blocking and refused when it is not ours (``presence.py`` tells the whole story).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import TYPE_CHECKING, Any, Literal

from .._errors import InternalError
from .files import open_checked, refuse_foreign

if TYPE_CHECKING:
    from .naming import Names

__all__ = [
    "MAX_RECORD_BYTES",
    "PeerState",
    "PresenceInfo",
    "boot_id",
    "check_ours",
    "describe_owner",
    "open_record",
    "read_bytes",
    "read_presence",
    "read_record",
    "read_record_stat",
]

PeerState = Literal["absent", "alive", "dead"]

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# A record is a few hundred bytes; anything much larger was not written by us.
MAX_RECORD_BYTES = 64 * 1024


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``), read once and cached.

    Raises ``InternalError`` if the file cannot be read (not Linux, or no /proc).
    """
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError as e:
        raise InternalError(f"cannot read the boot id from {_BOOT_ID_PATH}: {e}") from e


@dataclasses.dataclass(frozen=True)
class PresenceInfo:
    """What a presence record says about a worker."""

    task: str  # canonical task name, e.g. /job:worker/replica:0/task:1
    pid: int
    boot_id: str
    incarnation: int  # uint64
    started: float  # time.time() at publish
    namespace: str  # the namespace id (public); never the token
    address: str | None = None  # the worker's gRPC address, if it serves one
    # The transports the worker accepts, in its order of preference (TensorPipe's
    # "brochure"): a peer that sees this record picks the first it has too.
    transports: tuple[str, ...] = ("shm", "grpc")

    def to_json(self) -> bytes:
        """The record's bytes."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> PresenceInfo:
        """Parse a record; ``InternalError`` naming ``where`` if it is not a valid one."""
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise InternalError(f"presence record {where} is corrupt: {e}") from e
        if not isinstance(obj, dict):
            raise InternalError(f"presence record {where} is corrupt: not a JSON object")
        fields: dict[str, tuple[type, ...]] = {
            "task": (str,),
            "pid": (int,),
            "boot_id": (str,),
            "incarnation": (int,),
            "started": (int, float),
            "namespace": (str,),
            "address": (str, type(None)),
        }
        values: dict[str, Any] = {}
        for name, types in fields.items():
            value = obj.get(name)
            if name not in obj or isinstance(value, bool) or not isinstance(value, types):
                raise InternalError(
                    f"presence record {where} is corrupt: field {name!r} is missing or has the "
                    f"wrong type ({value!r})"
                )
            values[name] = value
        values["started"] = float(values["started"])
        transports = obj.get("transports", ["shm", "grpc"])
        if not isinstance(transports, list) or not all(isinstance(t, str) for t in transports):
            raise InternalError(
                f"presence record {where} is corrupt: field 'transports' is {transports!r}"
            )
        values["transports"] = tuple(transports)
        return cls(**values)


def check_ours(st: os.stat_result, where: str, what: str = "presence record") -> None:
    """Refuse a file another user planted under our name (pitfalls.md §7: fstat on attach)."""
    refuse_foreign(st, where, what)


def read_bytes(fd: int, where: str) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, MAX_RECORD_BYTES + 1 - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        if offset > MAX_RECORD_BYTES:
            raise InternalError(f"presence record {where} is larger than {MAX_RECORD_BYTES} bytes")
    return b"".join(chunks)


def read_record_stat(fd: int, where: str) -> tuple[PresenceInfo, os.stat_result]:
    st = os.fstat(fd)
    check_ours(st, where)
    return PresenceInfo.from_json(read_bytes(fd, where), where), st


def open_record(path: str) -> int | None:
    """Open a record for reading; None if it does not exist (``ownership.open_checked``:
    never blocks; a symlink, a foreign or leased file is an ``InternalError``)."""
    try:
        fd, _ = open_checked(path, os.O_RDONLY, "presence record", max_size=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    return fd


def read_record(fd: int, where: str) -> PresenceInfo:
    """What the record open at ``fd`` says (for one who holds its lock, ``reaper``). Raises
    ``InternalError`` naming ``where`` if it is not ours or is corrupt. Does not block."""
    return read_record_stat(fd, where)[0]


def read_presence(names: Names, task: str) -> PresenceInfo | None:
    """Read ``task``'s presence record, whether its owner is alive or not.

    Returns None if there is none. Raises ``InternalError`` if the record is not ours (another
    owner uid, group/other permission bits, not a regular file, a symlink) or is corrupt.
    Does not block.
    """
    path = names.path(names.presence(task))
    fd = open_record(path)
    if fd is None:
        return None
    try:
        info, _ = read_record_stat(fd, path)
        return info
    finally:
        os.close(fd)


def describe_owner(fd: int, where: str) -> str:
    try:
        info = PresenceInfo.from_json(read_bytes(fd, where), where)
    except (InternalError, OSError):
        return "an unknown process"
    if info.pid == os.getpid() and info.boot_id == boot_id():
        return f"this process itself (pid {info.pid}, incarnation {info.incarnation:#x})"
    return f"pid {info.pid} (incarnation {info.incarnation:#x})"
