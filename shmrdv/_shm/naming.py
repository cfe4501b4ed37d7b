"""Names of every OS object the shared-memory transport creates in ``/dev/shm``.

Pure: no I/O. Every name is ``shmrdv_<namespace id>_<kind><hash>`` with only ``[a-z0-9_]``
and a fixed, short length. The *namespace id* is a public digest of the secret namespace
token (``shmrdv.namespace_id``): tools list and collect a job's objects by it. The hash is
a blake2b **keyed by the token** over the object's fields, so one who can list /dev/shm
(every local user) can neither find the token nor predict, squat or plant a name of the
job (DESIGN.md "Names and keys"; research/pitfalls.md §3, §7; issue 13 §2). Names are
derived from the rendezvous key through the hash, never taken from the user: keys are long
and contain ``/`` and ``;``. Kinds, one letter each:

* ``w<taskhash>`` a worker's presence record;
* ``b<taskhash>`` a worker's doorbell semaphore, on disk as ``sem.shmrdv_<id>_b<taskhash>``
  (the same keyed task hash as the presence record: tools pair them);
* ``t<random>`` a segment being written (80 random bits);
* ``m<hash>`` a published message, over (step_id, full_key, incarnation, seq);
* ``q<hash>`` the ring from one producer run to one consumer;
* ``p<hash>`` / ``h<hash>`` / ``r<hash>`` a producer's pool slot while free, held by its
  consumer, and released, each over (task, incarnation, slot) with its own ``person``:
  seeing a slot's ``p`` name tells nothing of its ``h`` or ``r`` name.

Pool slot names cover the producer's task as well as its incarnation: several producer
workers may share an incarnation (``Worker(..., incarnation=1)``) and must never share a
slot name.

Hashes are 10-byte digests (80 bits, 20 hex characters) over a struct-packed,
length-prefixed encoding of the fields, with a per-kind ``person`` string so that no two
kinds or field tuples can collide by construction. ``parse_name`` recognises a name's kind
and namespace id only: the rest cannot be read back without the token.
"""

from __future__ import annotations

import functools
import hashlib
import re
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

from .._cluster import NAMESPACE_ID_HEX, describe_bad_token, namespace_id
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
_ID_RE = re.compile(rf"[0-9a-f]{{{NAMESPACE_ID_HEX}}}")
_HEX_RE = re.compile(rf"[0-9a-f]{{{2 * DIGEST_BYTES}}}")
_U64_MAX = 2**64 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
#: A producer never needs a million pool slots.
MAX_SLOT = 2**20 - 1
#: A pool slot's names are over its *ticket*: the slot index in the low ``SLOT_BITS`` bits
#: and the slot's lend generation above. Each lend of a slot thus has ``p``/``h``/``r``
#: names of its own, never used again: a name another user saw vacated and planted a
#: file under is never wanted afterwards (issue 20 §3).
SLOT_BITS = 20
MAX_TICKET = 2**62 - 1
_MESSAGE_FIELDS = struct.Struct("<qQQQ")  # step_id, incarnation, seq, len(full_key)
_SLOT_FIELDS = struct.Struct("<QQ")  # incarnation, slot
_LENGTH = struct.Struct("<Q")
_PERSONS = {
    "pool": b"shmrdv.pool",
    "held": b"shmrdv.held",
    "returned": b"shmrdv.returned",
}


def check_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is a valid token (``[a-z0-9]{8,64}``), else raise.

    Raises ``InvalidArgumentError`` describing the bad value without echoing it.
    """
    if not isinstance(namespace, str) or _NAMESPACE_RE.fullmatch(namespace) is None:
        raise InvalidArgumentError(
            f"invalid shmrdv namespace ({describe_bad_token(namespace)}): expected 8 to 64 "
            "characters of [a-z0-9] (use shmrdv.new_namespace())"
        )
    return namespace


@functools.lru_cache(maxsize=64)
def _keyed_state(key: bytes, person: bytes) -> Any:
    """A blake2b state with the key block of ``key`` already absorbed, for ``person``: the
    names of a pool slot or a message are computed on every handoff, and a copy of this
    state costs less than keying afresh (the same digest). Kept here, not on ``Names``,
    which stays plain data (it pickles)."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES, key=key, person=person)


@functools.lru_cache(maxsize=1024)
def _encoded_task(task: str) -> bytes:
    """The length-prefixed UTF-8 of ``task`` (cached: a worker names few tasks, per message)."""
    if not isinstance(task, str) or not task:
        raise InvalidArgumentError(f"invalid task name {task!r}: expected a non-empty string")
    raw = task.encode("utf-8")
    return _LENGTH.pack(len(raw)) + raw


def _check_incarnation(incarnation: int) -> None:
    if not 0 <= incarnation <= _U64_MAX:
        raise InvalidArgumentError(f"invalid incarnation {incarnation!r}: expected a uint64")


@dataclass(frozen=True)
class ObjectName:
    """What an entry of ``/dev/shm`` is, when shmrdv made it (see ``parse_name``).

    ``kind`` is one of ``KINDS``' values; ``namespace`` is the namespace *id* (public, not
    the token); ``rest`` is the text after the kind letter (a keyed hash: opaque without
    the token). ``entry`` is the directory entry as given (with ``sem.`` for a bell).
    """

    entry: str
    kind: str
    namespace: str
    rest: str


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
    if not sep or not tail or _ID_RE.fullmatch(namespace) is None:
        return None
    kind = KINDS.get(tail[0])
    rest = tail[1:]
    if kind is None or is_sem != (kind == "bell") or _HEX_RE.fullmatch(rest) is None:
        return None
    return ObjectName(entry, kind, namespace, rest)


