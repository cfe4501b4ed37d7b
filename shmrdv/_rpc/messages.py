"""The RPC messages, built and parsed by hand: TensorFlow's and shmrdv's own.

Pure: no gRPC, no protobuf runtime, no I/O; thread model: none needed. The messages are
those of ``protos/shmrdv/*.proto``; the generated modules in ``shmrdv/_rpc/proto`` are
the reference the tests compare these bytes against:

* ``RecvTensorRequest`` (with shmrdv's extension fields 1001-1004: acks, inline limit,
  cancel, wait) and ``RecvTensorResponse`` (the tensor from ``tensors``);
* ``MarkRecvFinishedRequest`` and ``GetStatusResponse`` (``DeviceAttributes``);
* the replies of shmrdv's Exchange stream (a RecvTensorResponse with extension fields).

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
from typing import Any

import numpy.typing as npt

from .._errors import InvalidArgumentError, ResourceExhaustedError
from .tensors import (
    MAX_MESSAGE_BYTES,
    DecodedTensor,
    TensorAcc,
    as_array,
    tensor_parts,
    tensor_value,
)
from .wire import (
    I64,
    LEN,
    U64,
    VARINT,
    Buffer,
    Malformed,
    Schema,
    as_buffer,
    check_int64,
    encode_tag,
    encode_varint,
    int_field,
    iter_fields,
    len_field,
    read_utf8,
    read_varint,
    signed64,
    validate,
)

__all__ = [
    "DeviceAttributes",
    "LinkReply",
    "MAX_ACKS",
    "RecvRequest",
    "decode_link_reply",
    "decode_mark_recv_finished",
    "decode_request",
    "decode_response",
    "decode_status_response",
    "encode_link_error",
    "encode_link_fetch",
    "encode_link_value",
    "encode_mark_recv_finished",
    "encode_request",
    "encode_response",
    "encode_status_response",
]


_INTERCONNECT_LINK: Schema = {1: (VARINT, None), 2: (LEN, "str"), 3: (VARINT, None)}


_LOCAL_LINKS: Schema = {1: (LEN, _INTERCONNECT_LINK)}


_DEVICE_LOCALITY: Schema = {1: (VARINT, None), 2: (VARINT, None), 3: (LEN, _LOCAL_LINKS)}


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
    prefix = (
        extra
        + int_field(2, int(bool(is_dead)))
        + int_field(3, send_start_micros)
        + int_field(5, int(bool(require_ack)))
        + encode_tag(1, LEN)
        + encode_varint(parts.size)
        + parts.head
    )
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
    cancel: bool = False  # 1003 (Exchange): the client gives request_id up
    wait_ms: int = -1  # 1004 (Exchange): wait at most this long for the value; -1: not given


# Extension fields of RecvTensorRequest, read by shmrdv's RecvTensorInline and Exchange.
_FINISHED_FIELD = 1001


_INLINE_MAX_FIELD = 1002


_CANCEL_FIELD = 1003


_WAIT_MS_FIELD = 1004


def encode_request(
    step_id: int,
    rendezvous_key: str,
    request_id: int,
    dma_ok: bool = False,
    *,
    finished: Sequence[int] = (),
    inline_max: int = -1,
    cancel: bool = False,
    wait_ms: int = -1,
) -> bytes:
    """``RecvTensorRequest`` bytes; ``InvalidArgumentError`` for out-of-range ints.

    ``finished`` (request_ids whose responses arrived: piggybacked acks, as many
    ``MarkRecvFinished``) and ``inline_max`` (answer tensors up to this many bytes in the
    unary response) are shmrdv extension fields 1001 and 1002, for ``RecvTensorInline``.
    """
    check_int64("step_id", step_id)
    check_int64("request_id", request_id)
    ext = b"".join(int_field(_FINISHED_FIELD, check_int64("finished", f)) for f in finished)
    if inline_max >= 0:
        ext += encode_tag(_INLINE_MAX_FIELD, VARINT) + encode_varint(
            check_int64("inline_max", inline_max)
        )
    ext += int_field(_CANCEL_FIELD, int(bool(cancel)))
    if wait_ms >= 0:
        ext += encode_tag(_WAIT_MS_FIELD, VARINT) + encode_varint(check_int64("wait_ms", wait_ms))
    if not isinstance(rendezvous_key, str):
        raise InvalidArgumentError(f"rendezvous_key must be a str, got {rendezvous_key!r}")
    try:
        key = rendezvous_key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"rendezvous_key {rendezvous_key!r} is not UTF-8") from e
    return (
        int_field(1, step_id)
        + (len_field(2, key) if key else b"")
        + int_field(3, int(bool(dma_ok)))
        + int_field(7, request_id)
        + ext
    )


def decode_request(data: Buffer) -> RecvRequest:
    """Parse ``RecvTensorRequest`` bytes; ``InvalidArgumentError`` if they do not parse."""
    buf = as_buffer(data)
    step_id = request_id = 0
    key = ""
    dma_ok = False
    finished: list[int] = []
    inline_max = wait_ms = -1
    cancel = False
    try:
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == VARINT:
                step_id = signed64(f.value)
            elif f.number == 2 and f.wire_type == LEN:
                key = read_utf8(buf, f.value, f.end, "rendezvous_key")
            elif f.number == 3 and f.wire_type == VARINT:
                dma_ok = bool(f.value)
            elif f.number in (4, 5) and f.wire_type == LEN:
                validate(buf, f.value, f.end, _DEVICE_LOCALITY)
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
            elif f.number == _CANCEL_FIELD and f.wire_type == VARINT:
                cancel = bool(f.value)
            elif f.number == _WAIT_MS_FIELD and f.wire_type == VARINT:
                wait_ms = signed64(f.value)
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse RecvTensorRequest: {e}") from e
    return RecvRequest(
        step_id, key, request_id, dma_ok, tuple(finished), inline_max, cancel, wait_ms
    )


#: A request carries at most this many acks; more are ignored (they expire on their own),
#: so a client puts no more on one request.
MAX_ACKS = 1024


def encode_mark_recv_finished(request_id: int) -> bytes:
    """``MarkRecvFinishedRequest`` bytes (the client has the response of ``request_id``)."""
    return int_field(1, check_int64("request_id", request_id))


def decode_mark_recv_finished(data: Buffer) -> int:
    """The ``request_id`` in ``MarkRecvFinishedRequest`` bytes.

    Raises ``InvalidArgumentError`` if they do not parse.
    """
    buf = as_buffer(data)
    request_id = 0
    try:
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == VARINT:
                request_id = signed64(f.value)
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse MarkRecvFinishedRequest: {e}") from e
    return request_id


@dataclass(frozen=True, slots=True)
class DeviceAttributes:
    """TensorFlow's ``DeviceAttributes`` (the fields shmrdv fills; no locality)."""

    name: str
    device_type: str
    memory_limit: int = 0
    incarnation: int = 0  # fixed64 on the wire; TensorFlow: "should never be 0"
    physical_device_desc: str = ""
    xla_global_id: int = -1  # TensorFlow: -1 if unavailable


