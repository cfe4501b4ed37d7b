"""Rendezvous keys and device names, as TensorFlow writes and parses them.

Keys as ``Rendezvous::CreateKey`` / ``ParseKey`` (tensorflow/core/framework/rendezvous.cc);
device names as ``DeviceNameUtils::ParseFullName`` (``parse``) and ``ParseLocalName``
(``parse_local``). Names are compared as parsed fields, never as string prefixes:
TensorFlow's ``IsLocalDevice`` prefix test lets ``task:1`` own ``task:10``. No I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from typing import NamedTuple

from ._errors import InvalidArgumentError

__all__ = ["MAX_KEY_BYTES", "DeviceName", "ParsedKey", "create_key", "parse_key"]


# TensorFlow: IsJobName / ConsumeJobName / ConsumeDeviceType accept [A-Za-z][A-Za-z0-9_]*.
# ASCII-only on purpose: ``[A-Za-z]`` is a literal range, unlike ``\w``.
_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_DIGITS = re.compile(r"[0-9]+")
_LOCAL = re.compile(r"[A-Za-z][A-Za-z0-9_]*:[0-9]+")

# TensorFlow keeps these fields in an ``int``; int64 fits its wire types and keeps ``int()``
# away from CPython's int_max_str_digits limit (a ValueError, not our error).
_MAX_NUMBER = 2**63 - 1
_MAX_NUMBER_DIGITS = len(str(_MAX_NUMBER))

# The prefixes ParseFullName's loop tries, in its order. Legacy forms ``/cpu:N`` and
# ``/gpu:N`` (either case) mean ``/device:CPU:N`` / ``/device:GPU:N``.
_PREFIXES = ("/job:", "/replica:", "/task:", "/device:", "/cpu:", "/CPU:", "/gpu:", "/GPU:")
_LEGACY_TYPES = {"/cpu:": "CPU", "/CPU:": "CPU", "/gpu:": "GPU", "/GPU:": "GPU"}

_QUOTE_LIMIT = 160


def _quote(text: str) -> str:
    """``repr`` of ``text`` for error messages, shortened."""
    if len(text) > _QUOTE_LIMIT:
        return repr(text[:_QUOTE_LIMIT]) + f"... ({len(text)} characters)"
    return repr(text)


def _check_number(value: object, field: str) -> None:
    if value is None:
        return
    if type(value) is not int:  # bool is an int subclass and is never meant here
        raise InvalidArgumentError(
            f"device name field {field} must be an int or None, not {type(value).__name__}"
        )
    if not 0 <= value <= _MAX_NUMBER:
        raise InvalidArgumentError(
            f"device name field {field} must be in 0..{_MAX_NUMBER}, got {value}"
        )


def _check_ident(value: object, field: str) -> None:
    if value is None:
        return
    if not isinstance(value, str) or _IDENT.fullmatch(value) is None:
        raise InvalidArgumentError(
            f"device name field {field} must match [A-Za-z][A-Za-z0-9_]* or be None, got {value!r}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceName:
    """A parsed device name; ``None`` in a field means unset (absent or ``*``). Equal by
    fields (``/cpu:0`` equals ``/device:CPU:0``); ``InvalidArgumentError`` for values no
    device name could spell."""

    job: str | None
    replica: int | None
    task: int | None
    type: str | None
    id: int | None

    def __post_init__(self) -> None:
        _check_ident(self.job, "job")
        _check_number(self.replica, "replica")
        _check_number(self.task, "task")
        _check_ident(self.type, "type")
        _check_number(self.id, "id")

    @classmethod
    def parse(cls, name: str) -> DeviceName:
        """Parse a full, partial or legacy (``/cpu:0``) name as TensorFlow's
        ``ParseFullName``; ``InvalidArgumentError`` naming the bad part. Cached."""
        if type(name) is not str:
            raise InvalidArgumentError(f"a device name must be a str, not {type(name).__name__}")
        return _parse_cached(name)

    @classmethod
    def parse_local(cls, name: str) -> DeviceName:
        """Parse ``<TYPE>:<n>`` (``CPU:0``) as TensorFlow's ``ParseLocalName``, or raise."""
        if type(name) is not str:
            raise InvalidArgumentError(f"a device name must be a str, not {type(name).__name__}")
        return _parse_local(name)

    def __str__(self) -> str:
        """Set parts only, as TensorFlow's ``ParsedNameToString``, except that an id of an
        unset type is written ``/device:*:id`` (TensorFlow drops it) so it parses back."""
        parts = [self.task_part]
        if self.type is not None or self.id is not None:
            type_ = "*" if self.type is None else self.type
            id_ = "*" if self.id is None else str(self.id)
            parts.append(f"/device:{type_}:{id_}")
        return "".join(parts)

    @property
    def task_part(self) -> str:
        """``/job:x/replica:r/task:t``, set parts only (``SplitDeviceName``'s first half)."""
        out = ""
        if self.job is not None:
            out += f"/job:{self.job}"
        if self.replica is not None:
            out += f"/replica:{self.replica}"
        if self.task is not None:
            out += f"/task:{self.task}"
        return out

    @property
    def has_task(self) -> bool:
        """Job and task are set: the name points at one worker process."""
        return self.job is not None and self.task is not None

    def same_task(self, other: DeviceName) -> bool:
        """Both set equal job and task, and equal replicas (unset counts as 0: TensorFlow's
        ``IsSameAddressSpace`` requires it set, but partial names are common)."""
        if not (self.has_task and other.has_task):
            return False
        return (
            self.job == other.job
            and self.task == other.task
            and (self.replica or 0) == (other.replica or 0)
        )

    def task_key(self) -> tuple[str, int, int]:
        """``(job, replica or 0, task)``, a hashable worker id; raise if job or task is unset."""
        if self.job is None or self.task is None:
            raise InvalidArgumentError(
                f"device name {_quote(str(self))} does not name a task: "
                "it needs both /job:<name> and /task:<n>"
            )
        return (self.job, self.replica or 0, self.task)

    def with_device(self, type: str | None, id: int | None) -> DeviceName:
        """This name with its device part replaced (``None`` unsets)."""
        return DeviceName(self.job, self.replica, self.task, type, id)


