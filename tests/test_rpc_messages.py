"""shmrdv/_rpc/messages.py against the generated protobuf classes.

Byte for byte: a whole RecvTensorResponse is in TensorFlow's order (fields 2, 3, 5, then
the tensor), which parses to the same message as the canonical serialisation; chunks,
requests and MarkRecvFinished with shmrdv's fields are what the ``*Ext`` messages of
protos/shmrdv/rendezvous.proto declare; everything else is refused with an
``InvalidArgumentError``, whatever the bytes.
"""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from rpc_coding import IDS, SAMPLES, expected_response, same, varint

from shmrdv._errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from shmrdv._rendezvous import Received
from shmrdv._rpc import messages, wire
from shmrdv._rpc.proto import (
    device_attributes_pb2,
    rendezvous_pb2,
    tensor_pb2,
    tensor_shape_pb2,
    worker_pb2,
)

ml_dtypes = pytest.importorskip("ml_dtypes")

WIRE_ERRORS = (InvalidArgumentError, InternalError)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _whole(arr: Any, is_dead: bool = False, ssm: int = 0) -> bytes:
    encoded = messages.encode_value(arr, is_dead, send_start_micros=ssm)
    assert len(encoded.chunks) == 1
    return encoded.chunks[0]


def _decode(*chunks: bytes) -> Received:
    assembly = messages.Assembly()
    got = None
    for chunk in chunks:
        got = assembly.feed(chunk)
    assert got is not None
    return got


# -- whole responses ----------------------------------------------------------------------


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
@pytest.mark.parametrize("is_dead,ssm", [(False, 0), (True, 1_700_000_000_123_456), (False, -3)])
def test_response_bytes_equal_generated(arr: npt.NDArray[Any], is_dead: bool, ssm: int) -> None:
    ours = _whole(arr, is_dead, ssm)
    tf_order, canonical = expected_response(arr, is_dead, ssm)
    assert ours == tf_order
    assert worker_pb2.RecvTensorResponse.FromString(ours).SerializeToString() == canonical


def test_response_tensor_bytes_come_last_in_tensorflow_order() -> None:
    arr = np.arange(300, dtype=np.float64)  # > kLargeTensorBytes = 1024
    ours = _whole(arr, True, 5)
    # A: is_dead, send_start_micros, require_ack; B: tag 0x0a; then the tensor.
    assert ours.startswith(b"\x10\x01\x18\x05\x28\x01\x0a")
    assert ours.endswith(arr.tobytes())


def test_response_dt_string_follows_tensorflow_string_list() -> None:
    arr = np.array([b"ab", b"", b"x" * 200], "S200")
    msg = worker_pb2.RecvTensorResponse.FromString(_whole(arr))
    assert msg.tensor.dtype == 7
    assert msg.tensor.tensor_content == b"\x02\x00\xc8\x01" + b"ab" + b"x" * 200
    assert msg.tensor.shmrdv_dtype == "|S200"


def test_response_of_what_cannot_be_sent_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="Python objects"):
        messages.encode_value(np.array([1, "a"], dtype=object), False)
    with pytest.raises(InvalidArgumentError, match="only numpy arrays"):
        messages.encode_value([1, 2], False)  # type: ignore[arg-type]
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(InvalidArgumentError, match=r"cannot encode a numpy\.ma\.MaskedArray.*mask"):
        messages.encode_value(masked, False)


def test_response_of_a_memmap_is_its_plain_array(tmp_path: Any) -> None:
    mapped = np.memmap(tmp_path / "m", dtype=np.int32, mode="w+", shape=(4, 3))
    mapped[:] = np.arange(12, dtype=np.int32).reshape(4, 3)
    got = _decode(_whole(mapped)).value
    assert type(got) is np.ndarray and got.tolist() == np.asarray(mapped).tolist()
    del mapped


def test_whole_message_of_more_than_2gib_is_refused_before_copying() -> None:
    huge = messages.Encoded((b"first", b"second"), 1 << 31, 1 << 30)
    with pytest.raises(ResourceExhaustedError, match="2 GiB"):
        messages.whole_message(huge)


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
def test_decode_reads_generated_bytes(arr: npt.NDArray[Any]) -> None:
    _, canonical = expected_response(arr, True, 42)
    got = _decode(canonical)
    assert same(got.value, np.asarray(arr)) or repr(got.value.tolist()) == repr(arr.tolist())
    assert got.is_dead