def _device_bytes(d: DeviceAttributes) -> bytes:
    if not 0 <= d.incarnation <= U64:
        raise InvalidArgumentError(f"incarnation {d.incarnation} is not a uint64")
    check_int64("memory_limit", d.memory_limit)
    check_int64("xla_global_id", d.xla_global_id)
    return b"".join(
        [
            len_field(1, d.name.encode()) if d.name else b"",
            len_field(2, d.device_type.encode()) if d.device_type else b"",
            int_field(4, d.memory_limit),
            encode_tag(6, I64) + d.incarnation.to_bytes(8, "little") if d.incarnation else b"",
            len_field(7, d.physical_device_desc.encode()) if d.physical_device_desc else b"",
            int_field(8, d.xla_global_id),
        ]
    )


def encode_status_response(devices: Sequence[DeviceAttributes]) -> bytes:
    """``GetStatusResponse`` bytes listing ``devices``."""
    return b"".join(len_field(1, _device_bytes(d)) for d in devices)


def decode_status_response(data: Buffer) -> tuple[DeviceAttributes, ...]:
    """Parse ``GetStatusResponse`` bytes; ``InvalidArgumentError`` if they do not parse."""
    buf = as_buffer(data)
    out = []
    try:
        for f in iter_fields(buf, 0, len(buf)):
            if f.number != 1 or f.wire_type != LEN:
                continue
            v: dict[str, Any] = {"name": "", "device_type": "", "xla_global_id": 0}
            for g in iter_fields(buf, f.value, f.end):
                if g.wire_type == LEN and g.number in (1, 2, 7):
                    name = {1: "name", 2: "device_type", 7: "physical_device_desc"}[g.number]
                    v[name] = read_utf8(buf, g.value, g.end, f"DeviceAttributes.{name}")
                elif g.wire_type == VARINT and g.number in (4, 8):
                    v["memory_limit" if g.number == 4 else "xla_global_id"] = signed64(g.value)
                elif g.wire_type == I64 and g.number == 6:
                    v["incarnation"] = g.value
                elif g.wire_type == LEN and g.number == 5:
                    validate(buf, g.value, g.end, _DEVICE_LOCALITY)
            out.append(DeviceAttributes(**v))
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse GetStatusResponse: {e}") from e
    return tuple(out)


