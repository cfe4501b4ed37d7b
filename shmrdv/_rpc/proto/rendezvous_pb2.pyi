from . import tensor_shape_pb2 as _tensor_shape_pb2
from . import types_pb2 as _types_pb2
from . import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SeriesAckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("dtype", "tensor_shape", "is_dead", "total_bytes", "shmrdv_dtype", "send_start_micros")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SHAPE_FIELD_NUMBER: _ClassVar[int]
    IS_DEAD_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHMRDV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEND_START_MICROS_FIELD_NUMBER: _ClassVar[int]
    dtype: _types_pb2.DataType
    tensor_shape: _tensor_shape_pb2.TensorShapeProto
    is_dead: bool
    total_bytes: int
    shmrdv_dtype: str
    send_start_micros: int
    def __init__(self, dtype: _Optional[_Union[_types_pb2.DataType, str]] = ..., tensor_shape: _Optional[_Union[_tensor_shape_pb2.TensorShapeProto, _Mapping]] = ..., is_dead: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., shmrdv_dtype: _Optional[str] = ..., send_start_micros: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunks(_message.Message):
    __slots__ = ("chunks", "ask")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ASK_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    ask: bool
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., ask: _Optional[bool] = ...) -> None: ...