def test_decode_gives_a_private_writable_array() -> None:
    data = _whole(np.arange(10, dtype=np.int32))
    got = _decode(data)
    assert got.value.flags.writeable and not np.shares_memory(
        got.value, np.frombuffer(data, np.uint8)
    )


@pytest.mark.parametrize("shape", [(1 << 14,), (3, 1 << 14), (1 << 18,)])
def test_large_response_aligns_its_content_and_parses_as_generated(shape: tuple[int, ...]) -> None:
    arr = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    ours = _whole(arr, False, 1_700_000_000_123_456)
    _, canonical = expected_response(arr, False, 1_700_000_000_123_456)
    assert ours.endswith(arr.tobytes()) and (len(ours) - arr.nbytes) % 8 == 0
    assert worker_pb2.RecvTensorResponse.FromString(ours).SerializeToString() == canonical


def test_decode_of_an_owned_message_keeps_the_value_in_it() -> None:
    arr = np.arange(1 << 16, dtype=np.float64).reshape(256, 256)
    message = bytes(bytearray(_whole(arr)))  # a message of its own, as grpcio's are
    got = messages.Assembly().feed(message, owned=True)
    assert got is not None and same(got.value, arr)
    value = got.value
    assert value.flags.writeable and value.flags.aligned and not value.flags.owndata
    del got, message
    value[0, 0] = -1.0  # the array keeps the message's bytes alive and is its own
    assert value[0, 0] == -1.0 and value[255, 255] == arr[255, 255]


def test_decode_of_an_unaligned_owned_message_copies() -> None:
    arr = np.arange(1 << 15, dtype=np.int64)
    tf_order, _ = expected_response(arr, False, 5)  # TensorFlow's bytes: no alignment
    message = next(
        m for m in (b"\x18\x05" * n + tf_order for n in range(4)) if (len(m) - arr.nbytes) % 8
    )
    got = messages.Assembly().feed(message, owned=True)
    assert got is not None and same(got.value, arr)
    assert got.value.flags.writeable and got.value.flags.aligned and got.value.flags.owndata


def test_decode_tensorflow_skeleton_with_zero_dims_and_empty_content() -> None:
    # TensorFlow's hand-written skeleton writes Dim{size: 0} as 08 00 and an empty
    # tensor_content field; canonical protobuf leaves both out.
    tensor = b"\x08\x01" + b"\x12\x08" + b"\x12\x02\x08\x02" + b"\x12\x02\x08\x00" + b"\x22\x00"
    got = _decode(b"\x18\x07" + b"\x0a" + bytes([len(tensor)]) + tensor)
    assert got.value.dtype == np.float32 and got.value.shape == (2, 0)


def test_decode_accepts_fields_in_any_order() -> None:
    arr = np.arange(6, dtype=np.int16).reshape(3, 2)
    t = worker_pb2.RecvTensorResponse.FromString(_whole(arr, True, 9)).tensor
    pieces = [
        tensor_pb2.TensorProto(tensor_content=t.tensor_content).SerializeToString(),
        tensor_pb2.TensorProto(tensor_shape=t.tensor_shape).SerializeToString(),
        tensor_pb2.TensorProto(dtype=t.dtype).SerializeToString(),
        tensor_pb2.TensorProto(version_number=1).SerializeToString(),
    ]
    fields = [
        b"\x0a" + varint(len(b"".join(pieces))) + b"".join(pieces),
        b"\x10\x01",
        b"\x18\x09",
        b"\x28\x01",
        b"\x22\x00",  # transport_options: an empty Any
        b"\xa0\x06\x05",  # an unknown field 100
    ]
    for seed in range(5):
        random.Random(seed).shuffle(fields)
        got = _decode(b"".join(fields))
        assert same(got.value, arr) and got.is_dead


def test_decode_repeated_tensor_fields_merge_like_protobuf() -> None:
    shape_a = tensor_pb2.TensorProto(dtype=1)
    shape_a.tensor_shape.dim.add(size=2)
    part2 = tensor_pb2.TensorProto(tensor_content=np.arange(6, dtype=np.float32).tobytes())
    part2.tensor_shape.dim.add(size=3)
    data = (
        worker_pb2.RecvTensorResponse(tensor=shape_a).SerializeToString()
        + worker_pb2.RecvTensorResponse(tensor=part2).SerializeToString()
    )
    reference = worker_pb2.RecvTensorResponse.FromString(data)
    assert [d.size for d in reference.tensor.tensor_shape.dim] == [2, 3]
    assert _decode(data).value.shape == (2, 3)


