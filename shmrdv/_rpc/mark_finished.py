"""``MarkRecvFinishedRequest`` (TensorFlow's, with shmrdv's extension field 1001,
"released"), built and parsed by hand as ``messages`` builds the RecvTensor messages.

A client sends it for a request_id whose response arrived (the server's response cache
drops it), or, "released", for one it gave up without taking the value (a value taken
for it goes back to its key). Pure; thread model: none needed.
"""

from __future__ import annotations

from .._errors import InvalidArgumentError
from .wire import (
    VARINT,
    Buffer,
    Malformed,
    as_buffer,
    check_int64,
    int_field,
    iter_fields,
    signed64,
)

__all__ = ["decode_mark_recv_finished", "encode_mark_recv_finished"]


# Extension field of MarkRecvFinishedRequest (TensorFlow skips it and just drops the
# cached response): the client gave the request_id up without taking its value, so a
# value taken for it goes back to the head of its key (shmrdv's cancel).
_RELEASED_FIELD = 1001


def encode_mark_recv_finished(request_id: int, *, released: bool = False) -> bytes:
    """``MarkRecvFinishedRequest`` bytes: the client has the response of ``request_id``,
    or (``released``, shmrdv's extension field 1001) gave it up without taking it."""
    return int_field(1, check_int64("request_id", request_id)) + int_field(
        _RELEASED_FIELD, int(released)
    )


def decode_mark_recv_finished(data: Buffer) -> tuple[int, bool]:
    """``(request_id, released)`` of ``MarkRecvFinishedRequest`` bytes.

    Raises ``InvalidArgumentError`` if they do not parse.
    """
    buf = as_buffer(data)
    request_id = 0
    released = False
    try:
        for f in iter_fields(buf, 0, len(buf)):
            if f.number == 1 and f.wire_type == VARINT:
                request_id = signed64(f.value)
            elif f.number == _RELEASED_FIELD and f.wire_type == VARINT:
                released = bool(f.value)
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse MarkRecvFinishedRequest: {e}") from e
    return request_id, released
