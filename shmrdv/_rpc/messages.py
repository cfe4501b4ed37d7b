"""The messages of the gRPC methods, built and parsed by hand: one encoder and one
decoder each, on ``wire``'s TensorProto coding.

* ``RecvTensorRequest`` (``encode_request`` / ``decode_request``), with fields
  TensorFlow skips: 1001 acks, 1002 "chunks welcome", 1003 a series' values held, 1004
  the offset of the chunk wanted, 1005 request_ids given up.
* ``RecvTensorResponse`` (``encode_value`` / ``Assembly``) in TensorFlow's order, the
  array's buffer joined once; beyond ``CHUNK_BYTES``, chunks: the slice at offset 1001
  of a whole of 1002 bytes. In a series, field 1003 without a tensor asks for an ack,
  field 1004 packs the whole responses of several values.
* ``MarkRecvFinishedRequest`` (1001 "released", 1002 held) and ``GetStatusResponse``.

Bad bytes or values raise ``InvalidArgumentError``; a whole response beyond 2 GiB
``ResourceExhaustedError``. Pure functions; no thread model needed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._errors import InvalidArgumentError, ResourceExhaustedError
from .._rendezvous import Received, received
from .._values import as_ndarray
from .wire import (
    DT_STRING,
    I64,
    LEN,
    MAX_DECODED_BYTES,
    VARINT,
    Buffer,
    Malformed,
    TensorHeader,
    adopt,
    as_buffer,
    check_int64,
    check_shape,
    fields,
    int_field,
    len_field,
    put_varint,
    read_tensor,
    read_utf8,
    read_varint,
    signed64,
    tensor_parts,
    tensor_value,
    varint,
    wire_dtype,
)

__all__ = [
    "ASK", "CHUNK_BYTES", "GET_STATUS", "MARK_RECV_FINISHED", "MAX_ACKS", "RECV_TENSOR",
    "RECV_TENSOR_SERIES", "SHMRDV_SERVICE", "TF_SERVICE", "Assembly", "DeviceAttributes",
    "Encoded", "RecvRequest", "decode_finished", "decode_request", "decode_status",
    "encode_finished", "encode_request", "encode_status", "encode_value", "pack", "take_ids",
    "whole_message",
]  # fmt: skip

# TensorFlow registers its methods by hand (GrpcWorkerMethodName); generated stubs would
# say /tensorflow.grpc.WorkerService/... (research/tf_rendezvous.md §3.4).
TF_SERVICE: Final = "tensorflow.WorkerService"
SHMRDV_SERVICE: Final = "shmrdv.Rendezvous"
RECV_TENSOR: Final = f"/{TF_SERVICE}/RecvTensor"
GET_STATUS: Final = f"/{TF_SERVICE}/GetStatus"
MARK_RECV_FINISHED: Final = f"/{TF_SERVICE}/MarkRecvFinished"
RECV_TENSOR_SERIES: Final = f"/{SHMRDV_SERVICE}/RecvTensorSeries"

# research/pitfalls.md §6: move tensors in chunks of at most 4 MiB.
CHUNK_BYTES: Final = 4 << 20
# TensorFlow: kProtoBufLimitBytes; gRPC's largest message is INT32_MAX.
_MAX_MESSAGE_BYTES: Final = (1 << 31) - 1
# From this size on tensor_content starts 8-aligned and a value lives in its message: no
# copy, nor a second buffer for the allocator to give back and fault in again each time.
_ADOPT_BYTES: Final = 1 << 16
#: A request carries at most this many acks; more are ignored (they expire).
MAX_ACKS: Final = 1024

# -- RecvTensorRequest --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecvRequest:
    """A decoded ``RecvTensorRequest`` (dma_ok, localities and transport options are dropped)."""

    step_id: int
    rendezvous_key: str
    request_id: int
    finished: tuple[int, ...] = ()  # 1001: acks
    chunks: bool = False  # 1002: a shmrdv client, which takes large tensors in chunks
    held: int = 0  # 1003: RecvTensorSeries: values of the series the consumer holds
    offset: int = 0  # 1004: the chunk at this byte offset of the value of request_id
    released: tuple[int, ...] = ()  # 1005: request_ids given up (their values go back)


def take_ids(queue: deque[int]) -> list[int]:
    """At most ``MAX_ACKS`` request_ids off ``queue`` (appended to by other threads), for
    one request."""
    out: list[int] = []
    try:
        while queue and len(out) < MAX_ACKS:
            out.append(queue.popleft())
    except IndexError:  # taken by another request meanwhile
        pass
    return out


def encode_request(
    step_id: int, rendezvous_key: str, request_id: int, *, finished: Sequence[int] = (),
    chunks: bool = True, held: int = 0, offset: int = 0, released: Sequence[int] = (),
) -> bytes:  # fmt: skip
    """``RecvTensorRequest`` bytes; ``InvalidArgumentError`` for what the wire cannot carry."""
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
        out.append(0x08)
        put_varint(out, step_id)
    if key:
        out.append(0x12)
        put_varint(out, len(key))
        out += key
    if request_id:
        out.append(0x38)
        put_varint(out, request_id)
    for rid in finished[:MAX_ACKS]:
        out += b"\xc8\x3e"  # 1001, varint
        put_varint(out, check_int64("finished", rid))
    if chunks:
        out += b"\xd0\x3e\x01"  # 1002: true
    if held:
        out += b"\xd8\x3e"
        put_varint(out, check_int64("held", held))
    if offset:
        out += b"\xe0\x3e"
        put_varint(out, check_int64("offset", offset))
    for rid in released[:MAX_ACKS]:
        out += b"\xe8\x3e"  # 1005, varint
        put_varint(out, check_int64("released", rid))
    return bytes(out)


# What protobuf itself would reject in the fields a request only carries through: strings
# must be UTF-8 (DeviceLocality's links, Any's type_url).
_UTF8_FIELDS: Final[dict[int, dict[int, Any]]] = {
    4: {3: {1: {2: None}}},
    5: {3: {1: {2: None}}},
    6: {1: None},
}


def _validate(buf: Buffer, start: int, end: int, strings: dict[int, Any]) -> None:
    for number, wire_type, value, stop in fields(buf, start, end):
        if wire_type == LEN and number in strings:
            inner = strings[number]
            if inner is None:
                read_utf8(buf, value, stop, f"string field {number}")
            else:
                _validate(buf, value, stop, inner)


def decode_request(data: Buffer) -> RecvRequest:
    """Parse ``RecvTensorRequest`` bytes; ``InvalidArgumentError`` if they do not parse."""
    buf = as_buffer(data)
    step_id = request_id = held = offset = 0
    key = ""
    chunks = False
    finished: list[int] = []
    released: list[int] = []
    try:
        for number, wire_type, value, stop in fields(buf, 0, len(buf)):
            if wire_type == VARINT:
                if number == 1:
                    step_id = signed64(value)
                elif number == 7:
                    request_id = signed64(value)
                elif number == 1001:
                    if len(finished) < MAX_ACKS:
                        finished.append(signed64(value))
                elif number == 1002:
                    chunks = bool(value)
                elif number == 1003:
                    held = signed64(value)
                elif number == 1004:
                    offset = signed64(value)
                elif number == 1005 and len(released) < MAX_ACKS:
                    released.append(signed64(value))
            elif wire_type == LEN:
                if number == 2:
                    key = read_utf8(buf, value, stop, "rendezvous_key")
                elif number in (1001, 1005):  # packed, as protobuf writes repeated int64
                    ids = finished if number == 1001 else released
                    pos = value
                    while pos < stop:
                        rid, pos = read_varint(buf, pos, stop)
                        if len(ids) < MAX_ACKS:
                            ids.append(signed64(rid))
                elif number in _UTF8_FIELDS:
                    _validate(buf, value, stop, _UTF8_FIELDS[number])
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse RecvTensorRequest: {e}") from e
    acks, gone = tuple(finished), tuple(released)
    return RecvRequest(step_id, key, request_id, acks, chunks, held, max(offset, 0), gone)


# -- RecvTensorResponse -------------------------------------------------------------------


class Encoded:
    """A value as the responses that carry it (encoded once, at ``send``): one whole
    ``RecvTensorResponse``, or its chunks. ``nbytes`` is the value's size."""

    __slots__ = ("chunks", "nbytes", "step")

    def __init__(self, chunks: tuple[bytes, ...], nbytes: int, step: int) -> None:
        self.chunks = chunks
        self.nbytes = nbytes
        self.step = step  # the content bytes of a chunk

    def chunk_at(self, offset: int) -> bytes | None:
        """The chunk whose content starts at ``offset`` (None: there is none)."""
        index, rest = divmod(offset, self.step)
        if rest or not 0 <= index < len(self.chunks):
            return None
        return self.chunks[index]


