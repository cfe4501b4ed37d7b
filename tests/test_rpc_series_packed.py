"""A value the outbox copies as its own series message is sent without a second copy."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from shmrdv._rendezvous import Received
from shmrdv._rpc import series_wire

CASES: list[npt.NDArray[Any]] = [
    np.arange(10, dtype=np.float32).reshape(2, 5),
    np.ones(1 << 18, np.float32),
    np.array(3.0),
    np.arange(6, dtype=np.int64)[::2],
    np.array([True, False]),
]


def _messages(value: npt.NDArray[Any], budget: int) -> list[tuple[bytes, int]]:
    return list(series_wire.encode_series([Received(value, False)], budget))


@pytest.mark.parametrize("value", CASES, ids=lambda a: f"{a.dtype}{a.shape}")
def test_packed_copy_is_sent_as_is(value: npt.NDArray[Any]) -> None:
    packed = series_wire.packed_copy(value)
    assert packed is not None
    np.testing.assert_array_equal(packed, value)
    assert packed.dtype == value.dtype and packed.shape == value.shape
    assert not packed.flags.writeable
    plain = _messages(np.array(value, copy=True), 4 << 20)
    sent = _messages(packed, 4 << 20)
    assert sent == plain  # the same bytes on the wire
    owner = packed.base.base if isinstance(packed.base, np.ndarray) else packed.base
    assert sent[0][0] is owner  # ... and no copy made to send them


def test_packed_value_larger_than_a_message_is_chunked_as_before() -> None:
    value = np.arange(1000, dtype=np.float32)
    packed = series_wire.packed_copy(value)
    assert packed is not None
    assert _messages(packed, 512) == _messages(value.copy(), 512)
    assert len(_messages(packed, 512)) > 1


def test_packed_copy_declines_what_is_not_its_wire_form() -> None:
    assert series_wire.packed_copy(np.array(["a", "bc"])) is None
    assert series_wire.packed_copy(np.zeros(0, np.float32)) is None
    assert series_wire.packed_copy(np.ones(3, ">f4")) is None


def test_a_look_alike_buffer_is_copied_as_usual() -> None:
    value = np.arange(4, dtype=np.float32)
    # Backed by bytes, but not a series message: encoded by the usual path.
    other = np.frombuffer(b"\x00" * 8 + value.tobytes(), np.float32, 4, 8)
    assert _messages(other, 4 << 20) == _messages(value, 4 << 20)
    assert _messages(other, 4 << 20)[0][0] is not other.base


def test_only_the_packed_array_itself_is_sent_as_its_message() -> None:
    """A packed copy is known by its identity: a view of it (another array on the same
    bytes, perhaps a part of them) is encoded by the usual path."""
    packed = series_wire.packed_copy(np.arange(8, dtype=np.int32))
    assert packed is not None
    owner = packed.base.base if isinstance(packed.base, np.ndarray) else packed.base
    assert _messages(packed, 4 << 20)[0][0] is owner
    for view in (packed[:], packed[2:], packed.reshape(2, 4)):
        sent = _messages(view, 4 << 20)
        assert sent[0][0] is not owner
        assert sent == _messages(np.array(view, copy=True), 4 << 20)


def test_packed_copies_are_forgotten_with_their_arrays() -> None:
    before = len(series_wire._PACKED)
    copies = [series_wire.packed_copy(np.full(4, i, np.float64)) for i in range(100)]
    assert len(series_wire._PACKED) == before + 100
    del copies
    assert len(series_wire._PACKED) == before


def test_packed_values_in_one_message_are_the_bytes_of_the_usual_path() -> None:
    values = [np.arange(i + 1, dtype=np.float32) for i in range(50)] + [np.array(["s"])]
    packed = [series_wire.packed_copy(v) for v in values[:-1]]
    assert all(p is not None for p in packed)
    mixed = [Received(p) for p in packed if p is not None] + [Received(values[-1])]
    plain = [Received(np.array(v, copy=True)) for v in values]
    for budget in (64, 1000, 4 << 20):
        assert _messages_of(mixed, budget) == _messages_of(plain, budget)
    assert len(list(series_wire.encode_series(mixed, 4 << 20))) == 1  # all in one


def _messages_of(values: list[Received], budget: int) -> tuple[list[bytes], int]:
    """The chunks the messages carry, in order, and the values they complete: where
    messages are cut may differ a little (a packed value counts its framing), what they
    carry may not."""
    chunks: list[bytes] = []
    completed = 0
    for message, done in series_wire.encode_series(values, budget):
        chunks += [bytes(c) for c in series_wire.series_chunks(message)]
        completed += done
    return chunks, completed


def _strided(value: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The same values in a non-contiguous array: encoded by ``chunk_pieces``."""
    wide = np.empty((*value.shape, 2), value.dtype)
    wide[..., 0] = value
    strided: npt.NDArray[Any] = wide[..., 0]
    assert not strided.flags.c_contiguous or value.size <= 1
    return strided


def test_a_batch_of_plain_values_is_framed_as_chunk_pieces_frames_it() -> None:
    """Plain contiguous values that fit a message go framed once (``_lone``): the same
    bytes as the non-contiguous path, mixed with packed, dead and large values."""
    values = [
        Received(np.arange(10, dtype=np.float32).reshape(2, 5), False),
        Received(np.arange(5000, dtype=np.int16), False),
        Received(np.array(3.0), False),  # 0-d
        Received(np.array([True, False, True]), False),
        Received(series_wire.packed_copy(np.ones(7, np.float64)), False),  # type: ignore[arg-type]
        Received(np.arange(3, dtype=np.int32), True),  # dead
        Received(np.ones(6, ">f4"), False),  # converted on the wire
        Received(np.arange(40_000, dtype=np.uint8), False),  # cut into chunks
    ]
    reference = [
        r if r.is_dead or not r.value.flags.writeable else Received(_strided(r.value), False)
        for r in values
    ]
    for budget in (4 << 20, 20_000, 64):
        sent = list(series_wire.encode_series(values, budget))
        assert sent == list(series_wire.encode_series(reference, budget))


def test_the_ask_message_and_the_ack_method_are_the_protos() -> None:
    from shmrdv._rpc.methods import RECV_TENSOR_SERIES_ACK_METHOD
    from shmrdv._rpc.proto import rendezvous_pb2

    asked = rendezvous_pb2.TensorChunks.FromString(series_wire.ASK)
    assert asked.ask and not asked.chunks
    # A message that carries chunks is never read as an ask.
    values = [Received(np.arange(3.0))]
    (message, _), *_ = series_wire.encode_series(values, 1 << 20)
    assert not rendezvous_pb2.TensorChunks.FromString(message).ask
    service = rendezvous_pb2.DESCRIPTOR.services_by_name["Rendezvous"]
    ack = service.methods_by_name["RecvTensorSeriesAck"]
    assert f"/{service.full_name}/{ack.name}" == RECV_TENSOR_SERIES_ACK_METHOD
    assert not ack.server_streaming and not ack.client_streaming
