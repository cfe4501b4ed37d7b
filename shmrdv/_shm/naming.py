"""Names of every OS object the shared-memory transport creates in ``/dev/shm``.

Pure: no I/O. Every name is ``shmrdv_<namespace id>_<kind><hash>``: the public digest of
the secret token (tools list and collect a job's objects by it), then a blake2b **keyed by
the token** over the object's length-prefixed fields with a ``person`` per kind, so that
whoever lists /dev/shm can neither find the token nor predict, squat or plant a name of the
job (DESIGN.md "Names and keys"). Kinds: ``w`` presence record and ``b`` doorbell, over the
task; ``t`` a segment being written (random); ``m`` a message, over (step, key, incarnation,
seq); ``q`` a producer run's ring to a consumer; ``p`` / ``h`` / ``r`` a pool slot free,
held and returned, over (producer task, incarnation, ticket), each keyed apart.
"""

from __future__ import annotations

import functools
import hashlib
import re
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

from .._cluster import NAMESPACE_ID_HEX, namespace_id
from .._errors import InvalidArgumentError

__all__ = ["CODES", "KINDS", "MAX_SLOT", "PREFIX", "SEM_PREFIX", "SHM_DIR", "SLOT_BITS", "Names"]
__all__ += ["ObjectName", "parse_name"]

#: Where Linux/glibc keeps POSIX shared memory (``shm_open("/x")`` is ``/dev/shm/x``).
SHM_DIR = "/dev/shm"
PREFIX = "shmrdv_"
#: glibc stores the named semaphore ``/x`` as the file ``/dev/shm/sem.x`` (sem_overview(7)).
SEM_PREFIX = "sem."
#: 80-bit digests: a collision among a job's live objects is negligible (birthday ~2**40).
DIGEST_BYTES = 10
KINDS = dict(
    w="presence", b="bell", t="temp", m="message", p="pool", h="held", r="returned", q="ring"
)
CODES = {kind: code for code, kind in KINDS.items()}  # the letter of each kind
_ID_RE = re.compile(rf"[0-9a-f]{{{NAMESPACE_ID_HEX}}}")
_HEX_RE = re.compile(rf"[0-9a-f]{{{2 * DIGEST_BYTES}}}")
#: A producer never needs a million pool slots.
MAX_SLOT = 2**20 - 1
#: A slot's names are over its *ticket*: the slot index in the low ``SLOT_BITS`` bits, its
#: lend generation above. Each lend has names of its own, never used again: a name another
#: user saw vacated and planted a file under is never wanted afterwards.
SLOT_BITS = 20
# Packing refuses what is out of range: step_id int64, incarnation, seq and ticket uint64.
_MESSAGE_FIELDS = struct.Struct("<qQQQ")  # step_id, incarnation, seq, len(full_key)
_SLOT_FIELDS = struct.Struct("<QQ")  # incarnation, ticket
_LENGTH = struct.Struct("<Q")


