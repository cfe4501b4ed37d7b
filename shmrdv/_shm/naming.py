"""Names of every OS object the shared-memory transport creates in ``/dev/shm``.

Pure: no I/O. Every name is ``shmrdv_<namespace>_<kind><rest>`` with only ``[a-z0-9_]``
and a fixed, short length, derived from the rendezvous key through a hash and never
taken from the user: keys are long and contain ``/`` and ``;`` (research/pitfalls.md §3),
and a name must not be guessable by another local user (§7: the namespace token is
the secret). Kinds, one letter each:

* ``w<taskhash>`` a worker's presence record;
* ``b<taskhash>`` a worker's doorbell semaphore, on disk as ``sem.shmrdv_<ns>_b<taskhash>``;
* ``t<random>`` a segment being written;
* ``m<hash>`` a published message, ``hash`` over (step_id, full_key, incarnation, seq);
* ``p<taskhash><incarnation16hex>x<slot>`` a free pool slot of a producer worker;
* ``h<taskhash><incarnation16hex>x<slot>`` a pool slot held by its consumer;
* ``r<taskhash><incarnation16hex>x<slot>`` a pool slot its consumer released.

Pool slot names carry the producer's task as well as its incarnation: several producer
workers may share an incarnation (``Worker(..., incarnation=1)``) and must never share a
slot name.

Hashes are 10-byte blake2b digests (80 bits, 20 hex characters) over a struct-packed,
length-prefixed encoding of the fields, with a per-kind ``person`` string so that no two
kinds or field tuples can collide by construction.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import struct
from dataclasses import dataclass

from .._errors import InvalidArgumentError

__all__ = [
    "DIGEST_BYTES",
    "KINDS",
    "MAX_SLOT",
    "PREFIX",
    "SEM_PREFIX",
    "SHM_DIR",
    "Names",
    "ObjectName",
    "check_namespace",
    "parse_name",
]

#: Where Linux/glibc keeps POSIX shared memory (``shm_open("/x")`` is ``/dev/shm/x``).
SHM_DIR = "/dev/shm"
#: Every object shmrdv creates starts with this (DESIGN.md: tools list and collect by it).
PREFIX = "shmrdv_"
#: glibc stores the named semaphore ``/x`` as the file ``/dev/shm/sem.x`` (sem_overview(7)).
SEM_PREFIX = "sem."
#: 80-bit digests: collisions among a job's live messages are negligible (birthday bound
#: ~2**40), and names stay short (pitfalls.md §3 recommends fixed-length hashed names).
DIGEST_BYTES = 10
#: Object kinds, by their one-letter code on disk.
KINDS = {
    "w": "presence",
    "b": "bell",
    "t": "temp",
    "m": "message",
    "p": "pool",
    "h": "held",
    "r": "returned",
    "q": "ring",
}
_CODES = {kind: code for code, kind in KINDS.items()}

_NAMESPACE_RE = re.compile(r"[a-z0-9]{8,64}")
_HEX_RE = re.compile(rf"[0-9a-f]{{{2 * DIGEST_BYTES}}}")
_SLOT_RE = re.compile(rf"[0-9a-f]{{{2 * DIGEST_BYTES}}}([0-9a-f]{{16}})x(0|[1-9][0-9]{{0,6}})")
_U64_MAX = 2**64 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
#: A producer never needs a million pool slots; the bound keeps names under 100 characters.
MAX_SLOT = 2**20 - 1
_MESSAGE_FIELDS = struct.Struct("<qQQQ")  # step_id, incarnation, seq, len(full_key)
_LENGTH = struct.Struct("<Q")


def check_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is a valid token (``[a-z0-9]{8,64}``), else raise.

    Raises ``InvalidArgumentError`` naming the bad value.
    """
    if not isinstance(namespace, str) or _NAMESPACE_RE.fullmatch(namespace) is None:
        raise InvalidArgumentError(
            f"invalid shmrdv namespace {namespace!r}: expected 8 to 64 characters of [a-z0-9] "
            "(use shmrdv.new_namespace())"
        )
    return namespace


def _digest(person: bytes, data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=person).hexdigest()


def _task_hash(task: str) -> str:
    if not isinstance(task, str) or not task:
        raise InvalidArgumentError(f"invalid task name {task!r}: expected a non-empty string")
    raw = task.encode("utf-8")
    return _digest(b"shmrdv.task", _LENGTH.pack(len(raw)) + raw)


def _slot_rest(task: str, incarnation: int, slot: int) -> str:
    if not 0 <= incarnation <= _U64_MAX:
        raise InvalidArgumentError(f"invalid incarnation {incarnation!r}: expected a uint64")
    if not 0 <= slot <= MAX_SLOT:
        raise InvalidArgumentError(
            f"invalid pool slot {slot!r}: expected an int in [0, {MAX_SLOT}]"
        )
    return f"{_task_hash(task)}{incarnation:016x}x{slot:d}"


@dataclass(frozen=True)
class ObjectName:
    """What an entry of ``/dev/shm`` is, when shmrdv made it (see ``parse_name``).

    ``kind`` is one of ``KINDS``' values; ``rest`` is the text after the kind letter;
    ``incarnation`` and ``slot`` are set for ``pool`` / ``held`` / ``returned`` only.
    ``entry`` is the directory entry as given (with ``sem.`` for a bell).
    """

    entry: str
    kind: str
    namespace: str
    rest: str
    incarnation: int | None = None
    slot: int | None = None