def test_decode_typed_val_fields_refused() -> None:
    t = tensor_pb2.TensorProto(dtype=1, float_val=[1.0, 2.0])
    t.tensor_shape.dim.add(size=2)
    with pytest.raises(InvalidArgumentError, match="float_val is not supported"):
        _decode(worker_pb2.RecvTensorResponse(tensor=t).SerializeToString())


def test_decode_dead_without_tensor_gives_empty_float() -> None:
    got = _decode(worker_pb2.RecvTensorResponse(is_dead=True).SerializeToString())
    assert got.is_dead and got.value.dtype == np.float32 and got.value.shape == (0,)


@pytest.mark.parametrize(
    "tensor",
    [
        tensor_pb2.TensorProto(dtype=1, tensor_content=b"\x00" * 7),  # scalar needs 4
        tensor_pb2.TensorProto(dtype=0, tensor_content=b"\x00" * 4),  # no dtype at all
        tensor_pb2.TensorProto(dtype=20),  # DT_RESOURCE
        tensor_pb2.TensorProto(dtype=1, shmrdv_dtype="<U3"),  # contradiction
        tensor_pb2.TensorProto(dtype=0, shmrdv_dtype="|O"),
        tensor_pb2.TensorProto(
            dtype=1, tensor_shape=tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
        ),
    ],
    ids=["size", "invalid", "resource", "contradiction", "object", "unknown-rank"],
)
def test_decode_impossible_tensor_refused(tensor: tensor_pb2.TensorProto) -> None:
    data = worker_pb2.RecvTensorResponse(tensor=tensor).SerializeToString()
    with pytest.raises(InvalidArgumentError, match="Cannot parse tensor from response"):
        _decode(data)


def test_decode_negative_dim_refused() -> None:
    t = tensor_pb2.TensorProto(dtype=1)
    t.tensor_shape.dim.add(size=-1)
    with pytest.raises(InvalidArgumentError, match="unknown"):
        _decode(worker_pb2.RecvTensorResponse(tensor=t).SerializeToString())


@pytest.mark.parametrize("dtype", [1, 7, 0])
def test_decode_huge_declared_shape_refused_without_allocating(dtype: int) -> None:
    t = tensor_pb2.TensorProto(dtype=dtype, tensor_content=b"\x01" * 16)  # type: ignore[arg-type]
    if dtype == 0:
        t.shmrdv_dtype = "|V0"  # zero itemsize: no content size to compare against
    for size in (2**30, 2**30, 2**30):
        t.tensor_shape.dim.add(size=size)
    data = worker_pb2.RecvTensorResponse(tensor=t).SerializeToString()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError):
            _decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_decode_dt_string_huge_declared_width_refused() -> None:
    t = tensor_pb2.TensorProto(dtype=7, tensor_content=b"\x00" * 64, shmrdv_dtype="|S2147483647")
    t.tensor_shape.dim.add(size=64)
    with pytest.raises(InvalidArgumentError, match="exceed this host's memory"):
        _decode(worker_pb2.RecvTensorResponse(tensor=t).SerializeToString())


# -- chunks -------------------------------------------------------------------------------


@pytest.mark.parametrize("arr", SAMPLES, ids=IDS)
@pytest.mark.parametrize("chunk_bytes", [1, 3, 64])
def test_chunks_reassemble_in_any_order(arr: npt.NDArray[Any], chunk_bytes: int) -> None:
    encoded = messages.encode_value(arr, True, chunk_bytes=chunk_bytes)
    chunks = list(encoded.chunks)
    assembly = messages.Assembly()
    got = assembly.feed(chunks[0])
    if len(chunks) > 1:
        assert got is None and len(assembly.missing) == len(chunks) - 1
        random.Random(len(chunks)).shuffle(rest := chunks[1:])
        for chunk in rest:
            got = assembly.feed(chunk)
    assert got is not None and got.is_dead
    assert same(got.value, np.asarray(arr)) or repr(got.value.tolist()) == repr(arr.tolist())
    assert got.value.flags.writeable
    assert encoded.chunk_at(0) == chunks[0] and encoded.chunk_at(1 << 40) is None