@functools.lru_cache(maxsize=64)
def _keyed_state(key: bytes, person: bytes) -> Any:
    """A blake2b state with the key absorbed: a copy costs less than keying afresh. Not on
    ``Names``, which stays plain data (it pickles)."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES, key=key, person=person)


@functools.lru_cache(maxsize=1024)
def _encoded_task(task: str) -> bytes:
    if not isinstance(task, str) or not task:
        raise InvalidArgumentError(f"invalid task name {task!r}: expected a non-empty string")
    raw = task.encode("utf-8")
    return _LENGTH.pack(len(raw)) + raw


def _packed(fields: struct.Struct, what: str, *values: int) -> bytes:
    try:
        return fields.pack(*values)
    except struct.error as e:
        raise InvalidArgumentError(f"invalid {what} {values}: {e}") from e


@dataclass(frozen=True)
class ObjectName:
    """A ``/dev/shm`` entry shmrdv made (``sem.`` kept for a bell): its ``kind``, public
    ``namespace`` id, and ``rest``, the keyed hash after the kind letter."""

    entry: str
    kind: str
    namespace: str
    rest: str


def parse_name(entry: str) -> ObjectName | None:
    """Classify a ``/dev/shm`` entry: None for anything ``Names`` cannot produce (a bell
    only with its ``sem.`` prefix, all else only without). Never raises."""
    is_sem = entry.startswith(SEM_PREFIX)
    name = entry[len(SEM_PREFIX) :] if is_sem else entry
    if not name.startswith(PREFIX):
        return None
    namespace, sep, tail = name[len(PREFIX) :].partition("_")
    if not sep or not tail or _ID_RE.fullmatch(namespace) is None:
        return None
    kind = KINDS.get(tail[0])
    rest = tail[1:]
    if kind is None or is_sem != (kind == "bell") or _HEX_RE.fullmatch(rest) is None:
        return None
    return ObjectName(entry, kind, namespace, rest)


@dataclass(frozen=True)
class Names:
    """The bare names of one namespace's objects (``namespace``: the secret token). Raises
    ``InvalidArgumentError`` for an invalid token (as ``namespace_id``) or a field out of
    range."""

    namespace: str = field(repr=False)  # the secret: kept out of logs
    namespace_id: str = field(init=False)
    _key: bytes = field(init=False, repr=False, compare=False)
    prefix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "namespace_id", namespace_id(self.namespace))
        object.__setattr__(self, "_key", self.namespace.encode("ascii"))
        object.__setattr__(self, "prefix", f"{PREFIX}{self.namespace_id}_")

    def _name(self, kind: str, person: bytes, data: bytes) -> str:
        h = _keyed_state(self._key, person).copy()  # a token (<= 64 bytes) is a blake2b key
        h.update(data)
        return f"{self.prefix}{CODES[kind]}{h.hexdigest()}"

    def _slot(self, kind: str, task: str, incarnation: int, ticket: int) -> str:
        data = _encoded_task(task) + _packed(_SLOT_FIELDS, "pool slot", incarnation, ticket)
        return self._name(kind, b"shmrdv." + kind.encode(), data)

    def presence(self, task: str) -> str:
        """The presence record of the worker ``task``."""
        return self._name("presence", b"shmrdv.task", _encoded_task(task))

    def bell(self, task: str) -> str:
        """The ``posix_ipc`` name (a leading slash) of the worker ``task``'s doorbell."""
        return "/" + self._name("bell", b"shmrdv.task", _encoded_task(task))

    def bell_path(self, task: str) -> str:
        """Where glibc keeps that semaphore: ``/dev/shm/sem.shmrdv_<id>_b<hash>``."""
        return f"{SHM_DIR}/{SEM_PREFIX}{self.bell(task)[1:]}"

    def message(self, step_id: int, full_key: str, producer_incarnation: int, seq: int) -> str:
        """The published segment of the ``seq``-th send of ``full_key`` in step ``step_id``."""
        raw = full_key.encode("utf-8")
        fields = _packed(_MESSAGE_FIELDS, "message", step_id, producer_incarnation, seq, len(raw))
        return self._name("message", b"shmrdv.message", fields + raw)

    def ring(self, producer_task: str, producer_incarnation: int, consumer_task: str) -> str:
        """The small-message ring from one producer run to one consumer worker."""
        inc = _packed(_LENGTH, "incarnation", producer_incarnation)
        data = _encoded_task(producer_task) + inc + _encoded_task(consumer_task)
        return self._name("ring", b"shmrdv.ring", data)

    def temp(self) -> str:
        """A fresh, unguessable name (80 random bits) for a segment being written."""
        return f"{self.prefix}t{secrets.token_hex(DIGEST_BYTES)}"

    def pool(self, task: str, incarnation: int, ticket: int) -> str:
        """The free pool slot ``ticket`` of the producer worker ``task`` of ``incarnation``."""
        return self._slot("pool", task, incarnation, ticket)

    def held(self, task: str, incarnation: int, ticket: int) -> str:
        """The same slot while its consumer holds it."""
        return self._slot("held", task, incarnation, ticket)

    def returned(self, task: str, incarnation: int, ticket: int) -> str:
        """The same slot once its consumer gave it back (for the producer to take back)."""
        return self._slot("returned", task, incarnation, ticket)

    @staticmethod
    def path(name: str) -> str:
        return f"{SHM_DIR}/{name}"
