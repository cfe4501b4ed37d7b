"""The methods ``shmrdv bench`` measures, and the contract every method follows.

Contract
========
A *method* moves a prepared float32 array from a **pinger** to a **ponger** and a tiny
ack back. The runner (``runner.py``) spawns one pinger process and, unless the method
is single-process, one ponger process per method (``multiprocessing`` *spawn*
context); both live for every size of the run. The runner owns the measurement loop;
a method only supplies two objects, each built in its process by a top-level factory
(spawn pickles factories by reference, so they must live at module level):

``spec.pinger(ctx: RoleContext) -> Pinger``
    ``handoff(src) -> Ack`` hands the *contents* of ``src`` to the ponger and blocks
    until the ponger's ack is back. The runner stamps ``src[0]``/``src[-1]`` before
    the call and times it (the round trip). A method may copy ``src`` anywhere
    (``rdv.allocate`` + ``np.copyto`` + ``send`` is fine) but must not modify it.
    ``close()`` frees everything; it also runs after an error. An optional
    ``prepare(src)``, called untimed right before each ``handoff(src)``, lets a
    zero-copy producer build its buffer (``rdv.allocate`` + fill) the way a real
    producer writes its data in place; ``handoff`` then only hands it over.

``spec.ponger(ctx: RoleContext) -> Ponger``
    ``serve(handler) -> None`` loops: receive, hold a usable ``ndarray``, call
    ``ack = handler(a)`` at once (it timestamps the arrival, reads the stamp and,
    when asked, CRCs the array), drop every reference to the array and free what
    backs it, then send ``ack`` back. It returns after sending the ack of the
    handoff that set ``handler.done``. ``close()`` as above. ``PullPonger`` turns
    ``receive`` / ``release`` / ``send_ack`` into ``serve``.

``RoleContext`` carries what a role needs: ``link``, a duplex
``multiprocessing.Connection`` between the two roles (for bootstrap such as a port,
or as the data channel); ``shared``, what ``spec.make_shared(mp_context)`` returned
in the runner (queues, a namespace token, any small setup dict; passed at spawn);
``prefix``, which starts every ``/dev/shm`` name the method creates (the runner
sweeps it afterwards); ``scratch_dir`` for sockets; ``max_nbytes``; ``pending`` (``--pending N``); and ``handler``
for single-process methods (``ponger is None``), whose pinger plays both roles.

Acks are four int64s (``Ack``: head stamp, tail stamp, arrival time in
``perf_counter_ns``, an extra word); ``pack_ack`` / ``unpack_ack`` give 32 bytes.
``perf_counter_ns`` is ``CLOCK_MONOTONIC``, system-wide on Linux, so arrival minus
the pinger's start is the one-way time.

Adding a method: write the two factories, then ``register_method(MethodSpec(...))``
at import time of the module that holds them (the runner imports the modules of its
``PLUGIN_MODULES``: ``shmrdv_methods``, shmrdv's own, and ``iceoryx_methods``, iceoryx2's,
a peer big enough for a file of its own). The other peers live in this file.
"""

from __future__ import annotations

import importlib
import importlib.util
import mmap
import os
import pickle
import resource
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from .common import GRPC_OPTIONS

__all__ = [
    "ALIASES",
    "KIND_CHECK",
    "KIND_FAULTS",
    "KIND_PROBE_END",
    "KIND_PROBE_START",
    "KIND_STOP",
    "KIND_TIMED",
    "METHODS",
    "Ack",
    "Handler",
    "MethodSpec",
    "Pinger",
    "Ponger",
    "PullPonger",
    "RoleContext",
    "make_stamp",
    "pack_ack",
    "pipe_oob_recv",
    "pipe_oob_send",
    "register_method",
    "unpack_ack",
]

F32 = npt.NDArray[np.float32]

# -- stamps ------------------------------------------------------------------------------
# The stamp written into src[0] and src[-1] is seq * 8 + kind. It must be exact in
# float32, whose integers are exact up to 2**24: seq stays below 2**21.
KIND_TIMED = 0  # a timed handoff
KIND_CHECK = 1  # untimed; the ponger CRC32s the whole array into Ack.extra
KIND_PROBE_START = 2  # idle-CPU probe starts: the ponger notes its CPU time
KIND_PROBE_END = 3  # idle-CPU probe ends: Ack.extra = CPU share in parts per million
KIND_STOP = 4  # last handoff: the ponger acks it and leaves serve()
KIND_FAULTS = 5  # untimed; Ack.extra = the ponger's minor page faults so far (getrusage)
_KIND_BITS = 8
SEQ_LIMIT = 2**24 // _KIND_BITS