# shmrdv's Exchange stream answers each request_id with one RecvTensorResponse that
# carries extension fields (TensorFlow would skip them as unknown fields): the
# request_id it answers, and instead of a tensor either an error (a grpc status code
# number and its message) or "fetch": too large for the stream, fetch it with
# RecvTensorInline under the same request_id (the server keeps it in its cache).
_LINK_REQUEST_ID_FIELD = 1001


_LINK_CODE_FIELD = 1002


_LINK_MESSAGE_FIELD = 1003


_LINK_FETCH_FIELD = 1004


_MAX_ERROR_MESSAGE = 16 << 10


@dataclass(frozen=True, slots=True)
class LinkReply:
    """The extension fields of an Exchange reply; the tensor itself is ``decode_response``."""

    request_id: int
    code: int = 0  # a grpc status code number; 0: a value (or a fetch)
    message: str = ""
    fetch: bool = False


def encode_link_value(
    request_id: int, value: npt.NDArray[Any], *, is_dead: bool, send_start_micros: int = 0
) -> bytes:
    """An Exchange reply carrying ``value`` for ``request_id`` (one copy of the tensor)."""
    return encode_response(
        value,
        is_dead=is_dead,
        send_start_micros=send_start_micros,
        require_ack=True,
        extra=int_field(_LINK_REQUEST_ID_FIELD, check_int64("request_id", request_id)),
    )


def encode_link_error(request_id: int, code: int, message: str) -> bytes:
    """An Exchange reply failing ``request_id`` with grpc status ``code`` (non-zero)."""
    if not 0 < code < 1 << 31:
        raise InvalidArgumentError(f"an error reply needs a non-zero status code, not {code!r}")
    text = message.encode("utf-8", "replace")[:_MAX_ERROR_MESSAGE]
    return (
        int_field(_LINK_REQUEST_ID_FIELD, check_int64("request_id", request_id))
        + int_field(_LINK_CODE_FIELD, code)
        + len_field(_LINK_MESSAGE_FIELD, text)
    )


def encode_link_fetch(request_id: int) -> bytes:
    """An Exchange reply saying: fetch ``request_id`` with RecvTensorInline."""
    return int_field(_LINK_REQUEST_ID_FIELD, check_int64("request_id", request_id)) + int_field(
        _LINK_FETCH_FIELD, 1
    )


def decode_link_reply(data: Buffer) -> LinkReply:
    """The extension fields of an Exchange reply; ``InvalidArgumentError`` if they do not
    parse or name no request_id."""
    buf = as_buffer(data)
    request_id = code = 0
    message = ""
    fetch = False
    try:
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == _LINK_REQUEST_ID_FIELD and f.wire_type == VARINT:
                request_id = signed64(f.value)
            elif f.number == _LINK_CODE_FIELD and f.wire_type == VARINT:
                code = f.value if f.value < 1 << 31 else 2  # out of range: UNKNOWN
            elif f.number == _LINK_MESSAGE_FIELD and f.wire_type == LEN:
                end = min(f.end, f.value + _MAX_ERROR_MESSAGE)
                message = bytes(buf[f.value : end]).decode("utf-8", "replace")
            elif f.number == _LINK_FETCH_FIELD and f.wire_type == VARINT:
                fetch = bool(f.value)
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse an Exchange reply: {e}") from e
    if not request_id:
        raise InvalidArgumentError("Cannot parse an Exchange reply: it names no request_id")
    return LinkReply(request_id, code, message, fetch)