def encode_value(
    value: npt.NDArray[Any], is_dead: bool, *, chunk_bytes: int = CHUNK_BYTES,
    send_start_micros: int | None = None,
) -> Encoded:  # fmt: skip
    """``value`` as its ``RecvTensorResponse`` bytes (the one copy of its buffer): whole up
    to ``chunk_bytes`` of content, else chunks of that many; ``send_start_micros`` (for
    TensorFlow's timelines only) is now unless given. ``InvalidArgumentError`` for a value
    that cannot be sent."""
    arr = as_ndarray(value, "encode")
    if send_start_micros is None:
        send_start_micros = time.time_ns() // 1000
    head, content, tail = tensor_parts(arr)
    prefix = bytearray(b"\x10\x01" if is_dead else b"")
    if send_start_micros:
        prefix.append(0x18)
        put_varint(prefix, check_int64("send_start_micros", send_start_micros))
    prefix += b"\x28\x01"  # require_ack: the response is cached until MarkRecvFinished
    total = len(content)
    if total <= chunk_bytes:
        size = len(head) + total + len(tail)
        length = varint(size)
        if total >= _ADOPT_BYTES:  # require_ack's 1, written long, 8-aligns tensor_content
            pad = -(len(prefix) + 1 + len(length) + len(head)) % 8  # (protobuf takes it)
            prefix[-1:] = b"\x81" + b"\x80" * (pad - 1) + b"\x00" if pad else b"\x01"
        whole = b"".join([prefix, b"\x0a", length, head, content, tail])
        return Encoded((whole,), arr.nbytes, chunk_bytes)
    cut = head.rindex(b"\x22" + varint(total))  # the content's tag and length end the head
    fixed = head[:cut]
    chunks = []
    for offset in range(0, total, chunk_bytes):
        piece = content[offset : offset + chunk_bytes]
        tensor = fixed + b"\x22" + varint(len(piece))
        ext = (b"\xc8\x3e" + varint(offset) if offset else b"") + b"\xd0\x3e" + varint(total)
        size = len(tensor) + len(piece) + len(tail)
        chunks.append(b"".join([prefix, ext, b"\x0a", varint(size), tensor, piece, tail]))
    return Encoded(tuple(chunks), arr.nbytes, chunk_bytes)