def make_stamp(seq: int, kind: int) -> int:
    """The stamp for handoff number ``seq`` (wrapped to stay exact in float32)."""
    return (seq % (SEQ_LIMIT - 1) + 1) * _KIND_BITS + kind


class Ack(NamedTuple):
    """What a ponger sends back: the two stamps it read, its arrival time, one extra word."""

    head: int
    tail: int
    t_recv_ns: int
    extra: int


_ACK = struct.Struct("<qqqq")
ACK_BYTES = _ACK.size


def pack_ack(ack: Ack) -> bytes:
    """``ack`` as 32 bytes."""
    return _ACK.pack(*ack)


def unpack_ack(data: bytes | bytearray | memoryview) -> Ack:
    """The ``Ack`` in the first 32 bytes of ``data``."""
    return Ack(*_ACK.unpack_from(data))


class Handler:
    """The ponger-side check of one received array; ``done`` turns True on the stop handoff.

    Call it as soon as a usable array is held; it does not keep the array. It never
    blocks; a CRC of a large array takes a while, but only on the untimed check handoffs.
    ``touch`` (``--touch``): it also reads every byte of every array, as a consumer that
    uses its data does (the read is timed: it is part of the round trip, not the one-way).
    """

    def __init__(self, touch: bool = False) -> None:
        self.touch = touch
        self.done = False
        self.handled = 0
        self._probe_cpu_ns = 0
        self._probe_wall_ns = 0

    def __call__(self, a: npt.NDArray[Any]) -> Ack:
        t_recv = time.perf_counter_ns()
        head = int(a[0])
        tail = int(a[-1])
        kind = head % _KIND_BITS
        extra = 0
        if self.touch:
            # The fastest full read numpy has (~60 GB/s when cached): what is timed is
            # reaching the bytes (mapping, faults, cache misses), not arithmetic.
            extra = int(a.reshape(-1).view(np.uint8).max())
        if kind == KIND_CHECK:
            extra = zlib.crc32(a.data)
        elif kind == KIND_PROBE_START:
            self._probe_cpu_ns = time.process_time_ns()
            self._probe_wall_ns = t_recv
        elif kind == KIND_PROBE_END:
            cpu = time.process_time_ns() - self._probe_cpu_ns
            wall = max(1, t_recv - self._probe_wall_ns)
            extra = cpu * 1_000_000 // wall
        elif kind == KIND_FAULTS:
            # After the touch: the faults of this array's read count with this handoff.
            extra = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        elif kind == KIND_STOP:
            self.done = True
        self.handled += 1
        return Ack(head, tail, t_recv, extra)


# -- roles ---------------------------------------------------------------------------------


@dataclass
class RoleContext:
    """What the runner gives a role's factory (see the module docstring)."""

    role: str
    method: str
    link: Connection | None
    shared: Mapping[str, Any]
    prefix: str
    scratch_dir: str
    max_nbytes: int
    handler: Handler | None = None
    pending: int = 0  # --pending N: receives the ponger keeps waiting on unsent keys


class Pinger(Protocol):
    def handoff(self, src: F32) -> Ack: ...

    def close(self) -> None: ...


class Ponger(Protocol):
    def serve(self, handler: Handler) -> None: ...

    def close(self) -> None: ...


class PullPonger:
    """A ``Ponger`` built from three steps; subclasses override them."""

    def receive(self) -> npt.NDArray[Any]:
        """Block until an array arrives; return it."""
        raise NotImplementedError

    def release(self) -> None:
        """Free what backed the last array (the caller has dropped its reference)."""

    def send_ack(self, data: bytes) -> None:
        """Send the packed ack back to the pinger."""
        raise NotImplementedError

    def serve(self, handler: Handler) -> None:
        while not handler.done:
            a = self.receive()
            ack = handler(a)
            del a
            self.release()
            self.send_ack(pack_ack(ack))

    def close(self) -> None:
        pass


