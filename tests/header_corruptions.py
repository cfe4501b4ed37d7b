"""Message headers for tests: ``build_header`` and ``write_header`` (a ``Header`` made and
written through the library's one writer), and ``HEADER_CORRUPTIONS``: each field of a live
ring record's header corrupted in turn, for the tests that check a record of a key the
consumer already knows gets the same refusal as a new one: (byte offset in the header, the
bytes written there, what the refusal names), with the fixed-prefix layout of
``shmrdv._shm.header``.
"""

from __future__ import annotations

import mmap
import time
from typing import Any

import numpy as np

from shmrdv._shm.header import FLAG_DEAD, Header, Template

HEADER_CORRUPTIONS: list[tuple[int, bytes, str]] = [
    (0, b"\x88", "magic"),
    (8, (2).to_bytes(2, "little"), "version"),
    (10, (0x80).to_bytes(2, "little"), "flags"),
    (12, (400).to_bytes(4, "little"), "header length"),  # past the record
    (12, (100).to_bytes(4, "little"), "header length"),  # shorter: another tail
    (16, (64).to_bytes(8, "little"), "data offset"),  # inside the header
    (16, (1024).to_bytes(8, "little"), "past the end"),  # data past the record
    (24, (128).to_bytes(8, "little"), "nbytes"),  # fits the record, not the shape
    (60, (-2).to_bytes(8, "little", signed=True), "slot"),
]


def build_header(
    *, key: str, dtype: np.dtype[Any], shape: tuple[int, ...], **fields: Any
) -> Header:
    """A ``Header`` of ``fields`` (step_id, seq, producer_incarnation, producer_pid; is_dead,
    slot and created_ns default to False, -1 and now), its sizes worked out by ``Template``."""
    t = Template(dtype, shape, len(key.encode("utf-8")))
    fields = {"is_dead": False, "slot": -1, "created_ns": time.time_ns(), **fields}
    return Header(dtype=dtype, shape=t.shape, data_offset=t.data_offset, nbytes=t.nbytes,
                  key=key, **fields)  # fmt: skip


def write_header(buf: bytearray | memoryview | mmap.mmap, h: Header) -> None:
    """Write ``h``'s header bytes (not the padding) at the start of ``buf``, through the
    library's one writer, ``Template.write``."""
    key = h.key.encode("utf-8")
    t = Template(h.dtype, h.shape, len(key))
    out = bytearray(t.data_offset)
    t.write(out, 0, key, FLAG_DEAD if h.is_dead else 0, h.step_id, h.seq,
            h.producer_incarnation, h.producer_pid, h.slot, h.created_ns)  # fmt: skip
    buf[: t.header_len] = out[: t.header_len]