_UNSET = DeviceName(None, None, None, None, None)


def _error(name: str, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"Invalid device name {_quote(name)}: {what}")


def _parse_number(name: str, token: str, field: str) -> int | None:
    """The value of a ``<n>`` or ``*`` token; raise naming ``field`` otherwise."""
    if token == "*":
        return None
    if _DIGITS.fullmatch(token) is None:
        if not token:
            raise _error(name, f"{field} is empty; expected a decimal number or '*'")
        raise _error(name, f"{field} {_quote(token)} is not a decimal number or '*'")
    # The length first: int() of a very long digit string raises ValueError (CPython >= 3.11).
    digits = token.lstrip("0") or "0"
    if len(digits) > _MAX_NUMBER_DIGITS or int(digits) > _MAX_NUMBER:
        raise _error(name, f"{field} {_quote(token)} is larger than {_MAX_NUMBER}")
    return int(digits)


def _parse_ident(name: str, token: str, field: str) -> str | None:
    if token == "*":
        return None
    if _IDENT.fullmatch(token) is None:
        if not token:
            raise _error(name, f"{field} is empty; expected [A-Za-z][A-Za-z0-9_]* or '*'")
        raise _error(name, f"{field} {_quote(token)} does not match [A-Za-z][A-Za-z0-9_]* or '*'")
    return token


def _token(name: str, pos: int, stops: str) -> tuple[str, int]:
    """The text from ``pos`` up to the first character in ``stops``, and where it ends."""
    end = len(name)
    for stop in stops:
        found = name.find(stop, pos, end)
        if found != -1:
            end = found
    return name[pos:end], end


def _parse_local(name: str) -> DeviceName:
    if name.startswith("/"):
        raise _error(
            name, "a local name is <TYPE>:<n> (like CPU:0), without a leading '/' (that is parse's)"
        )
    type_token, pos = _token(name, 0, "/:")
    if _IDENT.fullmatch(type_token) is None:
        raise _error(
            name, "expected a local name <TYPE>:<n> (like CPU:0), TYPE [A-Za-z][A-Za-z0-9_]*"
        )
    if not name.startswith(":", pos):
        raise _error(name, f"local name {_quote(type_token)} lacks ':<n>' (like CPU:0)")
    id_token = name[pos + 1 :]
    if id_token == "*":
        raise _error(name, "a local name <TYPE>:<n> takes no '*' id")
    return DeviceName(None, None, None, type_token, _parse_number(name, id_token, "device id"))


