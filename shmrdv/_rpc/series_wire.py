"""The messages of ``RecvTensorSeries``: whole ``TensorChunk``s of one or more values.

Pure: no gRPC, no I/O; thread model: none needed. A series message is
``TensorChunks`` (protos/shmrdv/rendezvous.proto): ``repeated TensorChunk chunks = 1``,
the chunks of ``RecvTensorStream`` (``assembly``) in order, each value's chunks back to
back. The producer packs what it already has into one message up to about
``budget`` bytes, so a queue of small values costs one gRPC write, not one each; a value
larger than ``budget`` is cut into chunks of at most ``budget`` bytes of data, one
message each. One copy of the data: the buffer into the message; none for a value
``packed_copy`` made (the producer's copy at ``send`` is then the message itself). A
value that fits one message is framed once per dtype and shape (``_lone``), not cut by
``chunk_pieces``.

``ASK``: a message of no chunks and shmrdv's extension field 1001 (true), by which the
producer of a series asks its consumer to acknowledge the values it holds
(``RecvTensorSeriesAck``); protobuf reads it as an empty ``TensorChunks``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import InvalidArgumentError, RendezvousError
from .._rendezvous import Received
from .assembly import chunk_pieces, whole_prefix
from .tf_dtypes import wire_dtype
from .wire import LEN, VARINT, Buffer, Malformed, as_buffer, encode_tag, encode_varint, iter_fields

__all__ = ["ASK", "encode_series", "packed_copy", "series_chunks"]

_CHUNKS = encode_tag(1, LEN)
#: The message that asks the consumer for an ack (module docstring); no series message
#: that carries a chunk equals it (those begin with field 1).
ASK = encode_tag(1001, VARINT) + b"\x01"


def encode_series(values: Sequence[Received], budget: int) -> Iterator[tuple[bytes, int]]:
    """``values`` as series messages: (message, how many of ``values`` it completes).

    Each message is made when it is asked for (a large value is never copied whole
    ahead of its writing). Raises ``InvalidArgumentError`` for a value that cannot be
    sent, at the call, before any message.
    """
    if len(values) == 1:
        whole = _packed_message(values[0], budget)
        if whole is not None:
            return iter([(whole, 1)])
    # A packed value's message is already its chunk, framed: it is joined as it is; a
    # plain value that fits one chunk is its framing and its buffer (``_lone``).
    pieces: list[_Piece] = []
    for received in values:
        whole = _packed_message(received, budget)
        if whole is None:
            lone = _lone(received, budget)
            pieces.append(
                lone
                if lone is not None
                else chunk_pieces(received.value, is_dead=received.is_dead, chunk_bytes=budget)
            )
        else:
            pieces.append(whole)
    return _messages(pieces, budget)


def packed_copy(value: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
    """A read-only copy of ``value`` (a live one) made as the series message that carries
    it alone: its buffer is the tail of that message's ``bytes``, which ``encode_series``
    then sends as they are. One copy, as ``np.array(value)``, and none when it is sent.
    None where the array's memory is not its wire form (a dtype converted on the wire)
    or it is empty: copy it as usual."""
    dtype = value.dtype
    nbytes = value.nbytes
    if nbytes == 0 or dtype.kind not in "biufc" or dtype != wire_dtype(dtype):
        return None
    try:
        head = _lone_head(dtype, value.shape, nbytes)
    except (RendezvousError, ValueError):
        return None
    data: Any = value if value.flags.c_contiguous else np.ascontiguousarray(value)
    message = b"".join([head, memoryview(data)])  # (numpy's stubs declare no buffer)
    flat = np.frombuffer(message, dtype, value.size, len(head))
    out: npt.NDArray[Any] = flat.reshape(value.shape)
    key = id(out)
    # Known by the array's identity while it lives: no pointer or byte compared to send it.
    _PACKED[key] = (weakref.ref(out, lambda _: _PACKED.pop(key, None)), message)
    return out


# The messages ``packed_copy`` made, by the id of the array it returned; an entry goes
# when its array does (its weakref's callback runs before the id can be reused).
_PACKED: dict[int, tuple[weakref.ref[npt.NDArray[Any]], bytes]] = {}


@functools.lru_cache(maxsize=256)
def _lone_head(dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int) -> bytes:
    """What comes before the data of a value of ``dtype`` and ``shape`` (``nbytes`` of
    data) in the series message that carries it alone, in one chunk."""
    prefix = whole_prefix(dtype, shape, nbytes)
    return b"".join([_CHUNKS, encode_varint(len(prefix) + nbytes), prefix])


def _packed_message(received: Received, budget: int) -> bytes | None:
    """The message ``packed_copy`` made for ``received``'s value, if it is one and the
    value fits one message of ``budget``; else None."""
    value = received.value
    entry = _PACKED.get(id(value))
    if entry is None or entry[0]() is not value or received.is_dead:
        return None
    return entry[1] if value.nbytes <= budget else None


def _lone(received: Received, budget: int) -> tuple[bytes, memoryview] | None:
    """A live, C-contiguous value of a plain number dtype that fits one message of
    ``budget``, as the framing of its one chunk and a view of its buffer: the bytes
    ``chunk_pieces`` would give, without its checks and slices per value. Else None."""
    value = received.value
    nbytes = value.nbytes
    dtype = value.dtype
    if (
        received.is_dead
        or not 0 < nbytes <= budget
        or dtype.kind not in "biufc"
        or not value.flags.c_contiguous
        or dtype != wire_dtype(dtype)
    ):
        return None
    try:
        head = _lone_head(dtype, value.shape, nbytes)
    except (RendezvousError, ValueError):
        return None
    data: Any = value
    return head, memoryview(data)  # (numpy's stubs declare no buffer)


# How ``encode_series`` holds a value until its message is made: a packed value's
# message, a lone value's framing and buffer, or ``chunk_pieces``.
_Piece = bytes | tuple[bytes, memoryview] | list[tuple[bytes, memoryview | bytes]]


def _messages(pieces: list[_Piece], budget: int) -> Iterator[tuple[bytes, int]]:
    parts: list[bytes | memoryview] = []
    size = 0
    completed = 0
    for chunks in pieces:
        if isinstance(chunks, bytes):  # a packed value's whole message
            if parts and size + len(chunks) > budget:
                yield b"".join(parts), completed
                parts, size, completed = [], 0, 0
            parts.append(chunks)
            size += len(chunks)
            completed += 1
            continue
        if isinstance(chunks, tuple):  # a lone value: its framing, its buffer
            head, buffer = chunks
            n = len(head) + buffer.nbytes
            if parts and size + n > budget:
                yield b"".join(parts), completed
                parts, size, completed = [], 0, 0
            parts += chunks
            size += n
            completed += 1
            continue
        for i, (prefix, data) in enumerate(chunks):
            n = len(prefix) + len(data)
            if parts and size + n > budget:
                yield b"".join(parts), completed
                parts, size, completed = [], 0, 0
            parts += [_CHUNKS, encode_varint(n), prefix, data]
            size += n
            if i == len(chunks) - 1:
                completed += 1
    if parts:
        yield b"".join(parts), completed


def series_chunks(message: Buffer) -> Iterator[memoryview]:
    """The ``TensorChunk``s of one series message, in order (views, no copy).

    Raises ``InvalidArgumentError`` for bytes that do not parse."""
    buf = as_buffer(message)
    view = memoryview(buf)
    try:
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == LEN:
                yield view[f.value : f.end]
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse a RecvTensorSeries message: {e}") from e
