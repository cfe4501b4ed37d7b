"""Stream assembly: one tensor as ``TensorChunk`` messages, and back into one buffer.

Pure: no gRPC, no I/O. ``encode_stream`` yields the messages of
``shmrdv.Rendezvous/RecvTensorStream``: one ``TensorChunk`` with a ``TensorHeader``
(and the first data if it fits), then raw chunks; the data is always the raw
little-endian numpy buffer of ``header.shmrdv_dtype`` (also for ``'S'``).
``StreamAssembler`` preallocates the result once and copies each chunk into place.
Thread model (``docs/threads.md``): an assembler belongs to one stream and is fed by one
thread.

Errors: chunks that do not fit the stream raise ``InvalidArgumentError``; a buffer that
cannot be allocated raises ``ResourceExhaustedError``; misuse of a ``StreamAssembler``
by its caller raises ``InternalError``. No declared length is allocated before it is
checked against ``max_bytes``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from .tensors import (
    MAX_DECODED_BYTES,
    TensorAcc,
    as_array,
    check_shape,
    contiguous_wire,
    element_count,
    empty_array,
    raw_bytes,
    shape_bytes,
    to_dtype,
)
from .tf_dtypes import dtype_descriptor, dtype_to_tf, resolve_dtype, wire_dtype
from .wire import (
    LEN,
    VARINT,
    Buffer,
    Malformed,
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
)

__all__ = [
    "StreamAssembler",
    "chunk_pieces",
    "encode_stream",
    "whole_prefix",
    "whole_tensor",
]


def encode_stream(
    value: npt.NDArray[Any],
    *,
    is_dead: bool,
    chunk_bytes: int,
    send_start_micros: int = 0,
) -> Iterator[bytes]:
    """``TensorChunk`` messages for ``value``: a header (with the first data), then data.

    Each message carries at most ``chunk_bytes`` of tensor data; each is one copy of
    its slice of the buffer. Raises ``InvalidArgumentError`` (at the call, before the
    first message) for a value that cannot be sent or a ``chunk_bytes`` below 1.
    """
    pieces = chunk_pieces(
        value, is_dead=is_dead, chunk_bytes=chunk_bytes, send_start_micros=send_start_micros
    )
    return (b"".join(p) for p in pieces)


def chunk_pieces(
    value: npt.NDArray[Any],
    *,
    is_dead: bool,
    chunk_bytes: int,
    send_start_micros: int = 0,
) -> list[tuple[bytes, memoryview | bytes]]:
    """The ``TensorChunk`` messages of ``encode_stream``, each as (its fields before the
    data, the data: a view of ``value``'s buffer), not joined: a caller that packs them
    into a larger message copies the data once. Raises as ``encode_stream``."""
    arr = as_array(value)
    check_int64("send_start_micros", send_start_micros)
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise InvalidArgumentError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    raw = raw_bytes(contiguous_wire(arr))
    prefixes = _prefixes(
        arr.dtype, arr.shape, bool(is_dead), len(raw), chunk_bytes, send_start_micros
    )
    return [
        (prefix, raw[offset : offset + chunk_bytes])
        for prefix, offset in zip(prefixes, range(0, max(len(raw), 1), chunk_bytes))
    ]


def whole_prefix(dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int) -> bytes:
    """The fields before the data of a live tensor of ``dtype`` and ``shape`` (``nbytes``
    of data in its wire form) sent in one chunk: ``chunk_pieces``' prefix when the chunk
    holds it all. Raises ``InvalidArgumentError`` for what cannot be sent."""
    return _prefixes(dtype, shape, False, nbytes, max(nbytes, 1), 0)[0]


@functools.lru_cache(maxsize=256)
def _prefixes(
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    is_dead: bool,
    total: int,
    chunk_bytes: int,
    send_start_micros: int,
) -> tuple[bytes, ...]:
    """The fields before the data of every chunk of a tensor: the same for every tensor
    of one dtype and shape (a stream of them pays for the header once)."""
    shape_field = shape_bytes(shape)
    header = b"".join(
        [
            int_field(1, dtype_to_tf(dtype)),
            len_field(2, shape_field) if shape_field else b"",
            int_field(3, int(is_dead)),
            int_field(4, total),
            len_field(5, dtype_descriptor(dtype).encode()),
            int_field(6, send_start_micros),
        ]
    )
    first = min(total, chunk_bytes)
    head = len_field(1, header) + (encode_tag(3, LEN) + encode_varint(first) if first else b"")
    out = [head]
    for offset in range(first, total, chunk_bytes):
        n = min(chunk_bytes, total - offset)
        out.append(int_field(2, offset) + encode_tag(3, LEN) + encode_varint(n))
    return tuple(out)


class StreamAssembler:
    """Rebuilds one tensor from the ``TensorChunk`` messages of ``encode_stream``.

    ``feed`` each message in order; ``result()`` gives the array once ``complete``. The
    buffer is allocated once, when the header arrives, after its size is checked
    against the header's dtype and shape and against ``max_bytes`` (default: this
    host's physical memory); every chunk is copied into place (one copy) after its
    offset and length are checked. Not thread-safe: one stream, one feeder.
    """

    __slots__ = (
        "_buffer",
        "_dtype",
        "_is_dead",
        "_max_bytes",
        "_received",
        "_result",
        "_send_start_micros",
        "_shape",
        "_total",
    )

    def __init__(self, *, max_bytes: int | None = None) -> None:
        self._max_bytes = MAX_DECODED_BYTES if max_bytes is None else max_bytes
        self._buffer: npt.NDArray[np.uint8] | None = None
        self._dtype = np.dtype(np.uint8)
        self._shape: tuple[int, ...] = ()
        self._total = 0
        self._received = 0
        self._is_dead = False
        self._send_start_micros = 0
        self._result: npt.NDArray[Any] | None = None

    def __repr__(self) -> str:
        if self._buffer is None:
            return "<StreamAssembler awaiting header>"
        return (
            f"<StreamAssembler {self._dtype} {self._shape}: {self._received}/{self._total} bytes>"
        )

    @property
    def header_received(self) -> bool:
        return self._buffer is not None

    @property
    def complete(self) -> bool:
        """True once the header and every data byte it announced have arrived."""
        return self._buffer is not None and self._received == self._total

    @property
    def is_dead(self) -> bool:
        return self._is_dead

    @property
    def received_bytes(self) -> int:
        """Data bytes copied in so far."""
        return self._received

    @property
    def send_start_micros(self) -> int:
        return self._send_start_micros

    def feed(self, message: Buffer) -> None:
        """Take one ``TensorChunk``; ``InvalidArgumentError`` if it does not fit the stream."""
        buf = as_buffer(message)
        if self._result is not None:
            raise InternalError("StreamAssembler.feed after result(): the stream was finished")
        try:
            self._feed(buf)
        except Malformed as e:
            raise InvalidArgumentError(f"Cannot parse tensor stream: {e}") from e

    def _feed(self, buf: Buffer) -> None:
        header: tuple[int, int] | None = None
        data: tuple[int, int] | None = None
        offset = 0
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == LEN:
                if header is not None:
                    raise Malformed("a TensorChunk carries two headers")
                header = (f.value, f.end)
            elif f.number == 2 and f.wire_type == VARINT:
                offset = f.value
            elif f.number == 3 and f.wire_type == LEN:
                if data is not None:
                    raise Malformed("a TensorChunk carries data twice")
                data = (f.value, f.end)
        if header is not None:
            if self._buffer is not None:
                raise Malformed("a second header in one stream")
            self._start(buf, *header)
        elif self._buffer is None:
            raise Malformed("the first TensorChunk has no header")
        if data is None:
            return
        start, end = data
        if offset != self._received:
            raise Malformed(f"chunk at offset {offset}, expected {self._received}")
        if end - start > self._total - self._received:
            raise Malformed(
                f"chunk of {end - start} bytes at {offset} overruns the {self._total}-byte tensor"
            )
        assert self._buffer is not None
        self._buffer[offset : offset + end - start] = np.frombuffer(
            buf, np.uint8, end - start, start
        )
        self._received += end - start

    def _start(self, buf: Buffer, start: int, end: int) -> None:
        header = _parse_header(bytes(buf[start:end]))
        dtype, shape, total = header.dtype, header.shape, header.total
        self._is_dead, self._send_start_micros = header.is_dead, header.send_start_micros
        if total > self._max_bytes:
            raise Malformed(
                f"tensor of {total} bytes exceeds this receiver's limit of {self._max_bytes}"
            )
        try:
            self._buffer = np.empty(total, np.uint8)
        except MemoryError as e:
            raise ResourceExhaustedError(
                f"cannot allocate {total} bytes for a {dtype} tensor of shape {shape}"
            ) from e
        self._dtype, self._shape, self._total = dtype, shape, total

    def result(self) -> npt.NDArray[Any]:
        """The assembled array (writable, owned); ``InvalidArgumentError`` if incomplete.

        Calling it again returns the same array.
        """
        if self._result is not None:
            return self._result
        if self._buffer is None:
            raise InvalidArgumentError("tensor stream ended before its header")
        if self._received != self._total:
            raise InvalidArgumentError(
                f"tensor stream ended after {self._received} of {self._total} bytes"
            )
        dtype, shape = self._dtype, self._shape
        wire = wire_dtype(dtype)
        value = (
            empty_array(shape, wire) if self._total == 0 else self._buffer.view(wire).reshape(shape)
        )
        try:
            self._result = to_dtype(value, dtype)
        except Malformed as e:
            raise InvalidArgumentError(f"Cannot parse tensor stream: {e}") from e
        return self._result


def whole_tensor(chunk: Buffer) -> tuple[npt.NDArray[Any], bool] | None:
    """The tensor of a ``TensorChunk`` that carries all of it as ``encode_stream`` lays
    one out (its header, then all its data; a series' usual value) and needs no
    conversion (a plain number dtype): (the value, writable and owned: the one copy;
    is_dead). Read in one pass, without a ``StreamAssembler``. None for any other
    chunk: a ``StreamAssembler`` takes it (and refuses what is wrong)."""
    try:
        n = len(chunk)
        if n < 2 or chunk[0] != 0x0A:  # field 1, the header, first
            return None
        size, pos = read_varint(chunk, 1, n)
        end = pos + size
        if end >= n or chunk[end] != 0x1A:  # then field 3, the data, to the end
            return None
        header = _parse_header(bytes(chunk[pos:end]))
        size, pos = read_varint(chunk, end + 1, n)
    except (Malformed, IndexError):
        return None
    dtype = header.dtype
    if pos + size != n or size != header.total or size == 0 or dtype.kind not in "biufc":
        return None
    if wire_dtype(dtype) != dtype:
        return None
    flat = np.frombuffer(chunk, dtype, size // dtype.itemsize, pos)
    return flat.reshape(header.shape).copy(), header.is_dead


@dataclasses.dataclass(frozen=True, slots=True)
class _Header:
    """A parsed, checked ``TensorHeader``."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    is_dead: bool
    total: int
    send_start_micros: int


@functools.lru_cache(maxsize=256)
def _parse_header(header: bytes) -> _Header:
    """``header`` parsed and checked (dtype, shape, size); ``Malformed`` if it is not one.

    Cached by its bytes: a stream of tensors of one dtype and shape parses it once (a
    header that fails is not cached and fails again)."""
    acc = TensorAcc()
    total = send_start_micros = 0
    is_dead = False
    for f in iter_fields(header, 0, len(header)):
        if f.number == 1 and f.wire_type == VARINT:
            acc.dtype = signed64(f.value)
        elif f.number == 2 and f.wire_type == LEN:
            acc.add_shape(header, f.value, f.end)
        elif f.number == 3 and f.wire_type == VARINT:
            is_dead = bool(f.value)
        elif f.number == 4 and f.wire_type == VARINT:
            total = f.value
        elif f.number == 5 and f.wire_type == LEN:
            acc.ext = read_utf8(header, f.value, f.end, "TensorHeader.shmrdv_dtype")
        elif f.number == 6 and f.wire_type == VARINT:
            send_start_micros = signed64(f.value)
    if not acc.ext:
        raise Malformed("TensorHeader has no shmrdv_dtype")
    try:
        dtype = resolve_dtype(acc.dtype, acc.ext)
    except InvalidArgumentError as e:
        raise Malformed(str(e)) from e
    shape = acc.shape()
    check_shape(shape, dtype)
    need = element_count(shape) * dtype.itemsize
    if need != total:
        raise Malformed(f"{dtype} tensor of shape {shape} is {need} bytes, header says {total}")
    if total == 0:
        empty_array(shape, dtype)  # checks that numpy can represent the shape
    return _Header(dtype, shape, is_dead, total, send_start_micros)
