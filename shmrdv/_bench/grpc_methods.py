"""Raw grpcio on loopback as ``shmrdv bench`` methods: ``grpc_pull`` (the tensor in the
response of one call, the ack in a second: the baseline of shmrdv's gRPC path),
``grpc_pull_piggyback`` (the ack in the next pull's request: one call per round trip) and
``grpc_push`` (the tensor in the request).

``contract.py`` is the contract they follow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .common import GRPC_OPTIONS
from .contract import (
    F32,
    Ack,
    Handler,
    MethodSpec,
    RoleContext,
    module_missing,
    pack_ack,
    recv_link,
    role_link,
    unpack_ack,
)

__all__ = ["GRPC_PULL", "GRPC_PULL_PIGGYBACK", "GRPC_PUSH"]


# -- all: raw unary methods with identity serializers, their client and their server -------

_SERVICE = "shmrdv.bench.Bench"


def _unary_client(ctx: RoleContext, path: str) -> tuple[Any, Any]:
    """(channel, callable) of ``path`` on the loopback server whose port the other role sends."""
    import grpc

    port = recv_link(role_link(ctx), "gRPC port")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    return channel, call


def _unary_server(
    service: str, handlers: dict[str, Callable[[bytes, Any], bytes]]
) -> tuple[Any, int]:
    """A started loopback server of ``service``'s unary methods, each answered by its
    handler (by method name), and its port."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    rpcs = {
        name: grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=None
        )
        for name, handle in handlers.items()
    }
    generic = grpc.method_handlers_generic_handler(service, rpcs)
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


# -- grpc_push: raw grpcio unary call on 127.0.0.1, the tensor in the REQUEST -------------
# Identity serializers: the request is a.tobytes() (made per handoff, timed, as in grpc_pull
# below), the handler views it with np.frombuffer, the response is the packed ack. Message
# limits are lifted on both ends (the default receive limit is 4 MiB, pitfalls.md §6). The
# ponger is the server. An upload, which grpcio's Python API makes far slower than a
# download: not the baseline of shmrdv's gRPC path, which pulls; grpc_pull below is.


class _GrpcPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._channel, self._call = _unary_client(ctx, f"/{_SERVICE}/Handoff")

    def handoff(self, src: F32) -> Ack:
        return unpack_ack(self._call(src.tobytes(), timeout=600))

    def close(self) -> None:
        self._channel.close()


class _GrpcPonger:
    def __init__(self, ctx: RoleContext) -> None:
        self._link = role_link(ctx)
        self._server: Any = None

    def serve(self, handler: Handler) -> None:
        finished = threading.Event()

        def handle(request: bytes, context: Any) -> bytes:
            a: F32 = np.frombuffer(request, np.float32)
            ack = handler(a)
            del a
            if handler.done:
                finished.set()
            return pack_ack(ack)

        self._server, port = _unary_server(_SERVICE, {"Handoff": handle})
        self._link.send(port)
        finished.wait()

    def close(self) -> None:
        if self._server is not None:
            # The grace lets the stop handoff's response reach the pinger.
            self._server.stop(grace=2.0).wait(5.0)
            self._server = None


def _grpc_available() -> str | None:
    return module_missing("grpc", "grpcio")()


# -- grpc_pull: raw grpcio, the tensor in a RESPONSE (a download), the ack in a second call -
# The like-for-like baseline of shmrdv's gRPC path, where the consumer pulls (TensorFlow's
# RecvTensor) and a round trip is an array there and an ack back: the pinger (producer) is
# the server and holds the tensor, the ponger (consumer) is the client and keeps a Pull call
# parked, as a consumer posts its receive before the value is sent. The handler answers the
# parked call with the next tensor (tobytes(): grpcio's identity serializer takes bytes, so
# every handoff makes the bytes of the array as it is then, inside the timed handoff: the one
# copy every real producer pays for a new tensor, never a prebuilt payload). Then the
# ponger's second unary call, Ack, carries the 32-byte ack back: two calls per round trip,
# as shmrdv's round trip is two receives.
# grpc_pull_piggyback is the same pull with the ack carried in the request of the next Pull
# instead: one call per round trip, the least a user could write with the same library.
# Identity serializers and lifted message limits as above.

_PULL_DONE = b""  # the pinger's answer to a Pull parked when it stops: nothing more comes


class _GrpcPullPinger:
    def __init__(self, ctx: RoleContext) -> None:
        import queue

        self._data: queue.Queue[bytes] = queue.Queue()
        self._acks: queue.Queue[bytes] = queue.Queue()

        def pull(request: bytes, context: Any) -> bytes:
            if request:  # grpc_pull_piggyback: the ack of the previous handoff
                self._acks.put(request)
            return self._data.get()

        def ack(request: bytes, context: Any) -> bytes:
            self._acks.put(request)
            return b""

        self._server: Any
        self._server, port = _unary_server(_SERVICE, {"Pull": pull, "Ack": ack})
        role_link(ctx).send(port)

    def handoff(self, src: F32) -> Ack:
        import queue

        self._data.put(src.tobytes())
        try:
            return unpack_ack(self._acks.get(timeout=600))
        except queue.Empty:
            raise TimeoutError("grpc_pull: no ack from the ponger within 600 s") from None

    def close(self) -> None:
        if self._server is not None:
            self._data.put(_PULL_DONE)  # answers a Pull still parked
            self._server.stop(grace=2.0).wait(5.0)
            self._server = None


class _GrpcPullPonger:
    def __init__(self, ctx: RoleContext) -> None:
        self._channel, self._pull = _unary_client(ctx, f"/{_SERVICE}/Pull")
        self._ack = self._channel.unary_unary(
            f"/{_SERVICE}/Ack", request_serializer=None, response_deserializer=None
        )
        self._piggyback = ctx.method == "grpc_pull_piggyback"

    def serve(self, handler: Handler) -> None:
        ack = b""
        while not handler.done:
            data = self._pull(ack if self._piggyback else b"", timeout=600)
            a: F32 = np.frombuffer(data, np.float32)
            ack = pack_ack(handler(a))
            del a, data
            if not self._piggyback:
                self._ack(ack, timeout=600)
        if self._piggyback:
            self._pull(ack, timeout=60)  # delivers the stop's ack; the answer is _PULL_DONE

    def close(self) -> None:
        self._channel.close()


# -- the specs -----------------------------------------------------------------------------

GRPC_PULL = MethodSpec(
    "grpc_pull",
    "grpcio on 127.0.0.1: a unary call pulls the tensor (in the response, like RecvTensor), "
    "a second unary call carries the ack back; identity serializers",
    _GrpcPullPinger,
    _GrpcPullPonger,
    available=_grpc_available,
    baseline="grpc_pull_piggyback",
    receiver_array="read-only (backed by bytes)",
)

GRPC_PULL_PIGGYBACK = MethodSpec(
    "grpc_pull_piggyback",
    "grpc_pull with the ack in the request of the next pull: one unary call per round trip",
    _GrpcPullPinger,
    _GrpcPullPonger,
    available=_grpc_available,
    receiver_array="read-only (backed by bytes)",
)

GRPC_PUSH = MethodSpec(
    "grpc_push",
    "grpcio unary call on 127.0.0.1, the tensor in the request (an upload), ack in the "
    "response; identity serializers",
    _GrpcPinger,
    _GrpcPonger,
    available=_grpc_available,
    baseline="grpc_pull",
    receiver_array="read-only (backed by bytes)",
)