@dataclass(frozen=True)
class Names:
    """The names of one namespace's objects. Bare names: no directory, no leading slash.

    ``namespace`` is the secret token; ``namespace_id`` its public digest, the one part of
    a name in clear. Raises ``InvalidArgumentError`` for a namespace that is not
    ``[a-z0-9]{8,64}`` and for out-of-range fields (task names must be non-empty;
    incarnations and sequence numbers are uint64, step ids int64, slots in [0, MAX_SLOT]).
    """

    namespace: str = field(repr=False)  # the secret: kept out of logs
    namespace_id: str = field(init=False)
    _key: bytes = field(init=False, repr=False, compare=False)
    _prefix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        object.__setattr__(self, "namespace_id", namespace_id(self.namespace))
        object.__setattr__(self, "_key", self.namespace.encode("ascii"))
        object.__setattr__(self, "_prefix", f"{PREFIX}{self.namespace_id}_")

    @property
    def prefix(self) -> str:
        """``shmrdv_<namespace id>_``: every segment and record of this namespace starts so."""
        return self._prefix

    def _name(self, kind: str, rest: str) -> str:
        return f"{self._prefix}{_CODES[kind]}{rest}"

    def _digest(self, person: bytes, data: bytes) -> str:
        """blake2b keyed by the token: unpredictable without it (a token is <= 64 bytes, the
        most blake2b takes as a key). The keyed state of ``person`` is made once and copied:
        the same digest as hashing key block and data afresh."""
        h = _keyed_state(self._key, person).copy()
        h.update(data)
        return str(h.hexdigest())

    def _task_hash(self, task: str) -> str:
        return self._digest(b"shmrdv.task", _encoded_task(task))

    def _slot(self, kind: str, task: str, incarnation: int, slot: int) -> str:
        _check_incarnation(incarnation)
        if not 0 <= slot <= MAX_TICKET:
            raise InvalidArgumentError(
                f"invalid pool slot ticket {slot!r}: expected an int in [0, {MAX_TICKET}]"
            )
        data = _encoded_task(task) + _SLOT_FIELDS.pack(incarnation, slot)
        return self._name(kind, self._digest(_PERSONS[kind], data))

    def presence(self, task: str) -> str:
        """The presence record of the worker ``task`` (canonical task name)."""
        return self._name("presence", self._task_hash(task))

    def bell(self, task: str) -> str:
        """The ``posix_ipc`` name (with its leading slash) of the worker ``task``'s doorbell."""
        return "/" + self._name("bell", self._task_hash(task))

    def bell_path(self, task: str) -> str:
        """Where glibc keeps that semaphore: ``/dev/shm/sem.shmrdv_<id>_b<hash>``."""
        return f"{SHM_DIR}/{SEM_PREFIX}{self._name('bell', self._task_hash(task))}"

    def message(self, step_id: int, full_key: str, producer_incarnation: int, seq: int) -> str:
        """The published segment of the ``seq``-th send of ``full_key`` in step ``step_id``."""
        if not _I64_MIN <= step_id <= _I64_MAX:
            raise InvalidArgumentError(f"invalid step id {step_id!r}: expected an int64")
        _check_incarnation(producer_incarnation)
        if not 0 <= seq <= _U64_MAX:
            raise InvalidArgumentError(f"invalid sequence number {seq!r}: expected a uint64")
        raw = full_key.encode("utf-8")
        data = _MESSAGE_FIELDS.pack(step_id, producer_incarnation, seq, len(raw)) + raw
        return self._name("message", self._digest(b"shmrdv.message", data))

    def ring(self, producer_task: str, producer_incarnation: int, consumer_task: str) -> str:
        """The small-message ring from one producer run to one consumer worker."""
        _check_incarnation(producer_incarnation)
        data = (
            _encoded_task(producer_task)
            + _LENGTH.pack(producer_incarnation)
            + _encoded_task(consumer_task)
        )
        return self._name("ring", self._digest(b"shmrdv.ring", data))

    def temp(self) -> str:
        """A fresh, unguessable name (80 random bits, ``secrets``) for a segment being written."""
        return self._name("temp", secrets.token_hex(DIGEST_BYTES))

    def pool(self, task: str, incarnation: int, slot: int) -> str:
        """Free pool slot ``slot`` (its ticket, ``MAX_TICKET``) of the producer worker
        ``task`` with ``incarnation``."""
        return self._slot("pool", task, incarnation, slot)

    def held(self, task: str, incarnation: int, slot: int) -> str:
        """The same slot while its consumer holds it."""
        return self._slot("held", task, incarnation, slot)

    def returned(self, task: str, incarnation: int, slot: int) -> str:
        """The same slot once its consumer released it (for the producer to take back)."""
        return self._slot("returned", task, incarnation, slot)

    @staticmethod
    def path(name: str) -> str:
        """The file of a bare segment name: ``/dev/shm/<name>``."""
        return f"{SHM_DIR}/{name}"
