"""The gRPC method paths and size limits both ends of the transport agree on.

The client imports these from here, never from the server: neither end depends on the
other's code, only on this contract.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_INLINE_MAX",
    "EXCHANGE_METHOD",
    "GET_STATUS_METHOD",
    "LINK_INLINE_MAX",
    "MARK_RECV_FINISHED_METHOD",
    "RECV_TENSOR_INLINE_METHOD",
    "RECV_TENSOR_METHOD",
    "RECV_TENSOR_STREAM_METHOD",
    "RELEASE_RECV_METHOD",
]

# TensorFlow registers these by hand (grpc_worker_service_impl.cc, GrpcWorkerMethodName);
# generated stubs would say /tensorflow.grpc.WorkerService/... (research §3.4).
TF_SERVICE: Final = "tensorflow.WorkerService"
SHMRDV_SERVICE: Final = "shmrdv.Rendezvous"
RECV_TENSOR_METHOD: Final = f"/{TF_SERVICE}/RecvTensor"
GET_STATUS_METHOD: Final = f"/{TF_SERVICE}/GetStatus"
MARK_RECV_FINISHED_METHOD: Final = f"/{TF_SERVICE}/MarkRecvFinished"
# shmrdv's own, hand-registered (not in the .proto):
# A RecvTensorRequest in; a chunked stream out (a header, then raw chunks): no 2 GiB ceiling.
RECV_TENSOR_STREAM_METHOD: Final = f"/{SHMRDV_SERVICE}/RecvTensorStream"
# A RecvTensorRequest (with shmrdv's extension fields) in; a TensorFlow RecvTensorResponse
# out for a tensor of at most ``inline_max`` bytes, or empty bytes: "fetch it with
# RecvTensorStream under the same request_id".
RECV_TENSOR_INLINE_METHOD: Final = f"/{SHMRDV_SERVICE}/RecvTensorInline"
# MarkRecvFinishedRequest in, empty response out: the client gave the request_id up.
RELEASE_RECV_METHOD: Final = f"/{SHMRDV_SERVICE}/ReleaseRecv"
# A long-lived stream per consumer and producer. The consumer writes RecvTensorRequests
# (what it wants, acks, cancels: extension fields 1001-1004); the producer answers each
# request_id with one RecvTensorResponse as soon as the value is sent
# (messages.encode_link_value / _error / _fetch): a tensor costs one stream message, no new
# call and no handler wake-up (issue 12).
EXCHANGE_METHOD: Final = f"/{SHMRDV_SERVICE}/Exchange"

# research/pitfalls.md §6: stream in chunks of at most 4 MiB (gRPC's default receive limit).
DEFAULT_CHUNK_BYTES: Final = 4 << 20
# RecvTensorInline answers tensors up to this size in its one response when the request
# does not say (a request may ask for more, up to tensors.MAX_INLINE_BYTES); larger ones
# are streamed in chunks on a thread of their own: measured on loopback, 256 MiB as one
# message took 2.6-3.8 s against 1.5 s streamed in 4 MiB chunks, 16 MiB about the same.
DEFAULT_INLINE_MAX: Final = 1 << 20
# An Exchange stream pushes tensors up to this size itself; larger ones are fetched with
# RecvTensorInline (grpcio's Python streams move a large message at half the speed of a
# unary response: 16 MiB in 33 ms against 14 ms, measured on loopback).
LINK_INLINE_MAX: Final = 1 << 20