def _parse_uncached(name: str) -> DeviceName:
    # TensorFlow: ``"/"`` alone is "no details"; the empty string falls out of the loop.
    if name in ("", "/"):
        return _UNSET
    if not name.startswith("/"):
        hint = ""
        if _LOCAL.fullmatch(name):
            hint = f"; {_quote(name)} is a local name: DeviceName.parse_local reads it"
        raise _error(
            name,
            "a device name starts with '/' (like /job:w/replica:0/task:0/device:CPU:0 "
            f"or /device:GPU:3){hint}",
        )
    job: str | None = None
    replica: int | None = None
    task: int | None = None
    type_: str | None = None
    id_: int | None = None
    pos = 0
    end = len(name)
    # TensorFlow's loop tries every prefix each round; every prefix starts with '/' and no
    # value holds one, so a value runs up to the next '/'. Same accepted language.
    while pos < end:
        prefix = next((p for p in _PREFIXES if name.startswith(p, pos)), None)
        if prefix is None:
            raise _error(
                name,
                f"unexpected {_quote(name[pos:])} at offset {pos}; expected one of "
                "/job:, /replica:, /task:, /device:, /cpu:, /gpu:",
            )
        pos += len(prefix)
        if prefix == "/job:":
            token, pos = _token(name, pos, "/")
            job = _parse_ident(name, token, "job name")
        elif prefix == "/replica:":
            token, pos = _token(name, pos, "/")
            replica = _parse_number(name, token, "replica")
        elif prefix == "/task:":
            token, pos = _token(name, pos, "/")
            task = _parse_number(name, token, "task")
        elif prefix == "/device:":
            # TensorFlow ConsumeDeviceType stops at '/' or ':'; an absent ':<n>' leaves id unset.
            token, pos = _token(name, pos, "/:")
            type_ = _parse_ident(name, token, "device type")
            id_ = None
            if name.startswith(":", pos):
                token, pos = _token(name, pos + 1, "/")
                id_ = _parse_number(name, token, "device id")
        else:
            type_ = _LEGACY_TYPES[prefix]
            token, pos = _token(name, pos, "/")
            id_ = _parse_number(name, token, "device id")
    return DeviceName(job, replica, task, type_, id_)


_parse_cached = functools.lru_cache(maxsize=4096)(_parse_uncached)  # few devices per job


_UINT64_LIMIT = 2**64
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# TensorFlow HexStringToUint64: [0-9a-fA-F]+, where a 17th digit silently shifts bits out;
# we refuse more than 16 (CreateKey writes exactly 16).
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
# TensorFlow only requires part 5 to be non-empty; we require what CreateKey writes,
# ``<frame_id uint64>:<iter_id int64>`` (-1 is TensorFlow's kIllegalIterId).
_FRAME_ITER = re.compile(r"([0-9]{1,20}):(-?[0-9]{1,19})")

# What a key's first three parts and its fifth parse to: a job has few devices and
# frames, so any key, new or reused, parses with one split and two lookups. Cleared when full.
_ENDS_MAX = 4096
_ends: dict[str, tuple[str, int, str, DeviceName, DeviceName]] = {}
_frames: dict[str, tuple[int, int]] = {}
_new_parsed = tuple.__new__

#: The longest key (UTF-8 bytes), checked where every path parses keys, so that no
#: transport takes a key another refuses.
MAX_KEY_BYTES = 64 << 10
# Keys of at most this many characters fit whatever their encoding (4 bytes a character).
_SHORT_KEY = MAX_KEY_BYTES // 4

_PART_NAMES = ("src_device", "src_incarnation", "dst_device", "edge_name", "frame_iter")


class ParsedKey(NamedTuple):
    """A parsed rendezvous key; ``str(pk)`` is ``pk.full_key``. ``src_device`` /
    ``dst_device`` as written (empty: the implicit local device), ``src`` / ``dst`` parsed.
    A named tuple: made per message at a tuple's cost."""

    src_device: str
    src_incarnation: int
    dst_device: str
    edge_name: str
    frame_iter: tuple[int, int]
    src: DeviceName
    dst: DeviceName
    full_key: str

    def __str__(self) -> str:
        return self.full_key


# Every bad-key message ends with how to make a good one.
_USE_CREATE_KEY = (
    "; build keys with shmrdv.create_key(src_device, src_incarnation, dst_device, edge_name)"
)


def _bad_key(key: str, part: int, what: str) -> InvalidArgumentError:
    # TensorFlow's "Invalid rendezvous key: <key>", plus which part is wrong and why.
    return InvalidArgumentError(
        f"Invalid rendezvous key {_quote(key)}: part {part} ({_PART_NAMES[part - 1]}) {what}"
        + _USE_CREATE_KEY
    )


