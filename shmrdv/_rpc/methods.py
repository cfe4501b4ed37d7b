"""The gRPC method paths and size limits both ends of the transport agree on.

The client imports these from here, never from the server: neither end depends on the
other's code, only on this contract.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_INLINE_MAX",
    "GET_STATUS_METHOD",
    "MARK_RECV_FINISHED_METHOD",
    "RECV_TENSOR_METHOD",
    "RECV_TENSOR_SERIES_ACK_METHOD",
    "RECV_TENSOR_SERIES_METHOD",
    "RECV_TENSOR_STREAM_METHOD",
    "SERVER_STOPPING",
]

# TensorFlow registers these by hand (grpc_worker_service_impl.cc, GrpcWorkerMethodName);
# generated stubs would say /tensorflow.grpc.WorkerService/... (research §3.4).
TF_SERVICE: Final = "tensorflow.WorkerService"
SHMRDV_SERVICE: Final = "shmrdv.Rendezvous"
RECV_TENSOR_METHOD: Final = f"/{TF_SERVICE}/RecvTensor"
GET_STATUS_METHOD: Final = f"/{TF_SERVICE}/GetStatus"
MARK_RECV_FINISHED_METHOD: Final = f"/{TF_SERVICE}/MarkRecvFinished"
# shmrdv's own, hand-registered (protos/shmrdv/rendezvous.proto describes it), kept because it measures faster
# than RecvTensor for large tensors and has no 2 GiB ceiling: a RecvTensorRequest in; a
# chunked stream out (a header, then raw chunks). A shmrdv client asks RecvTensor with
# ``inline_max`` (extension field 1002); the server answers a larger tensor with empty
# bytes ("stream it") and keeps it cached under the request_id for this method.
RECV_TENSOR_STREAM_METHOD: Final = f"/{SHMRDV_SERVICE}/RecvTensorStream"
# shmrdv's own, for a key that carries a series of values (a channel): a
# RecvTensorRequest in; out, every value of that key as it is sent, each as the
# TensorChunk messages of RecvTensorStream, back to back (TensorChunks, several values
# to a message when they are there already), until the consumer cancels or
# the key stays idle. Kept because it measures faster than one RecvTensor per value: a
# pipeline of 1,000 64 KiB tensors x0.11 -> x0.98-1.14 of raw grpcio streaming, 100 of
# 16 MiB x0.52-0.74 -> x0.94-1.03 (bench --pipeline, same session; series_client.py).
RECV_TENSOR_SERIES_METHOD: Final = f"/{SHMRDV_SERVICE}/RecvTensorSeries"
# shmrdv's own, with RecvTensorSeries: a RecvTensorRequest naming a series (its
# request_id, step and key) and how many of its values the consumer holds (``held``):
# the producer keeps them no longer (a series re-opened after a dropped connection says
# the same in its request, and gets again what it lacks). Empty bytes out.
RECV_TENSOR_SERIES_ACK_METHOD: Final = f"/{SHMRDV_SERVICE}/RecvTensorSeriesAck"

# research/pitfalls.md §6: stream in chunks of at most 4 MiB (gRPC's default receive limit).
DEFAULT_CHUNK_BYTES: Final = 4 << 20
# A shmrdv client asks for tensors up to this size in RecvTensor's one response; larger
# ones are streamed in chunks (RecvTensorStream). Measured on loopback (issue 19, same
# run): 16 MiB took 40-150 ms as one RecvTensor response from the aio server against
# 20-30 ms streamed in 4 MiB chunks; 256 MiB as one message took 2.6-3.8 s against 1.5 s.
DEFAULT_INLINE_MAX: Final = 1 << 20

# The words an UNAVAILABLE status from a shmrdv server that is shutting down carries: its
# producer is gone for good (a restarted one has a new address and incarnation), so a
# client fails its receive at once instead of retrying (issue 19, bug 3a).
SERVER_STOPPING: Final = "is stopping"
