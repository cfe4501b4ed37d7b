"""GetStatus, TensorFlow's "is this peer up, and whose incarnation is it" call: its
response message (``DeviceAttributes``, built and parsed by hand as ``messages`` builds
the others) and a client's call (``get_status``).

``DEVICE_LOCALITY`` is the schema of TensorFlow's ``DeviceLocality`` (a device's bus and
links), which a ``RecvTensorRequest`` may carry too: it is validated, never kept.

Pure but for ``get_status``'s one blocking call; thread model: none needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from .._errors import InvalidArgumentError, RendezvousError, error_for_code
from .methods import GET_STATUS_METHOD
from .rpc_errors import error_code, error_details
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
    int_field,
    iter_fields,
    len_field,
    read_utf8,
    signed64,
    validate,
)

__all__ = [
    "DEVICE_LOCALITY",
    "DeviceAttributes",
    "decode_status_response",
    "encode_status_response",
    "get_status",
]

_INTERCONNECT_LINK: Schema = {1: (VARINT, None), 2: (LEN, "str"), 3: (VARINT, None)}
_LOCAL_LINKS: Schema = {1: (LEN, _INTERCONNECT_LINK)}
#: TensorFlow's ``DeviceLocality``: bus id, NUMA node, links.
DEVICE_LOCALITY: Schema = {1: (VARINT, None), 2: (VARINT, None), 3: (LEN, _LOCAL_LINKS)}


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
                    validate(buf, g.value, g.end, DEVICE_LOCALITY)
            out.append(DeviceAttributes(**v))
    except Malformed as e:
        raise InvalidArgumentError(f"Cannot parse GetStatusResponse: {e}") from e
    return tuple(out)


def get_status(
    channel: grpc.Channel,
    address: str,
    metadata: Sequence[tuple[str, str]],
    timeout: float | None,
) -> tuple[DeviceAttributes, ...]:
    """``GetStatus`` of the worker at ``address`` over ``channel``; blocks up to
    ``timeout``. Raises the mapped error (``UnavailableError`` when it cannot be
    reached), naming ``address``."""
    try:
        data = channel.unary_unary(GET_STATUS_METHOD)(b"", timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        raise error_for_code(error_code(e))(
            f"GetStatus of {address} failed: {error_details(e)}"
        ) from e
    try:
        return decode_status_response(data)
    except RendezvousError as e:
        raise type(e)(f"bad GetStatusResponse from {address}: {e}") from e