def _device_problem(text: str, error: InvalidArgumentError) -> str:
    reason = str(error)
    prefix = f"Invalid device name {_quote(text)}: "
    if reason.startswith(prefix):
        reason = reason[len(prefix) :]
    return f"{_quote(text)} is not a device name: {reason}"


def _check_length(key: str) -> None:
    if len(key) <= _SHORT_KEY:
        return
    n = len(key.encode("utf-8", "surrogatepass"))
    if n > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"Invalid rendezvous key {_quote(key)}: {n} bytes (UTF-8) is too long: at most "
            f"{MAX_KEY_BYTES} bytes"
        )


def _check_edge_name(edge_name: str) -> str | None:
    """Why ``edge_name`` cannot be a key's part 4, or None if it can."""
    if not edge_name:
        return "is empty"
    if ";" in edge_name:
        return f"{_quote(edge_name)} contains ';', the key separator"
    try:
        edge_name.encode("utf-8")
    except UnicodeEncodeError:
        # Keys travel as proto3 ``string`` fields, which must be valid UTF-8.
        return f"{_quote(edge_name)} is not encodable as UTF-8 (lone surrogate)"
    return None


_NO_FRAME = (0, 0)
#: The "<src>;<incarnation>;<dst>" of keys made, by the arguments: a new edge name of
#: known ends is checked alone.
_heads: dict[tuple[str, int, str], str] = {}


def create_key(
    src_device: str | DeviceName,
    src_incarnation: int,
    dst_device: str | DeviceName,
    name: str,
    frame_iter: tuple[int, int] = _NO_FRAME,
) -> str:
    """A rendezvous key, byte-identical to TensorFlow's ``Rendezvous::CreateKey``.

    Devices are used as written and must parse (``""``: the implicit local device);
    ``name`` is non-empty without ``;``; ``frame_iter`` is (uint64, int64). Raises
    ``InvalidArgumentError`` naming the bad argument. See docs/api.md.
    """
    if (
        frame_iter is _NO_FRAME
        and type(name) is str
        and type(src_incarnation) is int
        and type(src_device) is str
        and type(dst_device) is str
    ):
        head = _heads.get((src_device, src_incarnation, dst_device))
        if head is not None and name and name.isascii() and ";" not in name:
            key = f"{head};{name};0:0"
            if len(key) <= _SHORT_KEY:
                return key
    src = _device_text(src_device, "src_device")
    dst = _device_text(dst_device, "dst_device")
    incarnation = _integer(src_incarnation, "src_incarnation")
    if not 0 <= incarnation < _UINT64_LIMIT:
        raise InvalidArgumentError(
            f"src_incarnation must be a uint64 (0 <= n < 2**64), got {incarnation}"
        )
    if not isinstance(name, str):
        raise InvalidArgumentError(f"edge name must be a str, not {type(name).__name__}")
    problem = _check_edge_name(name)
    if problem is not None:
        raise InvalidArgumentError(f"edge name {problem}")
    if not isinstance(frame_iter, tuple) or len(frame_iter) != 2:
        raise InvalidArgumentError(
            f"frame_iter must be a tuple (frame_id, iter_id), got {frame_iter!r:.80}"
        )
    frame_id = _integer(frame_iter[0], "frame_iter[0] (frame_id)")
    iter_id = _integer(frame_iter[1], "frame_iter[1] (iter_id)")
    if not 0 <= frame_id < _UINT64_LIMIT:
        raise InvalidArgumentError(f"frame_id must be a uint64, got {frame_id}")
    if not _INT64_MIN <= iter_id <= _INT64_MAX:
        raise InvalidArgumentError(f"iter_id must be an int64, got {iter_id}")
    # TensorFlow: Uint64ToHexString (formerly FpToString, "%016llx") -- same text.
    head = f"{src};{incarnation:016x};{dst}"
    key = f"{head};{name};{frame_id}:{iter_id}"
    _check_length(key)
    if type(src_device) is str and type(dst_device) is str:
        if len(_heads) >= _ENDS_MAX:
            _heads.clear()
        _heads[(src_device, incarnation, dst_device)] = head
    return key