def _link(ctx: RoleContext) -> Connection:
    if ctx.link is None:
        raise RuntimeError(f"{ctx.method}: the runner gave the {ctx.role} no link")
    return ctx.link


def _recv_link(conn: Connection, what: str, timeout: float = 60.0) -> Any:
    """The next object on ``conn``, or ``TimeoutError`` after ``timeout`` seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} from the other role within {timeout:g} s")
    return conn.recv()


# -- method registry -------------------------------------------------------------------------


def _always() -> str | None:
    return None


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method.

    ``available()`` runs in the runner: ``None`` if the method can run, else why it is
    skipped. ``make_shared(mp_context)`` (runner, optional) returns objects handed to
    both roles at spawn. ``sweep(prefix, shared)`` (runner, optional) removes leftovers
    after the method's processes are gone; the runner then unlinks whatever is left
    under ``prefix``. ``baseline``: a further method the report and the JSON compare
    this one with (and that ``--methods`` adds), beside memcpy and mp_pipe_oob. ``mode``:
    the method belongs to that mode (``--pending``) and runs in it only. ``fixed_nbytes``: the method runs at that one size
    only, whatever the sizes asked (a floor reported on its own). ``idle_cpu``: the
    ponger blocks in its receive, so its idle CPU share can be measured.
    """

    name: str
    label: str
    pinger: Callable[[RoleContext], Pinger]
    ponger: Callable[[RoleContext], Ponger] | None = None
    available: Callable[[], str | None] = _always
    make_shared: Callable[[BaseContext], dict[str, Any]] | None = None
    sweep: Callable[[str, Mapping[str, Any]], None] | None = None
    idle_cpu: bool = True
    fixed_nbytes: int | None = None
    group: str = "peer"  # "floor", "shmrdv" or "peer": the report's row order
    baseline: str | None = None  # the method this one is also compared with, e.g. grpc_pull
    mode: str | None = None  # runs only in that mode of the bench ("pending"), not by default
    receiver_array: str = ""
    notes: str = field(default="")


METHODS: dict[str, MethodSpec] = {}
ALIASES = {"grpc_unary": "grpc_push"}  # the push's name before grpc_pull existed


def register_method(spec: MethodSpec) -> None:
    """Add (or replace) a method in ``METHODS``."""
    METHODS[spec.name] = spec


def _module_missing(module: str, dist: str) -> Callable[[], str | None]:
    def available() -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{dist} not installed"
        return None

    return available


# -- memcpy: the copy floor, in one process ---------------------------------------------


class _MemcpyPinger:
    def __init__(self, ctx: RoleContext) -> None:
        if ctx.handler is None:
            raise RuntimeError("memcpy runs in one process and needs the handler")
        self._handler = ctx.handler
        self._dst: F32 | None = None

    def handoff(self, src: F32) -> Ack:
        dst = self._dst
        if dst is None or dst.shape != src.shape:
            dst = np.empty_like(src)
            dst.fill(0)  # fault the pages in: the destination is warm, as its name says
            self._dst = dst
        np.copyto(dst, src)
        return self._handler(dst)

    def close(self) -> None:
        self._dst = None


def memcpy_pinger(ctx: RoleContext) -> Pinger:
    return _MemcpyPinger(ctx)


# -- mp_pipe_oob: multiprocessing.Pipe, pickle protocol 5, out-of-band buffers -----------
# Message: send_bytes(<uint32 buffer count> + pickle), then each buffer with send_bytes.
# The ack goes back on the same duplex Pipe.

_COUNT = struct.Struct("<I")


def pipe_oob_send(conn: Connection, a: npt.NDArray[Any]) -> None:
    """Send ``a`` on ``conn`` as pickle protocol 5 with its buffers out of band."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(a, protocol=5, buffer_callback=buffers.append)
    conn.send_bytes(_COUNT.pack(len(buffers)) + head)
    for buf in buffers:
        conn.send_bytes(buf.raw())


def pipe_oob_recv(conn: Connection) -> npt.NDArray[Any]:
    """The next array that ``pipe_oob_send`` sent on ``conn``'s other end."""
    msg = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(msg)
    buffers = [conn.recv_bytes() for _ in range(count)]
    a: npt.NDArray[Any] = pickle.loads(memoryview(msg)[_COUNT.size :], buffers=buffers)
    return a