def test_chunks_are_the_generated_ext_responses() -> None:
    arr = np.arange(10, dtype=">f8").reshape(2, 5)  # 80 bytes, boundaries inside elements
    encoded = messages.encode_value(arr, False, chunk_bytes=12, send_start_micros=4)
    assert len(encoded.chunks) == 7
    content = b""
    for i, chunk in enumerate(encoded.chunks):
        msg = rendezvous_pb2.RecvTensorResponseExt.FromString(chunk)
        assert (msg.offset, msg.content_bytes, msg.require_ack) == (12 * i, 80, True)
        assert (msg.tensor.dtype, [d.size for d in msg.tensor.tensor_shape.dim]) == (2, [2, 5])
        assert msg.tensor.shmrdv_dtype == ">f8" and msg.send_start_micros == 4
        assert encoded.chunk_at(12 * i) == chunk
        content += msg.tensor.tensor_content
    assert content == arr.astype("<f8").tobytes()
    # What a TensorFlow client (no chunks) gets: one whole response.
    whole = worker_pb2.RecvTensorResponse.FromString(messages.whole_message(encoded))
    assert whole.tensor.tensor_content == content


def _chunks(arr: npt.NDArray[Any], chunk: int = 8) -> list[bytes]:
    return list(messages.encode_value(arr, False, chunk_bytes=chunk).chunks)


def test_a_chunk_before_the_first_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="first chunk"):
        _decode(*_chunks(np.arange(8, dtype=np.int32))[1:])


def test_a_chunk_twice_or_off_its_grid_is_refused() -> None:
    chunks = _chunks(np.arange(8, dtype=np.int32))
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        _decode(chunks[0], chunks[1], chunks[1])
    other = _chunks(np.arange(8, dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        _decode(chunks[0], other[1])


def test_a_chunk_whose_whole_is_not_its_tensor_is_refused() -> None:
    t = tensor_pb2.TensorProto(dtype=1, tensor_content=b"\x00" * 8)
    t.tensor_shape.dim.add(size=2)
    msg = rendezvous_pb2.RecvTensorResponseExt(tensor=t, content_bytes=12)
    with pytest.raises(InvalidArgumentError, match="is not 12 bytes"):
        _decode(msg.SerializeToString())


def test_a_chunk_declaring_a_huge_whole_is_refused_before_allocating() -> None:
    t = tensor_pb2.TensorProto(dtype=4, tensor_content=b"\x00" * 8)
    t.tensor_shape.dim.add(size=1 << 50)
    msg = rendezvous_pb2.RecvTensorResponseExt(tensor=t, content_bytes=1 << 50)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError, match="memory"):
            _decode(msg.SerializeToString())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_an_ask_carries_no_tensor() -> None:
    assert rendezvous_pb2.RecvTensorResponseExt.FromString(messages.ASK).ask
    assembly = messages.Assembly()
    assert assembly.feed(messages.ASK) is None and assembly.ask


# -- requests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step_id,key,request_id",
    [
        (0, "", 0),
        (
            7,
            "/job:w/replica:0/task:0/device:CPU:0;0000000000000001;/job:w/replica:0/task:1/device:CPU:0;x;0:0",
            12345,
        ),
        (-1, "ключ;é", -(2**63)),
        (2**63 - 1, "k", 2**63 - 1),
    ],
)
def test_request_bytes_equal_generated(step_id: int, key: str, request_id: int) -> None:
    ours = messages.encode_request(step_id, key, request_id, chunks=False)
    ref = worker_pb2.RecvTensorRequest(step_id=step_id, rendezvous_key=key, request_id=request_id)
    assert ours == ref.SerializeToString()
    assert messages.decode_request(ours) == messages.RecvRequest(step_id, key, request_id)


_INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(
    step_id=_INT64,
    key=st.text(max_size=300),
    request_id=_INT64,
    acks=st.lists(_INT64, max_size=5),
    held=_INT64,
    offset=st.integers(0, 2**63 - 1),
)
def test_request_ext_fields_are_the_generated_ones(
    step_id: int, key: str, request_id: int, acks: list[int], held: int, offset: int
) -> None:
    ours = messages.encode_request(
        step_id, key, request_id, finished=acks, held=held, offset=offset
    )
    ref = rendezvous_pb2.RecvTensorRequestExt.FromString(ours)
    assert (ref.step_id, ref.rendezvous_key, ref.request_id) == (step_id, key, request_id)
    assert (list(ref.finished), ref.chunks, ref.held, ref.offset) == (acks, True, held, offset)
    got = messages.decode_request(ours)
    assert got == messages.RecvRequest(step_id, key, request_id, tuple(acks), True, held, offset)
    # TensorFlow reads its own fields and skips ours.
    tf = worker_pb2.RecvTensorRequest.FromString(ours)
    assert (tf.step_id, tf.rendezvous_key, tf.request_id) == (step_id, key, request_id)


def test_request_localities_and_transport_options_are_skipped() -> None:
    ref = worker_pb2.RecvTensorRequest(step_id=3, rendezvous_key="k", request_id=9)
    ref.client_locality.bus_id = 1
    ref.client_locality.links.link.add(device_id=2, type="NVLINK", strength=3)
    ref.server_locality.numa_node = 1
    ref.transport_options.type_url = "type.googleapis.com/x.Y"
    ref.transport_options.value = b"\x00\x01"
    assert messages.decode_request(ref.SerializeToString()) == messages.RecvRequest(3, "k", 9)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, True])
def test_request_out_of_range_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        messages.encode_request(bad, "k", 1)


def test_request_invalid_utf8_key_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="UTF-8"):
        messages.decode_request(b"\x12\x02\xff\xfe")


def test_request_acks_unpacked_and_packed_decode_alike() -> None:
    """Acks as shmrdv writes them (one varint each) and packed, as a standard protobuf
    encoder writes a repeated int64; both give the same ids, capped at MAX_ACKS."""
    acks = [1, 2**40, 2**63 - 1, 7]
    assert (
        list(messages.decode_request(messages.encode_request(3, "k", 9, finished=acks)).finished)
        == acks
    )
    base = messages.encode_request(3, "k", 9)
    packed = rendezvous_pb2.RecvTensorRequestExt(finished=acks).SerializeToString()
    assert list(messages.decode_request(base + packed).finished) == acks
    many = list(range(1, messages.MAX_ACKS + 50))
    packed = rendezvous_pb2.RecvTensorRequestExt(finished=many).SerializeToString()
    assert list(messages.decode_request(base + packed).finished) == many[: messages.MAX_ACKS]
    bad = base + b"\xca\x3e\x02\xff\xff"  # packed acks whose varint never ends
    with pytest.raises(InvalidArgumentError):
        messages.decode_request(bad)


# -- MarkRecvFinished, GetStatus -----------------------------------------------------------


@pytest.mark.parametrize("request_id", [0, 1, -5, 2**63 - 1])
def test_finished_bytes_equal_generated(request_id: int) -> None:
    ours = messages.encode_finished(request_id)
    assert ours == worker_pb2.MarkRecvFinishedRequest(request_id=request_id).SerializeToString()
    assert messages.decode_finished(ours) == (request_id, False, 0)
    ext = messages.encode_finished(request_id, released=True, held=7)
    ref = rendezvous_pb2.MarkRecvFinishedRequestExt.FromString(ext)
    assert (ref.request_id, ref.released, ref.held) == (request_id, True, 7)
    assert messages.decode_finished(ext) == (request_id, True, 7)


def test_status_bytes_equal_generated() -> None:
    devices = [
        messages.DeviceAttributes(
            "/job:w/replica:0/task:0/device:CPU:0", "CPU", 1 << 30, 2**64 - 1, "host", -1
        ),
        messages.DeviceAttributes(
            "/job:w/replica:0/task:0/device:CPU:1", "CPU", incarnation=5, xla_global_id=3
        ),
    ]
    ref = worker_pb2.GetStatusResponse(
        device_attributes=[
            device_attributes_pb2.DeviceAttributes(
                name=d.name,
                device_type=d.device_type,
                memory_limit=d.memory_limit,
                incarnation=d.incarnation,
                physical_device_desc=d.physical_device_desc,
                xla_global_id=d.xla_global_id,
            )
            for d in devices
        ]
    )
    ours = messages.encode_status(devices)
    assert ours == ref.SerializeToString()
    assert messages.decode_status(ours) == tuple(devices)