def _device_text(device: str | DeviceName, what: str) -> str:
    if isinstance(device, DeviceName):
        return str(device)
    if not isinstance(device, str):
        raise InvalidArgumentError(f"{what} must be a str, not {type(device).__name__}")
    if ";" in device:
        raise InvalidArgumentError(f"{what} {_quote(device)} contains ';', the key separator")
    try:
        DeviceName.parse(device)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{what}: {e}") from None
    return device


def _integer(value: object, what: str) -> int:
    # operator.index takes numpy integers, not floats; True as an incarnation is a bug, not 1.
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an integer, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be an integer, not {type(value).__name__}"
        ) from None


def parse_key(key: str) -> ParsedKey:
    """Parse a key as TensorFlow's ``Rendezvous::ParseKey``, a little stricter: at most 16
    hex digits (TensorFlow overflows silently), a UTF-8 edge name, part 5 as
    ``<frame_id>:<iter_id>``, at most ``MAX_KEY_BYTES``. ``InvalidArgumentError`` quotes
    the key and names the wrong part."""
    if type(key) is not str:
        raise InvalidArgumentError(
            f"a rendezvous key must be a str, not {type(key).__name__}" + _USE_CREATE_KEY
        )
    # Ends and frame seen before: only the edge name is left to check (non-empty, ASCII).
    parts = key.rsplit(";", 2)
    if len(parts) == 3 and len(key) <= _SHORT_KEY:
        head, edge_name, fi_text = parts
        ends = _ends.get(head)
        frame_iter = _frames.get(fi_text)
        if ends is not None and frame_iter is not None and edge_name and edge_name.isascii():
            src_text, incarnation, dst_text, src, dst = ends
            return _new_parsed(
                ParsedKey,
                (src_text, incarnation, dst_text, edge_name, frame_iter, src, dst, key),
            )
    return _parse_key_checked(key)


def _parse_key_checked(key: str) -> ParsedKey:
    """``parse_key`` with every check, remembering what its ends and frame parse to."""
    _check_length(key)
    parts = key.split(";")
    if len(parts) != 5:
        expected = (
            ": src_device;src_incarnation;dst_device;edge_name;frame_id:iter_id"
            if len(parts) < 5
            else " (the edge name may not contain ';')"
        )
        raise InvalidArgumentError(
            f"Invalid rendezvous key {_quote(key)}: it has {len(parts)} ';'-separated parts, "
            f"expected 5{expected}{_USE_CREATE_KEY}"
        )
    src_text, inc_text, dst_text, edge_name, fi_text = parts
    try:
        src = DeviceName.parse(src_text)
    except InvalidArgumentError as e:
        raise _bad_key(key, 1, _device_problem(src_text, e)) from None
    if _HEX.fullmatch(inc_text) is None:
        if not inc_text:
            raise _bad_key(key, 2, "is empty; expected 16 hex digits")
        if re.fullmatch(r"[0-9a-fA-F]+", inc_text):
            raise _bad_key(key, 2, f"{_quote(inc_text)} has more than 16 hex digits (uint64)")
        raise _bad_key(key, 2, f"{_quote(inc_text)} is not hexadecimal")
    try:
        dst = DeviceName.parse(dst_text)
    except InvalidArgumentError as e:
        raise _bad_key(key, 3, _device_problem(dst_text, e)) from None
    problem = _check_edge_name(edge_name)
    if problem is not None:
        raise _bad_key(key, 4, problem)
    match = _FRAME_ITER.fullmatch(fi_text)
    if match is None:
        if not fi_text:
            raise _bad_key(key, 5, "is empty; expected <frame_id>:<iter_id> such as 0:0")
        raise _bad_key(
            key, 5, f"{_quote(fi_text)} is not <frame_id>:<iter_id> in decimal (such as 0:0)"
        )
    frame_id, iter_id = int(match[1]), int(match[2])
    if frame_id >= _UINT64_LIMIT or not _INT64_MIN <= iter_id <= _INT64_MAX:
        raise _bad_key(
            key, 5, f"{_quote(fi_text)} is out of range (frame_id uint64, iter_id int64)"
        )
    incarnation = int(inc_text, 16)
    if len(_ends) >= _ENDS_MAX:
        _ends.clear()
    if len(_frames) >= _ENDS_MAX:
        _frames.clear()
    _ends[f"{src_text};{inc_text};{dst_text}"] = (src_text, incarnation, dst_text, src, dst)
    _frames[fi_text] = (frame_id, iter_id)
    return ParsedKey(src_text, incarnation, dst_text, edge_name, (frame_id, iter_id), src, dst, key)
