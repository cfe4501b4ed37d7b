"""Each field of a live ring record's header corrupted in turn, for the tests that check a
record of a key the consumer already knows gets the same refusal as a new one.

``HEADER_CORRUPTIONS``: (byte offset in the header, the bytes written there, what the
refusal names), with the fixed-prefix layout of ``shmrdv._shm.header``.
"""

from __future__ import annotations

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
