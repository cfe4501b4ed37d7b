"""Protocol-buffer wire primitives: varints, field tags, length-delimited fields.

Pure functions over buffers, no I/O, no state: the byte formats of
https://protobuf.dev/programming-guides/encoding/ that ``tensors``, ``messages`` and
``stream`` build their messages from (h11's readers/writers split: the formats here, the
meaning of each field there). Thread model (``docs/threads.md``): none needed; everything
is re-entrant.

Encoders return ``bytes`` and raise ``InvalidArgumentError`` for values out of range;
readers raise ``Malformed`` (internal), which the message decoders turn into
``InvalidArgumentError`` at their edge. No declared length is trusted before it is
checked against the bytes present.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from .._errors import InvalidArgumentError

__all__ = [
    "Buffer",
    "EGROUP",
    "Field",
    "I32",
    "I64",
    "LEN",
    "Malformed",
    "SGROUP",
    "Schema",
    "U64",
    "VARINT",
    "as_buffer",
    "check_int64",
    "encode_tag",
    "encode_varint",
    "put_varint",
    "int_field",
    "iter_fields",
    "len_field",
    "read_utf8",
    "read_varint",
    "signed64",
    "validate",
]


# Nesting limit for skipped groups; protobuf's default recursion limit is 100.
_MAX_DEPTH: Final = 64


U64: Final = (1 << 64) - 1


_I64_MIN: Final = -(1 << 63)


_I64_MAX: Final = (1 << 63) - 1


# Wire types (https://protobuf.dev/programming-guides/encoding/).
VARINT: Final = 0


I64: Final = 1


LEN: Final = 2


SGROUP: Final = 3


EGROUP: Final = 4


I32: Final = 5


Buffer = bytes | bytearray | memoryview


class Malformed(Exception):
    """Internal: the bytes do not parse; turned into InvalidArgumentError at the API edge."""


def put_varint(out: bytearray, value: int) -> None:
    """Append the unsigned varint of ``value`` to ``out`` (negative int64 as its 10-byte
    two's complement)."""
    value &= U64
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def encode_varint(value: int) -> bytes:
    """Unsigned varint of ``value`` (``put_varint``'s bytes)."""
    out = bytearray()
    put_varint(out, value)
    return bytes(out)


def encode_tag(field: int, wire_type: int) -> bytes:
    return encode_varint((field << 3) | wire_type)


def len_field(field: int, payload: bytes) -> bytes:
    return encode_tag(field, LEN) + encode_varint(len(payload)) + payload


def int_field(field: int, value: int) -> bytes:
    """A varint field, left out when zero (proto3)."""
    return encode_tag(field, VARINT) + encode_varint(value) if value else b""


def check_int64(name: str, value: int) -> int:
    """``value`` if it is an int64; ``InvalidArgumentError`` naming ``name`` if not."""
    if type(value) is int and _I64_MIN <= value <= _I64_MAX:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if not _I64_MIN <= value <= _I64_MAX:
        raise InvalidArgumentError(f"{name}={value} does not fit in an int64")
    return value


def signed64(value: int) -> int:
    return value - (1 << 64) if value > _I64_MAX else value


def read_varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise Malformed("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & U64, pos
        shift += 7
        if shift >= 70:
            raise Malformed("varint longer than 10 bytes")


@dataclass(slots=True)
class Field:
    number: int
    wire_type: int
    value: int  # varint / fixed value, or the start of a LEN payload
    end: int  # end of a LEN payload (else equal to value)


def _skip_group(buf: Buffer, pos: int, end: int, number: int, depth: int) -> int:
    if depth > _MAX_DEPTH:
        raise Malformed("groups nested too deeply")
    while True:
        tag, pos = read_varint(buf, pos, end)
        wire_type = tag & 7
        if wire_type == EGROUP:
            if tag >> 3 != number:
                raise Malformed("mismatched end-group tag")
            return pos
        pos = _skip_value(buf, pos, end, tag, depth + 1)


def _skip_value(buf: Buffer, pos: int, end: int, tag: int, depth: int) -> int:
    number, wire_type = tag >> 3, tag & 7
    if number == 0 or tag > 0xFFFFFFFF:
        raise Malformed(f"invalid tag {tag}")
    if wire_type == VARINT:
        return read_varint(buf, pos, end)[1]
    if wire_type == I64:
        pos += 8
    elif wire_type == I32:
        pos += 4
    elif wire_type == LEN:
        length, pos = read_varint(buf, pos, end)
        pos += length
    elif wire_type == SGROUP:
        return _skip_group(buf, pos, end, number, depth)
    else:
        raise Malformed(f"invalid wire type {wire_type}")
    if pos > end:
        raise Malformed("field runs past the end of its message")
    return pos


def iter_fields(buf: Buffer, pos: int, end: int) -> Iterator[Field]:
    """The fields of one message in ``buf[pos:end]``; groups are skipped (unknown)."""
    while pos < end:
        tag, pos = read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0 or tag > 0xFFFFFFFF:
            raise Malformed(f"invalid tag {tag}")
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos, end)
            yield Field(number, wire_type, value, pos)
        elif wire_type in (I64, I32):
            size = 8 if wire_type == I64 else 4
            if pos + size > end:
                raise Malformed("truncated fixed-width field")
            value = int.from_bytes(buf[pos : pos + size], "little")
            pos += size
            yield Field(number, wire_type, value, pos)
        elif wire_type == LEN:
            length, pos = read_varint(buf, pos, end)
            if length > end - pos:
                raise Malformed(f"field {number} declares {length} bytes, {end - pos} remain")
            yield Field(number, wire_type, pos, pos + length)
            pos += length
        elif wire_type == SGROUP:
            pos = _skip_group(buf, pos, end, number, 1)
        else:
            raise Malformed(f"invalid wire type {wire_type} (field {number})")


def read_utf8(buf: Buffer, start: int, end: int, what: str) -> str:
    try:
        return bytes(buf[start:end]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise Malformed(f"{what} is not valid UTF-8") from e


# A schema for messages we only validate (field -> (wire type, sub-schema | "str" | None)),
# so that whatever protobuf itself would reject is rejected here too.
Schema = dict[int, tuple[int, Any]]


def validate(buf: Buffer, start: int, end: int, schema: Schema) -> None:
    for f in iter_fields(buf, start, end):
        spec = schema.get(f.number)
        if spec is None or spec[0] != f.wire_type:
            continue  # unknown (or a known field with another wire type): skipped
        if spec[1] == "str":
            read_utf8(buf, f.value, f.end, f"string field {f.number}")
        elif isinstance(spec[1], dict):
            validate(buf, f.value, f.end, spec[1])


def as_buffer(data: object) -> Buffer:
    if isinstance(data, bytes | bytearray):
        return data
    if isinstance(data, memoryview):
        try:
            return data.cast("B")
        except TypeError as e:
            raise InvalidArgumentError("message buffer is not C-contiguous") from e
    raise InvalidArgumentError(f"message must be bytes, got {type(data).__qualname__}")