# -- properties and fuzzing ---------------------------------------------------------------

_DTYPES = st.one_of(
    hnp.scalar_dtypes(),
    hnp.byte_string_dtypes(min_len=1, max_len=6),
    hnp.unicode_string_dtypes(min_len=1, max_len=4),
    hnp.nested_dtypes(max_itemsize=64),
)
_ARRAYS = _DTYPES.flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arr=_ARRAYS, is_dead=st.booleans(), chunk=st.integers(1, 40))
@pytest.mark.slow
def test_round_trip_property(arr: npt.NDArray[Any], is_dead: bool, chunk: int) -> None:
    data = _whole(arr, is_dead)
    got = _decode(data)
    assert same(got.value, arr) and got.is_dead == is_dead
    ref = worker_pb2.RecvTensorResponse.FromString(data)
    assert [d.size for d in ref.tensor.tensor_shape.dim] == list(arr.shape)
    assert ref.tensor.dtype == wire.dtype_to_tf(arr.dtype)
    chunked = _decode(*messages.encode_value(arr, is_dead, chunk_bytes=chunk).chunks)
    assert same(chunked.value, arr) and chunked.is_dead == is_dead


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(
        ["bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz",
         "int4", "uint4", "float8_e4m3b11fnuz"]
    ),
    raw=st.binary(min_size=0, max_size=24),
)  # fmt: skip
def test_round_trip_ml_dtypes_property(name: str, raw: bytes) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name))
    arr = np.frombuffer(raw, dtype, len(raw) // dtype.itemsize)
    assert same(_decode(_whole(arr)).value, arr)
    assert same(_decode(*_chunks(arr, 5)).value, arr)


def _mutations(seed_messages: list[bytes]) -> st.SearchStrategy[bytes]:
    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(st.sampled_from(seed_messages)))
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
            pos = draw(st.integers(0, max(len(data) - 1, 0)))
            if op == "flip" and data:
                data[pos] ^= 1 << draw(st.integers(0, 7))
            elif op == "set" and data:
                data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x22]))
            elif op == "insert":
                data[pos:pos] = draw(st.binary(min_size=1, max_size=12))
            elif op == "delete":
                del data[pos : pos + draw(st.integers(1, 8))]
            elif op == "truncate":
                del data[pos:]
        return bytes(data)

    return mutate()


_RESPONSES = [_whole(a, i % 2 == 0, i) for i, a in enumerate(SAMPLES)]
_CHUNKS = [c for a in SAMPLES for c in _chunks(a, 7)]
_REQUESTS = [
    messages.encode_request(5, "a;0000000000000001;b;edge;0:0", 77, finished=[3], held=2),
    worker_pb2.RecvTensorRequest(
        step_id=1,
        rendezvous_key="k",
        client_locality=device_attributes_pb2.DeviceLocality(bus_id=1),
    ).SerializeToString(),
]


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), _mutations(_RESPONSES + _CHUNKS)))
def test_decode_fuzz_raises_only_shmrdv_errors(data: bytes) -> None:
    try:
        got = messages.Assembly().feed(data)
    except WIRE_ERRORS:
        return
    ref = rendezvous_pb2.RecvTensorResponseExt.FromString(data)  # what we accept, protobuf does
    if got is not None:
        assert ref.is_dead == got.is_dead


@FUZZ
@given(data=st.one_of(st.binary(max_size=120), _mutations(_REQUESTS)))
def test_decode_request_fuzz_raises_only_shmrdv_errors(data: bytes) -> None:
    try:
        got = messages.decode_request(data)
    except WIRE_ERRORS:
        return
    ref = worker_pb2.RecvTensorRequest.FromString(data)
    assert (ref.step_id, ref.rendezvous_key, ref.request_id) == (
        got.step_id,
        got.rendezvous_key,
        got.request_id,
    )


@FUZZ
@given(data=st.binary(max_size=200))
def test_decode_status_and_finished_fuzz_raise_only_shmrdv_errors(data: bytes) -> None:
    for decode in (messages.decode_status, messages.decode_finished):
        try:
            decode(data)
        except WIRE_ERRORS:
            pass