class _PipeOobPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = _link(ctx)

    def handoff(self, src: F32) -> Ack:
        pipe_oob_send(self._conn, src)
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        pass


class _PipeOobPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = _link(ctx)

    def receive(self) -> npt.NDArray[Any]:
        return pipe_oob_recv(self._conn)

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)


def pipe_oob_pinger(ctx: RoleContext) -> Pinger:
    return _PipeOobPinger(ctx)


def pipe_oob_ponger(ctx: RoleContext) -> Ponger:
    return _PipeOobPonger(ctx)


# -- mp_queue: multiprocessing.Queue put/get; acks on the link Pipe ---------------------


def _queue_shared(mp_context: BaseContext) -> dict[str, Any]:
    return {"queue": mp_context.Queue()}


class _QueuePinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._queue = ctx.shared["queue"]
        self._conn = _link(ctx)

    def handoff(self, src: F32) -> Ack:
        # put() pickles src later in the feeder thread; src is not touched before the ack.
        self._queue.put(src)
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        self._queue.close()
        self._queue.join_thread()


class _QueuePonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        self._queue = ctx.shared["queue"]
        self._conn = _link(ctx)

    def receive(self) -> npt.NDArray[Any]:
        a: npt.NDArray[Any] = self._queue.get()
        return a

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)


def queue_pinger(ctx: RoleContext) -> Pinger:
    return _QueuePinger(ctx)


def queue_ponger(ctx: RoleContext) -> Ponger:
    return _QueuePonger(ctx)


# -- shm_per_msg: a new multiprocessing.shared_memory segment per message ----------------
# Resource tracker (research/pitfalls.md §1, cpython#82300): on 3.11 every
# SharedMemory() registers its name with the tracker, and a tracker unlinks what is
# still registered when its last user exits. Both roles are spawned by the runner and
# so share the runner's tracker, whose cache is a set: the pinger's create registers,
# the ponger's attach re-registers (no-op), the ponger's unlink() unregisters. The
# pinger only close()s and never unlinks or unregisters, which would trip the tracker's
# KeyError (cpython#116849). The runner sweeps the prefix if a role dies mid-message.

_NBYTES = struct.Struct("<Q")


class _ShmPerMsgPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = _link(ctx)
        self._prefix = ctx.prefix
        self._seq = 0

    def handoff(self, src: F32) -> Ack:
        from multiprocessing import shared_memory

        self._seq += 1
        name = f"{self._prefix}m{self._seq}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=src.nbytes)
        try:
            dst: F32 = np.ndarray(src.shape, src.dtype, buffer=shm.buf)
            np.copyto(dst, src)
            del dst
        finally:
            shm.close()
        self._conn.send_bytes(_NBYTES.pack(src.nbytes) + name.encode())
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        pass


