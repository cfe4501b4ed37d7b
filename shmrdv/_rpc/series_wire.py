"""The messages of ``RecvTensorSeries``: whole ``TensorChunk``s of one or more values.

Pure: no gRPC, no I/O; thread model: none needed. A series message is
``TensorChunks`` (protos/shmrdv/rendezvous.proto): ``repeated TensorChunk chunks = 1``,
the chunks of ``RecvTensorStream`` (``assembly``) in order, each value's chunks back to
back. The producer packs what it already has into one message up to about
``budget`` bytes, so a queue of small values costs one gRPC write, not one each; a value
larger than ``budget`` is cut into chunks of at most ``budget`` bytes of data, one
message each. One copy of the data: the buffer into the message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .._errors import InvalidArgumentError
from .._received import Received
from .assembly import chunk_pieces
from .wire import LEN, Buffer, Malformed, as_buffer, encode_tag, encode_varint, iter_fields

__all__ = ["encode_series", "series_chunks"]

_CHUNKS = encode_tag(1, LEN)


def encode_series(values: Sequence[Received], budget: int) -> Iterator[tuple[bytes, int]]:
    """``values`` as series messages: (message, how many of ``values`` it completes).

    Each message is made when it is asked for (a large value is never copied whole
    ahead of its writing). Raises ``InvalidArgumentError`` for a value that cannot be
    sent, at the call, before any message.
    """
    pieces = [
        chunk_pieces(received.value, is_dead=received.is_dead, chunk_bytes=budget)
        for received in values
    ]
    return _messages(pieces, budget)


def _messages(
    pieces: list[list[tuple[bytes, memoryview | bytes]]], budget: int
) -> Iterator[tuple[bytes, int]]:
    parts: list[bytes | memoryview] = []
    size = 0
    completed = 0
    for chunks in pieces:
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