#: A series' message that asks the consumer to acknowledge what it holds (1003: true).
ASK: Final = b"\xd8\x3e\x01"


def pack(responses: Sequence[bytes]) -> bytes:
    """A series' one message for several values: their whole responses in field 1004."""
    parts: list[bytes] = []
    for r in responses:
        parts += (b"\xe2\x3e", varint(len(r)), r)
    return b"".join(parts)


def whole_message(encoded: Encoded) -> bytes:
    """One ``RecvTensorResponse`` of an encoded value (for a client that takes no chunks,
    TensorFlow's); ``ResourceExhaustedError`` beyond protobuf's 2 GiB ceiling."""
    if len(encoded.chunks) == 1:
        return encoded.chunks[0]
    if encoded.nbytes + (1 << 20) > _MAX_MESSAGE_BYTES:
        raise ResourceExhaustedError(
            f"cannot send a tensor of {encoded.nbytes} bytes in one RecvTensor response: "
            "beyond the 2 GiB protobuf limit (TensorFlow: kProtoBufLimitBytes)"
        )
    assembly = Assembly()
    for chunk in encoded.chunks:
        got = assembly.feed(chunk)
    assert got is not None
    return encode_value(got.value, got.is_dead, chunk_bytes=_MAX_MESSAGE_BYTES).chunks[0]


