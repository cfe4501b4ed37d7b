"""RecvTensor's messages, built and parsed by hand: ``RecvTensorRequest`` (with shmrdv's
extension fields 1001-1003: acks, inline limit, a series' held count) and
``RecvTensorResponse`` (the tensor from ``tensors``); ``MarkRecvFinishedRequest`` is
``mark_finished``', ``GetStatusResponse`` ``status``'. Pure: no gRPC, no protobuf
runtime, no I/O; thread model: none needed. The generated modules of
``protos/shmrdv/*.proto`` in ``shmrdv/_rpc/proto`` are the reference the tests compare
these bytes against.

A receive's two messages (its request out, a response of the usual layout in) are
written and read in one pass each, with ``wire``'s varint primitives only; a server reads
the usual request in one pass too; everything else builds on ``wire``'s fields.

A response is written as TensorFlow's worker writes it (the small fields first, then
the tensor, whose content is the array's own buffer appended with one copy), so the
bytes equal the generated classes' ``SerializeToString`` up to the position of field 1;
both parse to the same message.

Errors: bytes that do not parse, or that describe an impossible tensor, raise
``InvalidArgumentError`` (TensorFlow: ``InvalidArgument("Cannot parse tensor from
response")``); values that cannot be sent raise ``InvalidArgumentError``; a response
beyond protobuf's 2 GiB ceiling raises ``ResourceExhaustedError``. Nothing else escapes
the decoders, whatever the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import InvalidArgumentError, ResourceExhaustedError
from .._rendezvous import Received, received
from .status import DEVICE_LOCALITY
from .tensors import (
    MAX_MESSAGE_BYTES,
    DecodedTensor,
    TensorAcc,
    as_array,
    tensor_parts,
    tensor_value,
)
from .tf_dtypes import PLAIN_OF_TF
from .wire import (
    LEN,
    VARINT,
    Buffer,
    Malformed,
    Schema,
    as_buffer,
    check_int64,
    encode_tag,
    iter_fields,
    put_varint,
    read_utf8,
    read_varint,
    signed64,
    validate,
)

__all__ = [
    "MAX_ACKS",
    "RecvRequest",
    "decode_received",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
]


_ANY: Schema = {1: (LEN, "str"), 2: (LEN, None)}


def encode_response(
    value: npt.NDArray[Any],
    *,
    is_dead: bool,
    send_start_micros: int = 0,
    require_ack: bool = False,
    extra: bytes = b"",
) -> bytes:
    """``RecvTensorResponse`` bytes for ``value``, as TensorFlow's worker sends them.

    ``extra``: encoded extension fields to put first (``encode_link_value``).

    One copy of the tensor buffer (the final join). Raises ``InvalidArgumentError`` for
    a value that cannot be sent and ``ResourceExhaustedError`` if the message would
    exceed protobuf's 2 GiB limit (use ``encode_stream`` for that).
    """
    arr = as_array(value)
    check_int64("send_start_micros", send_start_micros)
    parts = tensor_parts(arr)
    # TensorFlow writes fields 2, 3, 5 first ("A" in EncodeTensorToByteBuffer), then
    # field 1, so that the tensor bytes end the message.
    prefix = bytearray(extra)
    if is_dead:
        prefix += b"\x10\x01"  # field 2: true
    if send_start_micros:
        prefix.append(0x18)  # field 3, varint
        put_varint(prefix, send_start_micros)
    if require_ack:
        prefix += b"\x28\x01"  # field 5: true
    prefix.append(0x0A)  # field 1, length-delimited: the tensor
    put_varint(prefix, parts.size)
    prefix += parts.head
    total = len(prefix) + len(parts.content) + len(parts.tail)
    if total > MAX_MESSAGE_BYTES:
        raise ResourceExhaustedError(
            f"cannot encode a {arr.dtype} tensor of shape {arr.shape} in one RecvTensor "
            f"response: {total} bytes exceed the 2 GiB protobuf limit (TensorFlow: "
            "kProtoBufLimitBytes); use the streaming RecvTensorStream"
        )
    return b"".join([prefix, parts.content, parts.tail])


def decode_response(data: Buffer) -> DecodedTensor:
    """Parse ``RecvTensorResponse`` bytes (fields in any order, unknown fields skipped).

    Raises ``InvalidArgumentError`` ("Cannot parse tensor from response: ...") for bytes
    that do not parse or describe an impossible tensor, and for the typed ``*_val``
    representations (TensorFlow's RecvTensor never sends them).
    """
    buf = as_buffer(data)
    try:
        acc = TensorAcc()
        is_dead = require_ack = False
        send_start_micros = 0
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == LEN:
                acc.add_tensor(buf, f.value, f.end)
            elif f.number == 2 and f.wire_type == VARINT:
                is_dead = bool(f.value)
            elif f.number == 3 and f.wire_type == VARINT:
                send_start_micros = signed64(f.value)
            elif f.number == 4 and f.wire_type == LEN:
                validate(buf, f.value, f.end, _ANY)
            elif f.number == 5 and f.wire_type == VARINT:
                require_ack = bool(f.value)
        value = tensor_value(buf, acc, is_dead)
    except (Malformed, InvalidArgumentError) as e:
        raise InvalidArgumentError(f"Cannot parse tensor from response: {e}") from e
    return DecodedTensor(value, is_dead, send_start_micros, require_ack)


def decode_received(data: bytes) -> Received:
    """What a receive returns for ``RecvTensorResponse`` bytes: the value as a private,
    writable array (the one copy of its bytes) and its ``is_dead`` flag.

    A response laid out as shmrdv's and TensorFlow's servers write it (the small fields,
    then the tensor: a plain dtype, a shape of sizes >= 1, its ``tensor_content`` last)
    is read in one pass here; any other goes through ``decode_response`` (and its
    errors).
    """
    plain = _plain_response(data)
    if plain is not None:
        return plain
    decoded = decode_response(data)
    return received(np.array(decoded.value, copy=True), decoded.is_dead)


def _plain_response(b: bytes) -> Received | None:
    """``decode_received`` of the usual layout, or None (anything else). What it accepts
    the element-count rule accepts too: every size >= 1 and ``count * itemsize`` equal to
    a content under 2 GiB keep the count far below ``_values.MAX_ELEMENTS``."""
    try:
        n = len(b)
        pos = 0
        is_dead = False
        while b[pos] != 0x0A:  # fields 2, 3, 5 (varints) come before the tensor
            tag = b[pos]
            if tag not in (0x10, 0x18, 0x28):
                return None
            v = b[pos + 1]
            pos += 2
            if v >= 0x80:
                v, pos = read_varint(b, pos - 1, n)
            if tag == 0x10:
                is_dead = v != 0
        size = b[pos + 1]
        pos += 2
        if size >= 0x80:
            size, pos = read_varint(b, pos - 1, n)
        if pos + size != n or b[pos] != 0x08 or b[pos + 1] >= 0x80:  # the tensor ends it
            return None
        dtype = PLAIN_OF_TF.get(b[pos + 1])
        pos += 2
        if dtype is None:
            return None
        shape: list[int] = []
        if b[pos] == 0x12:  # tensor_shape: dims of one size field each
            if b[pos + 1] >= 0x80:
                return None
            end = pos + 2 + b[pos + 1]
            pos += 2
            while pos < end:
                if b[pos] != 0x12 or b[pos + 1] >= 0x80 or b[pos + 2] != 0x08:
                    return None
                dim_end = pos + 2 + b[pos + 1]
                dim, pos = read_varint(b, pos + 3, dim_end)
                if pos != dim_end or not 1 <= dim <= _I64_MAX:
                    return None
                shape.append(dim)
            if pos != end or len(shape) > _MAX_PLAIN_DIMS:
                return None
        if b[pos] != 0x22:
            return None
        size, pos = read_varint(b, pos + 1, n)
        count = prod(shape)
        if pos + size != n or count * dtype.itemsize != size:
            return None
    except (IndexError, Malformed):
        return None
    # The one copy: the response bytes into a private, writable array.
    return received(np.frombuffer(b, dtype, count, pos).reshape(shape).copy(), is_dead)


_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1
_MAX_PLAIN_DIMS = 32  # numpy allows 64; more go through decode_response


@dataclass(frozen=True, slots=True)
class RecvRequest:
    """A decoded ``RecvTensorRequest`` (localities and transport options are dropped)."""

    step_id: int
    rendezvous_key: str
    request_id: int
    dma_ok: bool = False
    # shmrdv's extension fields (TensorFlow skips them as unknown fields):
    finished: tuple[int, ...] = ()  # 1001: request_ids whose responses arrived (acks)
    inline_max: int = -1  # 1002: largest tensor to answer inline; -1: not given
    held: int = 0  # 1003: RecvTensorSeries: values of the series the consumer holds


# Extension fields of RecvTensorRequest (TensorFlow skips them as unknown fields).
_FINISHED_FIELD = 1001
_INLINE_MAX_FIELD = 1002
_HELD_FIELD = 1003
_FINISHED_TAG = encode_tag(_FINISHED_FIELD, VARINT)
_INLINE_MAX_TAG = encode_tag(_INLINE_MAX_FIELD, VARINT)
_HELD_TAG = encode_tag(_HELD_FIELD, VARINT)


def encode_request(
    step_id: int,
    rendezvous_key: str,
    request_id: int,
    dma_ok: bool = False,
    *,
    finished: Sequence[int] = (),
    inline_max: int = -1,
    held: int = 0,
) -> bytes:
    """``RecvTensorRequest`` bytes; ``InvalidArgumentError`` for out-of-range ints.

    ``finished`` (request_ids whose responses arrived: piggybacked acks, as many
    ``MarkRecvFinished``) and ``inline_max`` (answer tensors up to this many bytes in the
    unary response; a larger one is answered with empty bytes: "stream it") are shmrdv
    extension fields 1001 and 1002; ``held`` (a ``RecvTensorSeries`` re-opened or
    acknowledged under its ``request_id``: how many of its values the consumer holds)
    is field 1003.
    """
    step_id = check_int64("step_id", step_id)
    request_id = check_int64("request_id", request_id)
    if not isinstance(rendezvous_key, str):
        raise InvalidArgumentError(f"rendezvous_key must be a str, got {rendezvous_key!r}")
    try:
        key = rendezvous_key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"rendezvous_key {rendezvous_key!r} is not UTF-8") from e
    out = bytearray()
    if step_id:
        out.append(0x08)  # field 1, varint
        put_varint(out, step_id)
    if key:
        out.append(0x12)  # field 2, length-delimited
        put_varint(out, len(key))
        out += key
    if dma_ok:
        out += b"\x18\x01"  # field 3: true
    if request_id:
        out.append(0x38)  # field 7, varint
        put_varint(out, request_id)
    for f in finished:
        out += _FINISHED_TAG
        put_varint(out, check_int64("finished", f))
    if inline_max >= 0:
        out += _INLINE_MAX_TAG
        put_varint(out, check_int64("inline_max", inline_max))
    if held:
        out += _HELD_TAG
        put_varint(out, check_int64("held", held))
    return bytes(out)


def decode_request(data: Buffer) -> RecvRequest:
    """Parse ``RecvTensorRequest`` bytes; ``InvalidArgumentError`` if they do not parse."""
    if type(data) is bytes:
        plain = _plain_request(data)
        if plain is not None:
            return plain
    buf = as_buffer(data)
    step_id = request_id = 0
    key = ""
    dma_ok = False
    finished: list[int] = []
    inline_max = -1
    held = 0
    try:
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == VARINT:
                step_id = signed64(f.value)
            elif f.number == 2 and f.wire_type == LEN:
                key = read_utf8(buf, f.value, f.end, "rendezvous_key")
            elif f.number == 3 and f.wire_type == VARINT:
                dma_ok = bool(f.value)
            elif f.number in (4, 5) and f.wire_type == LEN:
                validate(buf, f.value, f.end, DEVICE_LOCALITY)
            elif f.number == 6 and f.wire_type == LEN:
                validate(buf, f.value, f.end, _ANY)
            elif f.number == 7 and f.wire_type == VARINT:
                request_id = signed64(f.value)
            elif f.number == _FINISHED_FIELD and f.wire_type == VARINT:
                if len(finished) < MAX_ACKS:
                    finished.append(signed64(f.value))
            elif f.number == _FINISHED_FIELD and f.wire_type == LEN:
                # Packed, as a standard protobuf encoder writes a repeated int64.
                pos = f.value
                while pos < f.end:
                    v, pos = read_varint(buf, pos, f.end)
                    if len(finished) < MAX_ACKS:
                        finished.append(signed64(v))
            elif f.number == _INLINE_MAX_FIELD and f.wire_type == VARINT:
                inline_max = signed64(f.value)
            elif f.number == _HELD_FIELD and f.wire_type == VARINT:
                held = signed64(f.value)
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse RecvTensorRequest: {e}") from e
    return RecvRequest(step_id, key, request_id, dma_ok, tuple(finished), inline_max, held)


def _plain_request(b: bytes) -> RecvRequest | None:
    """``decode_request`` of a request of the key (field 2) and varint fields 1, 3, 7,
    1001, 1002 and 1003 only, in any order (as ``encode_request`` and TensorFlow write them),
    in one pass; None: anything else, read the general way (which names a problem)."""
    n = len(b)
    pos = step_id = request_id = 0
    key = ""
    dma_ok = False
    finished: list[int] = []
    inline_max = -1
    held = 0
    try:
        while pos < n:
            tag = b[pos]
            if tag == 0x12:  # the key
                size, pos = read_varint(b, pos + 1, n)
                if pos + size > n:
                    return None
                key = b[pos : pos + size].decode("utf-8")
                pos += size
                continue
            if tag in (0xC8, 0xD0, 0xD8) and b[pos + 1] == 0x3E:  # 1001-1003 (two-byte tags)
                pos += 2
            elif tag in (0x08, 0x18, 0x38):
                pos += 1
            else:
                return None
            v, pos = read_varint(b, pos, n)
            if v > _I64_MAX:
                v -= 1 << 64
            if tag == 0x08:
                step_id = v
            elif tag == 0x38:
                request_id = v
            elif tag == 0x18:
                dma_ok = v != 0
            elif tag == 0xD0:
                inline_max = v
            elif tag == 0xD8:
                held = v
            elif len(finished) < MAX_ACKS:
                finished.append(v)
    except (IndexError, Malformed, UnicodeDecodeError):
        return None
    return RecvRequest(step_id, key, request_id, dma_ok, tuple(finished), inline_max, held)


#: A request carries at most this many acks; more are ignored (they expire on their own),
#: so a client puts no more on one request.
MAX_ACKS = 1024