def parse_name(entry: str) -> ObjectName | None:
    """Classify a ``/dev/shm`` directory entry; ``None`` for anything shmrdv did not name.

    Strict: only names ``Names`` can produce are recognised (a bell only with its
    ``sem.`` prefix, everything else only without). Never raises.
    """
    name = entry
    is_sem = name.startswith(SEM_PREFIX)
    if is_sem:
        name = name[len(SEM_PREFIX) :]
    if not name.startswith(PREFIX):
        return None
    namespace, sep, tail = name[len(PREFIX) :].partition("_")
    if not sep or not tail or _NAMESPACE_RE.fullmatch(namespace) is None:
        return None
    kind = KINDS.get(tail[0])
    rest = tail[1:]
    if kind is None or is_sem != (kind == "bell"):
        return None
    if kind in ("pool", "held", "returned"):
        match = _SLOT_RE.fullmatch(rest)
        if match is None:
            return None
        slot = int(match.group(2))
        if slot > MAX_SLOT:
            return None
        return ObjectName(entry, kind, namespace, rest, int(match.group(1), 16), slot)
    if _HEX_RE.fullmatch(rest) is None:
        return None
    return ObjectName(entry, kind, namespace, rest)


@dataclass(frozen=True)
class Names:
    """The names of one namespace's objects. Bare names: no directory, no leading slash.

    Raises ``InvalidArgumentError`` for a namespace that is not ``[a-z0-9]{8,64}`` and
    for out-of-range fields (task names must be non-empty; incarnations and sequence
    numbers are uint64, step ids int64, slots >= 0).
    """

    namespace: str

    def __post_init__(self) -> None:
        check_namespace(self.namespace)

    @property
    def prefix(self) -> str:
        """``shmrdv_<namespace>_``: every segment and record of this namespace starts so."""
        return f"{PREFIX}{self.namespace}_"

    def _name(self, kind: str, rest: str) -> str:
        return f"{self.prefix}{_CODES[kind]}{rest}"

    def presence(self, task: str) -> str:
        """The presence record of the worker ``task`` (canonical task name)."""
        return self._name("presence", _task_hash(task))

    def bell(self, task: str) -> str:
        """The ``posix_ipc`` name (with its leading slash) of the worker ``task``'s doorbell."""
        return "/" + self._name("bell", _task_hash(task))

    def bell_path(self, task: str) -> str:
        """Where glibc keeps that semaphore: ``/dev/shm/sem.shmrdv_<ns>_b<hash>``."""
        return f"{SHM_DIR}/{SEM_PREFIX}{self._name('bell', _task_hash(task))}"

    def message(self, step_id: int, full_key: str, producer_incarnation: int, seq: int) -> str:
        """The published segment of the ``seq``-th send of ``full_key`` in step ``step_id``."""
        if not _I64_MIN <= step_id <= _I64_MAX:
            raise InvalidArgumentError(f"invalid step id {step_id!r}: expected an int64")
        if not 0 <= producer_incarnation <= _U64_MAX:
            raise InvalidArgumentError(
                f"invalid incarnation {producer_incarnation!r}: expected a uint64"
            )
        if not 0 <= seq <= _U64_MAX:
            raise InvalidArgumentError(f"invalid sequence number {seq!r}: expected a uint64")
        raw = full_key.encode("utf-8")
        data = _MESSAGE_FIELDS.pack(step_id, producer_incarnation, seq, len(raw)) + raw
        return self._name("message", _digest(b"shmrdv.message", data))

    def ring(self, producer_task: str, producer_incarnation: int, consumer_task: str) -> str:
        """The small-message ring from one producer run to one consumer worker."""
        if not 0 <= producer_incarnation <= _U64_MAX:
            raise InvalidArgumentError(
                f"invalid incarnation {producer_incarnation!r}: expected a uint64"
            )
        a, b = producer_task.encode("utf-8"), consumer_task.encode("utf-8")
        data = _LENGTH.pack(len(a)) + a + _LENGTH.pack(producer_incarnation) + b
        return self._name("ring", _digest(b"shmrdv.ring", data))

    def temp(self) -> str:
        """A fresh, unguessable name (80 random bits, ``secrets``) for a segment being written."""
        return self._name("temp", secrets.token_hex(DIGEST_BYTES))

    def pool(self, task: str, incarnation: int, slot: int) -> str:
        """Free pool slot ``slot`` of the producer worker ``task`` with ``incarnation``."""
        return self._name("pool", _slot_rest(task, incarnation, slot))

    def held(self, task: str, incarnation: int, slot: int) -> str:
        """The same slot while its consumer holds it."""
        return self._name("held", _slot_rest(task, incarnation, slot))

    def returned(self, task: str, incarnation: int, slot: int) -> str:
        """The same slot once its consumer released it (for the producer to take back)."""
        return self._name("returned", _slot_rest(task, incarnation, slot))

    @staticmethod
    def path(name: str) -> str:
        """The file of a bare segment name: ``/dev/shm/<name>``."""
        return f"{SHM_DIR}/{name}"