class Assembly:
    """Reads the ``RecvTensorResponse`` messages of one value into a ``Received``.

    ``feed`` each message (chunks in any order): the value once complete (a private,
    writable array), else None. A chunked value's buffer is allocated at its first chunk,
    once its size is checked against its dtype, shape and this host's memory. ``ask``:
    the last message asked for an ack; ``packed``: the responses it packed. One feeder.
    """

    __slots__ = (
        "_buffer", "_got", "_have", "_head", "_is_dead", "_step", "_total", "ask", "packed",
    )  # fmt: skip

    def __init__(self) -> None:
        self._buffer: npt.NDArray[np.uint8] | None = None
        self._head = TensorHeader()
        self._is_dead = False
        self._total = self._step = self._have = 0
        self._got: set[int] = set()
        self.ask = False
        self.packed: list[memoryview] = []

    @property
    def missing(self) -> list[int]:
        """Offsets of the chunks not fed yet (after the first)."""
        if self._buffer is None:
            return []
        return [o for o in range(0, self._total, self._step) if o not in self._got]

    def feed(self, data: Buffer, *, owned: bool = False) -> Received | None:
        """``owned``: ``data`` is a message nobody reads again (fresh from grpcio)."""
        buf = as_buffer(data)
        try:
            return self._feed(buf, owned)
        except Malformed as e:
            raise InvalidArgumentError(f"Cannot parse tensor from response: {e}") from e

    def _feed(self, buf: Buffer, owned: bool) -> Received | None:
        head = TensorHeader()
        is_dead = ask = False
        offset, total, tensor = 0, -1, False
        packed = []
        for number, wire_type, value, stop in fields(buf, 0, len(buf)):
            if wire_type == LEN and number == 1:
                read_tensor(buf, value, stop, head)
                tensor = True
            elif wire_type == VARINT:
                if number == 2:
                    is_dead = bool(value)
                elif number == 1001:
                    offset = value
                elif number == 1002:
                    total = value
                elif number == 1003:
                    ask = bool(value)
            elif wire_type == LEN and number == 1004:
                packed.append((value, stop))
            elif wire_type == LEN and number == 4:
                _validate(buf, value, stop, {1: None})  # transport_options: an Any
        self.ask = ask and not tensor
        if self.ask:
            return None
        if packed and not tensor:
            self.packed = [memoryview(buf)[start:end] for start, end in packed]
            return None
        start, end = head.content
        if total < 0 and self._buffer is None:  # a whole value: the usual case
            view = adopt(buf, start, end) if owned and end - start >= _ADOPT_BYTES else None
            content = memoryview(buf)[start:end] if view is None else view
            array = tensor_value(head, content, is_dead, copy=view is None)
            if not array.flags.aligned:  # adopted, from a sender that did not align it
                array = array.copy()
            return received(array, is_dead)
        return self._chunk(head, is_dead, offset, total, buf, start, end)

    def _chunk(
        self, head: TensorHeader, is_dead: bool, offset: int, total: int, buf: Buffer,
        start: int, end: int,
    ) -> Received | None:  # fmt: skip
        size = end - start
        if self._buffer is None:
            if offset or not 0 < size < total:
                raise Malformed(f"the first chunk is {size} of {total} bytes at {offset}")
            if total > MAX_DECODED_BYTES:
                raise Malformed(f"a tensor of {total} bytes exceeds this host's memory")
            self._check_size(head, total)
            try:
                self._buffer = np.empty(total, np.uint8)
            except MemoryError as e:
                raise ResourceExhaustedError(f"cannot allocate {total} bytes for a tensor") from e
            self._head, self._is_dead, self._total, self._step = head, is_dead, total, size
        elif (
            total != self._total
            or head.code != self._head.code
            or head.dims != self._head.dims
            or head.ext != self._head.ext
            or offset in self._got
            or offset % self._step
            or size != min(self._step, total - offset)
        ):
            raise Malformed(f"a chunk of {size} bytes at {offset} does not fit the tensor")
        self._buffer[offset : offset + size] = np.frombuffer(buf, np.uint8, size, start)
        self._got.add(offset)
        self._have += size
        if self._have < self._total:
            return None
        array = tensor_value(self._head, self._buffer.data, self._is_dead, copy=False)
        return received(array, self._is_dead)

    @staticmethod
    def _check_size(head: TensorHeader, total: int) -> None:
        """A chunked tensor's declared whole must be what its dtype and shape need."""
        dtype = head.dtype()
        shape = head.shape()
        check_shape(shape, dtype)
        if head.code != DT_STRING:
            count = 1
            for d in shape:
                count *= d
            if count * wire_dtype(dtype).itemsize != total:
                raise Malformed(f"a {dtype} tensor of shape {shape} is not {total} bytes")


