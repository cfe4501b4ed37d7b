"""The floors of ``shmrdv bench``: ``memcpy`` (the copy, in one process), ``memcpy_shm``
(the same copy into /dev/shm pages, where a shared-memory ``send`` copies) and
``sem_pingpong`` (the notification: two semaphore wake-ups, no copy to speak of).

Every other method is read against them (``contract.py`` is the contract they follow).
"""

from __future__ import annotations

import mmap

import numpy as np

from .contract import (
    ACK_BYTES,
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

__all__ = ["MEMCPY", "MEMCPY_SHM", "SEM_PAYLOAD", "SEM_PINGPONG"]


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


# -- memcpy_shm: the copy floor of a shared-memory send ------------------------------------
# The same copy into a warm mapping of a /dev/shm segment. numpy advises its own large
# arrays into transparent huge pages, which tmpfs pages need a mount option or
# ``shmem_enabled`` for; so on many machines a copy into shared memory is slower than
# ``memcpy``, whatever the library. The segment is unlinked as soon as it is mapped.


class _MemcpyShmPinger:
    def __init__(self, ctx: RoleContext) -> None:
        if ctx.handler is None:
            raise RuntimeError("memcpy_shm runs in one process and needs the handler")
        self._handler = ctx.handler
        self._name = f"/{ctx.prefix}memcpy_shm"
        self._mm: mmap.mmap | None = None
        self._dst: F32 | None = None

    def handoff(self, src: F32) -> Ack:
        dst = self._dst
        if dst is None or dst.shape != src.shape:
            dst = self._dst = self._map(src)
        np.copyto(dst, src)
        return self._handler(dst)

    def _map(self, src: F32) -> F32:
        import posix_ipc

        # The last size's mapping goes with its last view (an array may still hold it).
        self._dst = self._mm = None
        size = max(src.nbytes, 1)
        shm = posix_ipc.SharedMemory(self._name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            self._mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
            shm.unlink()
        dst: F32 = np.frombuffer(self._mm, np.float32, src.size).reshape(src.shape)
        dst.fill(0)  # fault the pages in: the destination is warm, as for memcpy
        return dst

    def close(self) -> None:
        self._dst = self._mm = None  # unmapped with its last view


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
        role_link(ctx).send("ready")

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

        recv_link(role_link(ctx), "segment-ready message")
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


# -- the specs -----------------------------------------------------------------------------

MEMCPY = MethodSpec(
    "memcpy",
    "np.copyto into a warm preallocated array, one process (copy floor)",
    _MemcpyPinger,
    group="floor",
    idle_cpu=False,
    receiver_array="writable, private",
)

MEMCPY_SHM = MethodSpec(
    "memcpy_shm",
    "np.copyto into a warm mapping of a /dev/shm segment, one process (a shm send's copy floor)",
    _MemcpyShmPinger,
    available=module_missing("posix_ipc", "posix_ipc"),
    group="floor",
    idle_cpu=False,
    receiver_array="writable, shared memory",
)

SEM_PINGPONG = MethodSpec(
    "sem_pingpong",
    "bare posix_ipc semaphore pair, 64 B in a reused segment (notification floor)",
    _SemPinger,
    _SemPonger,
    available=module_missing("posix_ipc", "posix_ipc"),
    fixed_nbytes=SEM_PAYLOAD,
    group="floor",
    receiver_array="view of the reused segment",
)
