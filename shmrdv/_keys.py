"""Rendezvous keys: TensorFlow's ``Rendezvous::CreateKey`` / ``ParseKey`` text format.

A key is five fields joined by ``;``::

    <src_device>;<src_incarnation: 16 lowercase hex>;<dst_device>;<edge_name>;<frame>:<iter>

for example (one line)::

    /job:w/replica:0/task:7/device:CPU:0;2845c575404f86b6;
    /job:w/replica:0/task:7/device:CPU:0;Placeholder_112:0;0:0

(tensorflow/core/framework/rendezvous.cc; research/tf_rendezvous.md §1). Pure functions,
no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import re

from ._devices import DeviceName, _quote, parse_full_name
from ._errors import InvalidArgumentError

__all__ = ["MAX_KEY_BYTES", "ParsedKey", "create_key", "key_digest", "parse_key"]

_UINT64_LIMIT = 2**64
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# TensorFlow HexStringToUint64: one or more of [0-9a-fA-F], no "0x", no sign. It does not
# check the length, so a 17th digit silently shifts bits out of the uint64; we refuse
# more than 16 digits instead (CreateKey always writes exactly 16).
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
# TensorFlow only requires part 5 to be non-empty. We also require FrameAndIter's
# shape, ``<frame_id>:<iter_id>`` in ASCII decimal (frame_id uint64, iter_id int64, which
# may be -1, TensorFlow's kIllegalIterId), because CreateKey never writes anything else
# and a malformed one is a caller's bug worth reporting.
_FRAME_ITER = re.compile(r"([0-9]{1,20}):(-?[0-9]{1,19})")

# Distinct keys a process uses at once; parse_key is on the send/recv hot path.
_PARSE_CACHE_SIZE = 8192
_DIGEST_SIZE = 16

#: The longest key (UTF-8 bytes) any transport carries: checked here, where every path
#: parses its keys, so that no transport takes a key another one refuses (a gRPC request,
#: a segment header and a ring record each hold the key whole). TensorFlow's keys are a
#: few hundred bytes.
MAX_KEY_BYTES = 64 << 10

_PART_NAMES = ("src_device", "src_incarnation", "dst_device", "edge_name", "frame_iter")


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedKey:
    """A parsed rendezvous key. ``str(pk)`` is the key text, ``pk.full_key``.

    ``src_device`` and ``dst_device`` are the device parts exactly as written in the key
    (possibly empty: TensorFlow's "implicit local device"); ``src`` and ``dst`` are the
    same parts parsed.
    """

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


def _bad_key(key: str, part: int, what: str) -> InvalidArgumentError:
    # TensorFlow says "Invalid  rendezvous key: <key>"; we keep that prefix and add which
    # part is wrong and why.
    return InvalidArgumentError(
        f"Invalid rendezvous key {_quote(key)}: part {part} ({_PART_NAMES[part - 1]}) {what}"
    )


def _device_problem(text: str, error: InvalidArgumentError) -> str:
    """``error`` from parsing device ``text``, reworded as the problem of a key part."""
    reason = str(error)
    prefix = f"Invalid device name {_quote(text)}: "
    if reason.startswith(prefix):
        reason = reason[len(prefix) :]
    return f"{_quote(text)} is not a device name: {reason}"


def _check_length(key: str) -> None:
    """Raise ``InvalidArgumentError`` if ``key`` is longer than ``MAX_KEY_BYTES``."""
    if len(key) <= MAX_KEY_BYTES // 4:  # (at most 4 bytes a character: no encoding)
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
        # Keys travel as proto3 ``string`` fields (RecvTensorRequest.rendezvous_key), which
        # must be valid UTF-8; a lone surrogate cannot be encoded.
        return f"{_quote(edge_name)} is not encodable as UTF-8 (lone surrogate)"
    return None


def create_key(
    src_device: str | DeviceName,
    src_incarnation: int,
    dst_device: str | DeviceName,
    name: str,
    frame_iter: tuple[int, int] = (0, 0),
) -> str:
    """Build a rendezvous key, byte-identical to TensorFlow's ``Rendezvous::CreateKey``.

    Device names are used as written (a ``DeviceName`` as its canonical ``str``); they
    must parse (the empty string means "implicit local device"). ``src_incarnation`` is a
    uint64 written as 16 lowercase zero-padded hex digits. ``name`` is the edge name:
    non-empty, no ``;``. ``frame_iter`` is ``(frame_id, iter_id)`` as uint64 and int64;
    ``(0, 0)`` outside loops. Raises ``InvalidArgumentError`` naming the bad argument.
    """
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
    key = f"{src};{incarnation:016x};{dst};{name};{frame_id}:{iter_id}"
    _check_length(key)
    return key


def _device_text(device: str | DeviceName, what: str) -> str:
    if isinstance(device, DeviceName):
        return str(device)
    if not isinstance(device, str):
        raise InvalidArgumentError(f"{what} must be a str, not {type(device).__name__}")
    if ";" in device:
        raise InvalidArgumentError(f"{what} {_quote(device)} contains ';', the key separator")
    try:
        parse_full_name(device)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{what}: {e}") from None
    return device


def _integer(value: object, what: str) -> int:
    # operator.index accepts int and numpy integers but not floats or strings; bool is
    # refused on purpose (True as an incarnation is a bug, not 1).
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be an integer, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"{what} must be an integer, not {type(value).__name__}"
        ) from None


def parse_key(key: str) -> ParsedKey:
    """Parse a rendezvous key as TensorFlow's ``Rendezvous::ParseKey`` does, or raise.

    Rules (TensorFlow's unless marked *ours*):

    1. exactly five ``;``-separated parts; a sixth part is an error (*ours*: also an
       empty one, i.e. a trailing ``;``, which TensorFlow's cursor arithmetic lets through);
    2. parts 1 and 3 parse as device names (``ParseFullName``; empty means unset);
    3. part 2 is 1 to 16 hex digits, either case (*ours*: at most 16; TensorFlow
       overflows silently);
    4. part 4, the edge name, is not empty (*ours*: and is valid UTF-8);
    5. part 5 is not empty (*ours*: it is ``<frame_id>:<iter_id>``, uint64 and int64 in
       ASCII decimal);
    6. *ours*: at most ``MAX_KEY_BYTES`` bytes of UTF-8.

    Raises ``InvalidArgumentError`` (a ``ValueError``) quoting the key and naming the
    part that is wrong. Results are cached: this is on the send/recv hot path.
    """
    if type(key) is not str:
        raise InvalidArgumentError(f"a rendezvous key must be a str, not {type(key).__name__}")
    return _parse_key_cached(key)


def _parse_key_uncached(key: str) -> ParsedKey:
    _check_length(key)
    parts = key.split(";")
    if len(parts) < 5:
        raise InvalidArgumentError(
            f"Invalid rendezvous key {_quote(key)}: it has {len(parts)} ';'-separated parts, "
            "expected 5: src_device;src_incarnation;dst_device;edge_name;frame_id:iter_id"
        )
    if len(parts) > 5:
        raise InvalidArgumentError(
            f"Invalid rendezvous key {_quote(key)}: it has {len(parts)} ';'-separated parts, "
            "expected 5 (the edge name may not contain ';')"
        )
    src_text, inc_text, dst_text, edge_name, fi_text = parts
    try:
        src = parse_full_name(src_text)
    except InvalidArgumentError as e:
        raise _bad_key(key, 1, _device_problem(src_text, e)) from None
    if _HEX.fullmatch(inc_text) is None:
        if not inc_text:
            raise _bad_key(key, 2, "is empty; expected 16 hex digits")
        if re.fullmatch(r"[0-9a-fA-F]+", inc_text):
            raise _bad_key(key, 2, f"{_quote(inc_text)} has more than 16 hex digits (uint64)")
        raise _bad_key(key, 2, f"{_quote(inc_text)} is not hexadecimal")
    try:
        dst = parse_full_name(dst_text)
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
    return ParsedKey(
        src_device=src_text,
        src_incarnation=int(inc_text, 16),
        dst_device=dst_text,
        edge_name=edge_name,
        frame_iter=(frame_id, iter_id),
        src=src,
        dst=dst,
        full_key=key,
    )


_parse_key_cached = functools.lru_cache(maxsize=_PARSE_CACHE_SIZE)(_parse_key_uncached)


def key_digest(full_key: str) -> bytes:
    """16-byte BLAKE2b digest of the key's UTF-8 text, for naming OS objects after a key.

    Keys are longer than a shm name may be and contain ``/`` and ``;``, so modules that
    name things after keys use this digest. Lone surrogates (which ``parse_key`` refuses)
    are hashed via ``surrogatepass`` rather than raising.
    """
    return hashlib.blake2b(
        full_key.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_SIZE
    ).digest()