# -- MarkRecvFinishedRequest --------------------------------------------------------------


def encode_finished(request_id: int, *, released: bool = False, held: int = 0) -> bytes:
    """``MarkRecvFinishedRequest`` bytes: ``request_id``'s response arrived; ``released``:
    it was given up without its value; ``held``: of series ``request_id``, the consumer
    holds this many values."""
    out = int_field(1, check_int64("request_id", request_id)) + int_field(1001, int(released))
    return out + int_field(1002, check_int64("held", held))


def decode_finished(data: Buffer) -> tuple[int, bool, int]:
    """(request_id, released, held) of ``MarkRecvFinishedRequest`` bytes."""
    buf = as_buffer(data)
    request_id = held = 0
    released = False
    try:
        for number, wire_type, value, _ in fields(buf, 0, len(buf)):
            if wire_type == VARINT:
                if number == 1:
                    request_id = signed64(value)
                elif number == 1001:
                    released = bool(value)
                elif number == 1002:
                    held = signed64(value)
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse MarkRecvFinishedRequest: {e}") from e
    return request_id, released, held


# -- GetStatusResponse --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceAttributes:
    """TensorFlow's ``DeviceAttributes`` (the fields shmrdv fills; no locality)."""

    name: str
    device_type: str
    memory_limit: int = 0
    incarnation: int = 0  # fixed64; TensorFlow: "should never be 0"
    physical_device_desc: str = ""
    xla_global_id: int = -1  # TensorFlow: -1 if unavailable


def encode_status(devices: Sequence[DeviceAttributes]) -> bytes:
    """``GetStatusResponse`` bytes listing ``devices``."""
    out = []
    for d in devices:
        if not 0 <= d.incarnation < 1 << 64:
            raise InvalidArgumentError(f"incarnation {d.incarnation} is not a uint64")
        inc = b"\x31" + d.incarnation.to_bytes(8, "little") if d.incarnation else b""
        body = b"".join(
            [
                len_field(1, d.name.encode()) if d.name else b"",
                len_field(2, d.device_type.encode()) if d.device_type else b"",
                int_field(4, check_int64("memory_limit", d.memory_limit)),
                inc,
                len_field(7, d.physical_device_desc.encode()) if d.physical_device_desc else b"",
                int_field(8, check_int64("xla_global_id", d.xla_global_id)),
            ]
        )
        out.append(len_field(1, body))
    return b"".join(out)


_DEVICE_STRINGS: Final = {1: "name", 2: "device_type", 7: "physical_device_desc"}
# DeviceLocality: its links' type names are strings.
_LOCALITY: Final = {3: {1: {2: None}}}


def decode_status(data: Buffer) -> tuple[DeviceAttributes, ...]:
    """Parse ``GetStatusResponse`` bytes; ``InvalidArgumentError`` if they do not parse."""
    buf = as_buffer(data)
    out = []
    try:
        for number, wire_type, start, end in fields(buf, 0, len(buf)):
            if number != 1 or wire_type != LEN:
                continue
            v: dict[str, Any] = {"name": "", "device_type": "", "xla_global_id": 0}
            for n, w, value, stop in fields(buf, start, end):
                if w == LEN and n in _DEVICE_STRINGS:
                    name = _DEVICE_STRINGS[n]
                    v[name] = read_utf8(buf, value, stop, f"DeviceAttributes.{name}")
                elif w == VARINT and n in (4, 8):
                    v["memory_limit" if n == 4 else "xla_global_id"] = signed64(value)
                elif w == I64 and n == 6:
                    v["incarnation"] = value
                elif w == LEN and n == 5:
                    _validate(buf, value, stop, _LOCALITY)
            out.append(DeviceAttributes(**v))
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse GetStatusResponse: {e}") from e
    return tuple(out)