class _ShmPerMsgPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        self._conn = _link(ctx)
        self._shm: Any = None

    def receive(self) -> npt.NDArray[Any]:
        from multiprocessing import shared_memory

        msg = self._conn.recv_bytes()
        (nbytes,) = _NBYTES.unpack_from(msg)
        name = msg[_NBYTES.size :].decode()
        shm = shared_memory.SharedMemory(name=name)
        self._shm = shm
        a: F32 = np.ndarray((nbytes // 4,), np.float32, buffer=shm.buf)
        return a

    def release(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
            shm.unlink()

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)

    def close(self) -> None:
        self.release()


def _shm_per_msg_sweep(prefix: str, shared: Mapping[str, Any]) -> None:
    """Unlink segments a killed role left, and drop them from the runner's tracker.

    Runs in the runner, whose resource tracker the roles share: without the
    unregister, the tracker would try to unlink them again at exit and warn.
    """
    from multiprocessing import resource_tracker

    stem = prefix + "m"
    for entry in os.listdir("/dev/shm"):
        if entry.startswith(stem) and entry[len(stem) :].isdigit():
            try:
                os.unlink(os.path.join("/dev/shm", entry))
            except OSError:
                continue
            resource_tracker.unregister("/" + entry, "shared_memory")


def shm_per_msg_pinger(ctx: RoleContext) -> Pinger:
    return _ShmPerMsgPinger(ctx)


def shm_per_msg_ponger(ctx: RoleContext) -> Ponger:
    return _ShmPerMsgPonger(ctx)


# -- sem_pingpong: bare posix_ipc semaphore pair, 64-byte payload in a reused segment ----
# The notification floor: no serialization, no allocation, only two semaphore
# wake-ups. Layout: payload in bytes [0, 64), ack in [64, 96). The pinger creates
# everything with O_CREX and unlinks it on close; the ponger opens with size 0 and
# takes the length from the segment (pitfalls.md §2: a size on open would resize).

SEM_PAYLOAD = 64
_SEM_SEGMENT = SEM_PAYLOAD + ACK_BYTES


def _sem_names(prefix: str) -> tuple[str, str, str]:
    return f"/{prefix}pp_shm", f"/{prefix}pp_ping", f"/{prefix}pp_pong"


class _SemPinger:
    def __init__(self, ctx: RoleContext) -> None:
        import posix_ipc

        self._names = _sem_names(ctx.prefix)
        shm_name, ping_name, pong_name = self._names
        shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=0o600, size=_SEM_SEGMENT)
        try:
            self._mm = mmap.mmap(shm.fd, _SEM_SEGMENT)
        finally:
            shm.close_fd()
        self._ping = posix_ipc.Semaphore(ping_name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self._pong = posix_ipc.Semaphore(pong_name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self._payload: F32 = np.frombuffer(self._mm, np.float32, SEM_PAYLOAD // 4)
        _link(ctx).send("ready")

    def handoff(self, src: F32) -> Ack:
        if src.nbytes != SEM_PAYLOAD:
            raise ValueError(f"sem_pingpong moves {SEM_PAYLOAD} bytes, not {src.nbytes}")
        np.copyto(self._payload, src)
        self._ping.release()
        self._pong.acquire()
        return unpack_ack(self._mm[SEM_PAYLOAD:_SEM_SEGMENT])

    def close(self) -> None:
        import posix_ipc

        del self._payload
        self._mm.close()
        for sem in (self._ping, self._pong):
            sem.close()
        for unlink, name in zip(
            (
                posix_ipc.unlink_shared_memory,
                posix_ipc.unlink_semaphore,
                posix_ipc.unlink_semaphore,
            ),
            self._names,
        ):
            try:
                unlink(name)
            except posix_ipc.ExistentialError:
                pass


class _SemPonger:
    def __init__(self, ctx: RoleContext) -> None:
        import posix_ipc

        _recv_link(_link(ctx), "segment-ready message")
        shm_name, ping_name, pong_name = _sem_names(ctx.prefix)
        shm = posix_ipc.SharedMemory(shm_name)
        try:
            self._mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        self._ping = posix_ipc.Semaphore(ping_name)
        self._pong = posix_ipc.Semaphore(pong_name)

    def serve(self, handler: Handler) -> None:
        while not handler.done:
            self._ping.acquire()
            a: F32 = np.frombuffer(self._mm, np.float32, SEM_PAYLOAD // 4)
            ack = handler(a)
            del a
            self._mm[SEM_PAYLOAD:_SEM_SEGMENT] = pack_ack(ack)
            self._pong.release()

    def close(self) -> None:
        self._mm.close()
        self._ping.close()
        self._pong.close()


def sem_pinger(ctx: RoleContext) -> Pinger:
    return _SemPinger(ctx)


def sem_ponger(ctx: RoleContext) -> Ponger:
    return _SemPonger(ctx)


# -- grpc_push: raw grpcio unary call on 127.0.0.1, the tensor in the REQUEST -------------
# Identity serializers: the request is a.tobytes() (made per handoff, timed, as in grpc_pull
# below), the handler views it with
# np.frombuffer, the response is the packed ack. Message limits are lifted on both
# ends (the default receive limit is 4 MiB, pitfalls.md §6). The ponger is the server.
# An upload: in grpcio's Python API 3-4x slower than a download (issue 12 §1), so it is
# not the baseline of shmrdv's gRPC path, which pulls; grpc_pull below is.

_GRPC_METHOD = "/shmrdv.bench.Bench/Handoff"


class _GrpcPinger:
    def __init__(self, ctx: RoleContext) -> None:
        import grpc

        port = _recv_link(_link(ctx), "gRPC port")
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        grpc.channel_ready_future(self._channel).result(timeout=30)
        self._call = self._channel.unary_unary(
            _GRPC_METHOD, request_serializer=None, response_deserializer=None
        )

    def handoff(self, src: F32) -> Ack:
        return unpack_ack(self._call(src.tobytes(), timeout=600))

    def close(self) -> None:
        self._channel.close()


class _GrpcPonger:
    def __init__(self, ctx: RoleContext) -> None:
        self._link = _link(ctx)
        self._server: Any = None

    def serve(self, handler: Handler) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        finished = threading.Event()

        def handle(request: bytes, context: Any) -> bytes:
            a: F32 = np.frombuffer(request, np.float32)
            ack = handler(a)
            del a
            if handler.done:
                finished.set()
            return pack_ack(ack)

        rpc = grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=None
        )
        service, method = _GRPC_METHOD.strip("/").split("/")
        generic = grpc.method_handlers_generic_handler(service, {method: rpc})
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        self._server.add_generic_rpc_handlers((generic,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self._link.send(port)
        finished.wait()

    def close(self) -> None:
        if self._server is not None:
            # The grace lets the stop handoff's response reach the pinger.
            self._server.stop(grace=2.0).wait(5.0)
            self._server = None


def grpc_pinger(ctx: RoleContext) -> Pinger:
    return _GrpcPinger(ctx)


def grpc_ponger(ctx: RoleContext) -> Ponger:
    return _GrpcPonger(ctx)


def _grpc_available() -> str | None:
    return _module_missing("grpc", "grpcio")()


# -- grpc_pull: raw grpcio unary call, the tensor in the RESPONSE (a download) --------------
# The like-for-like baseline of shmrdv's gRPC path, where the consumer pulls (TensorFlow's
# RecvTensor): the pinger (producer) is the server and holds the tensor, the ponger
# (consumer) is the client and keeps one call parked, as a consumer posts its receive
# before the value is sent. The handler answers the parked call with the next tensor
# (tobytes(): grpcio's identity serializer takes bytes, so every handoff makes the bytes of
# the array as it is then, inside the timed handoff: the one copy every real producer pays
# for a new tensor, never a prebuilt payload; issue 19 §3); the ponger's next call carries
# the 32-byte ack of the last one in its request. So one handoff is one unary call: the
# best a user could write with the same library, not one call plus a second for the ack.
# Identity serializers and lifted message limits as above.

_GRPC_PULL_METHOD = "/shmrdv.bench.Bench/Pull"
_PULL_DONE = b""  # the pinger's answer to the last parked call: nothing more comes


class _GrpcPullPinger:
    def __init__(self, ctx: RoleContext) -> None:
        import queue
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        self._data: queue.Queue[bytes] = queue.Queue()
        self._acks: queue.Queue[bytes] = queue.Queue()

        def handle(request: bytes, context: Any) -> bytes:
            if request:  # the ack of the previous handoff
                self._acks.put(request)
            return self._data.get()

        rpc = grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=None
        )
        service, method = _GRPC_PULL_METHOD.strip("/").split("/")
        generic = grpc.method_handlers_generic_handler(service, {method: rpc})
        self._server: Any = grpc.server(ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        self._server.add_generic_rpc_handlers((generic,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        _link(ctx).send(port)

    def handoff(self, src: F32) -> Ack:
        import queue

        self._data.put(src.tobytes())
        try:
            return unpack_ack(self._acks.get(timeout=600))
        except queue.Empty:
            raise TimeoutError("grpc_pull: no ack from the ponger within 600 s") from None

    def close(self) -> None:
        if self._server is not None:
            self._data.put(_PULL_DONE)  # answers the ponger's last parked call
            self._server.stop(grace=2.0).wait(5.0)
            self._server = None


class _GrpcPullPonger:
    def __init__(self, ctx: RoleContext) -> None:
        import grpc

        port = _recv_link(_link(ctx), "gRPC port")
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        grpc.channel_ready_future(self._channel).result(timeout=30)
        self._call = self._channel.unary_unary(
            _GRPC_PULL_METHOD, request_serializer=None, response_deserializer=None
        )

    def serve(self, handler: Handler) -> None:
        ack = b""
        while not handler.done:
            data = self._call(ack, timeout=600)
            a: F32 = np.frombuffer(data, np.float32)
            ack = pack_ack(handler(a))
            del a, data
        self._call(ack, timeout=60)  # delivers the stop's ack; the answer is _PULL_DONE

    def close(self) -> None:
        self._channel.close()


def grpc_pull_pinger(ctx: RoleContext) -> Pinger:
    return _GrpcPullPinger(ctx)


def grpc_pull_ponger(ctx: RoleContext) -> Ponger:
    return _GrpcPullPonger(ctx)


# -- zmq_ipc: pyzmq PAIR over ipc://, zero-copy frames --------------------------------------


def _zmq_endpoint(ctx: RoleContext) -> str:
    return f"ipc://{os.path.join(ctx.scratch_dir, ctx.prefix + 'zmq.sock')}"


class _ZmqPinger:
    def __init__(self, ctx: RoleContext) -> None:
        zmq: Any = importlib.import_module("zmq")
        _recv_link(_link(ctx), "zmq bind message")
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(_zmq_endpoint(ctx))

    def handoff(self, src: F32) -> Ack:
        self._sock.send_multipart([_NBYTES.pack(src.nbytes), src], copy=False)
        return unpack_ack(self._sock.recv())

    def close(self) -> None:
        self._sock.close()
        self._zctx.term()


class _ZmqPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        zmq: Any = importlib.import_module("zmq")
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_zmq_endpoint(ctx))
        self._frames: Any = None
        _link(ctx).send("bound")

    def receive(self) -> npt.NDArray[Any]:
        self._frames = self._sock.recv_multipart(copy=False)
        return np.frombuffer(self._frames[1].buffer, np.float32)

    def release(self) -> None:
        self._frames = None

    def send_ack(self, data: bytes) -> None:
        self._sock.send(data)

    def close(self) -> None:
        self._frames = None
        self._sock.close()
        self._zctx.term()


def zmq_pinger(ctx: RoleContext) -> Pinger:
    return _ZmqPinger(ctx)


def zmq_ponger(ctx: RoleContext) -> Ponger:
    return _ZmqPonger(ctx)


# -- torch_mp: torch.multiprocessing Queue with share_memory_(); acks on the link Pipe ---


def _torch_shared(mp_context: BaseContext) -> dict[str, Any]:
    # Importing torch.multiprocessing registers its tensor reducers with
    # multiprocessing's ForkingPickler; the roles import it too before they touch
    # tensors. The queue is a plain multiprocessing queue and passes at spawn.
    importlib.import_module("torch.multiprocessing")
    return {"queue": mp_context.Queue()}


class _TorchPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._torch: Any = importlib.import_module("torch")
        importlib.import_module("torch.multiprocessing")
        self._queue = ctx.shared["queue"]
        self._conn = _link(ctx)

    def handoff(self, src: F32) -> Ack:
        t = self._torch.from_numpy(src)
        t.share_memory_()  # copies into a new shared segment (file_descriptor strategy)
        self._queue.put(t)
        del t
        return unpack_ack(self._conn.recv_bytes())

    def close(self) -> None:
        self._queue.close()
        self._queue.join_thread()


class _TorchPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        importlib.import_module("torch.multiprocessing")
        self._queue = ctx.shared["queue"]
        self._conn = _link(ctx)
        self._tensor: Any = None

    def receive(self) -> npt.NDArray[Any]:
        self._tensor = self._queue.get()
        a: npt.NDArray[Any] = self._tensor.numpy()
        return a

    def release(self) -> None:
        self._tensor = None

    def send_ack(self, data: bytes) -> None:
        self._conn.send_bytes(data)


def torch_pinger(ctx: RoleContext) -> Pinger:
    return _TorchPinger(ctx)


def torch_ponger(ctx: RoleContext) -> Ponger:
    return _TorchPonger(ctx)


# -- ray: ray.put in the driver, an actor method gets the (zero-copy, read-only) array ----
# Single process from the runner's view: the pinger is the Ray driver and Ray starts
# the actor's worker. The local cluster gets num_cpus=2, no dashboard, an object store
# big enough for the largest size, and is shut down on close.


def _make_ray_actor(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class _Consumer:
        def __init__(self, touch: bool) -> None:
            self._handler = Handler(touch)

        def ready(self) -> bool:
            return True

        def handle(self, a: npt.NDArray[Any]) -> Ack:
            return self._handler(a)

    return _Consumer


class _RayPinger:
    def __init__(self, ctx: RoleContext) -> None:
        ray: Any = importlib.import_module("ray")
        self._ray = ray
        # The actor's worker unpickles Handler, so it must import shmrdv from here too.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=max(2 << 30, 4 * ctx.max_nbytes),
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        self._actor = _make_ray_actor(ray).remote(ctx.handler is not None and ctx.handler.touch)
        ray.get(self._actor.ready.remote(), timeout=120)

    def handoff(self, src: F32) -> Ack:
        ref = self._ray.put(src)
        ack: Ack = self._ray.get(self._actor.handle.remote(ref), timeout=600)
        del ref
        return ack

    def close(self) -> None:
        self._ray.shutdown()


def ray_pinger(ctx: RoleContext) -> Pinger:
    return _RayPinger(ctx)


# -- the registry ---------------------------------------------------------------------------

for _spec in (
    MethodSpec(
        "memcpy",
        "np.copyto into a warm preallocated array, one process (copy floor)",
        memcpy_pinger,
        group="floor",
        idle_cpu=False,
        receiver_array="writable, private",
    ),
    MethodSpec(
        "sem_pingpong",
        "bare posix_ipc semaphore pair, 64 B in a reused segment (notification floor)",
        sem_pinger,
        sem_ponger,
        available=_module_missing("posix_ipc", "posix_ipc"),
        fixed_nbytes=SEM_PAYLOAD,
        group="floor",
        receiver_array="view of the reused segment",
    ),
    # shmrdv's own methods go here, registered by the lead's module through
    # register_method() with group="shmrdv": shmrdv_send (Worker rendezvous send/recv
    # over shared memory), shmrdv_allocate (rdv.allocate + fill + send, zero-copy send)
    # and shmrdv_grpc (the same keys forced over transports=("grpc",)).
    MethodSpec(
        "mp_pipe_oob",
        "multiprocessing.Pipe, pickle protocol 5 with out-of-band buffers",
        pipe_oob_pinger,
        pipe_oob_ponger,
        receiver_array="read-only (backed by bytes)",
    ),
    MethodSpec(
        "mp_queue",
        "multiprocessing.Queue put/get (ack on a Pipe)",
        queue_pinger,
        queue_ponger,
        make_shared=_queue_shared,
        receiver_array="writable",
    ),
    MethodSpec(
        "shm_per_msg",
        "new multiprocessing.shared_memory segment per message, name over a Pipe, view",
        shm_per_msg_pinger,
        shm_per_msg_ponger,
        sweep=_shm_per_msg_sweep,
        receiver_array="writable view (segment unlinked after use)",
    ),
    MethodSpec(
        "zmq_ipc",
        "pyzmq PAIR on ipc://, send_multipart(copy=False), np.frombuffer(frame)",
        zmq_pinger,
        zmq_ponger,
        available=_module_missing("zmq", "pyzmq"),
        receiver_array="read-only (zmq frame)",
    ),
    MethodSpec(
        "torch_mp",
        "torch.multiprocessing Queue, from_numpy().share_memory_(), .numpy() (ack on a Pipe)",
        torch_pinger,
        torch_ponger,
        available=_module_missing("torch", "torch"),
        make_shared=_torch_shared,
        receiver_array="writable (shared storage)",
    ),
    MethodSpec(
        "grpc_pull",
        "grpcio unary call on 127.0.0.1, the tensor in the response (a pull, like "
        "RecvTensor), ack in the next request; identity serializers",
        grpc_pull_pinger,
        grpc_pull_ponger,
        available=_grpc_available,
        receiver_array="read-only (backed by bytes)",
    ),
    MethodSpec(
        "grpc_push",
        "grpcio unary call on 127.0.0.1, the tensor in the request (an upload), ack in the "
        "response; identity serializers",
        grpc_pinger,
        grpc_ponger,
        available=_grpc_available,
        baseline="grpc_pull",
        receiver_array="read-only (backed by bytes)",
    ),
    MethodSpec(
        "ray",
        "Ray: ray.put in the driver, an actor method gets it (zero-copy view)",
        ray_pinger,
        available=_module_missing("ray", "ray"),
        idle_cpu=False,
        receiver_array="read-only (object store)",
    ),
):
    register_method(_spec)
del _spec
