"""The floors of ``shmrdv bench``: ``memcpy`` (the copy, in one process), ``memcpy_shm``
(the same copy into /dev/shm pages, where a shared-memory ``send`` copies),
``sem_pingpong`` (the notification: two semaphore wake-ups, no copy to speak of), and
``sem_copy``/``sem_fill``/``spin_copy``/``spin_fill`` (a whole shared-memory handoff of
any size with nothing else: the copy, the wake-up or the poll, the ack back).

Every other method is read against them (``contract.py`` is the contract they follow).
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

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
    poll_for,
    recv_link,
    role_link,
    unpack_ack,
)

__all__ = [
    "MEMCPY",
    "MEMCPY_SHM",
    "SEM_COPY",
    "SEM_FILL",
    "SEM_PAYLOAD",
    "SEM_PINGPONG",
    "SPIN_COPY",
    "SPIN_FILL",
]


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


def _unlink(segment: str, *semaphores: str) -> None:
    """Remove a floor's segment and semaphores by name (each may be gone already)."""
    import posix_ipc

    unlinks = [(posix_ipc.unlink_shared_memory, segment)]
    unlinks += [(posix_ipc.unlink_semaphore, name) for name in semaphores]
    for unlink, name in unlinks:
        with contextlib.suppress(posix_ipc.ExistentialError):
            unlink(name)


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
        del self._payload
        self._mm.close()
        for sem in (self._ping, self._pong):
            sem.close()
        _unlink(*self._names)


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


# -- sem_copy, sem_fill, spin_copy, spin_fill: a shared-memory handoff and nothing else ----
# The floor under a same-host send of any size: the array goes into a warm, reused
# /dev/shm segment (one np.copyto, as a shared-memory send copies), the ponger is told,
# makes a zero-copy view, writes the ack into the segment and tells the pinger. No name,
# ring, header, pool or library: what this machine and Python leave for such a handoff.
# * sem_*: told by a posix_ipc semaphore post each way (a blocking receive's floor);
# * spin_*: told by a sequence word in the segment that the other side polls from Python
#   (``poll_for``, as iceoryx2's polling methods: a polling receive's floor);
# * *_copy: the copy is timed (``shmrdv_send``'s floor); *_fill: it is made in the
#   untimed ``prepare`` and the handoff only tells (``shmrdv_allocate``'s floor).
# Layout: a control block of 64 bytes (eight-byte words: the data's sequence, the ack's
# sequence, the data's length in float32s; the 32-byte ack from byte 24), then the data.

_CTL = 64
_DATA_SEQ, _ACK_SEQ, _LENGTH = 0, 1, 2  # word indices
_ACK_AT = 24


def _handoff_names(ctx: RoleContext) -> tuple[str, str, str]:
    stem = f"/{ctx.prefix}{ctx.method}"
    return stem + "_shm", stem + "_ping", stem + "_pong"


class _HandoffEnd:
    """What both roles of a handoff floor hold: the mapping, its words, the semaphores."""

    def __init__(self, ctx: RoleContext, create: bool) -> None:
        import posix_ipc

        self.method = ctx.method
        self.spin = ctx.method.startswith("spin_")
        self.names = shm_name, ping_name, pong_name = _handoff_names(ctx)
        if create:
            size = _CTL + max(ctx.max_nbytes, 4)
            shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=0o600, size=size)
        else:
            shm = posix_ipc.SharedMemory(shm_name)
            size = shm.size
        try:
            self.mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.words = memoryview(self.mm).cast("Q")
        self.ping: Any = None
        self.pong: Any = None
        if not self.spin:
            flags = posix_ipc.O_CREX if create else 0
            self.ping = posix_ipc.Semaphore(ping_name, flags, mode=0o600, initial_value=0)
            self.pong = posix_ipc.Semaphore(pong_name, flags, mode=0o600, initial_value=0)

    def data(self, n: int) -> F32:
        """A view of the first ``n`` float32s of the data."""
        return np.frombuffer(self.mm, np.float32, n, _CTL)

    def wait(self, word: int, old: int) -> int:
        """Poll ``words[word]`` until it is not ``old``; its new value."""
        words = self.words

        def look() -> int | None:
            v = int(words[word])
            return None if v == old else v

        return poll_for(look, self.method)

    def close(self) -> None:
        self.words.release()
        self.mm.close()
        for sem in (self.ping, self.pong):
            if sem is not None:
                sem.close()


class _HandoffPinger:
    def __init__(self, ctx: RoleContext) -> None:
        self._end = _HandoffEnd(ctx, create=True)
        warm = np.frombuffer(self._end.mm, np.uint8)
        warm.fill(0)  # fault the pages in: the segment is warm, as for memcpy_shm
        del warm
        self._fill = ctx.method.endswith("_fill")
        self._view: F32 | None = None
        self._prepared = False
        self._seq = 0
        role_link(ctx).send("ready")

    def _copy(self, src: F32) -> None:
        view = self._view
        if view is None or view.size != src.size:
            view = self._view = self._end.data(src.size)
        np.copyto(view, src.reshape(-1))

    def prepare(self, src: F32) -> None:
        if self._fill:
            self._copy(src)
            self._prepared = True

    def handoff(self, src: F32) -> Ack:
        end = self._end
        if not self._fill:
            self._copy(src)
        elif not self._prepared:
            raise RuntimeError(f"{end.method}: handoff() without prepare()")
        self._prepared = False
        end.words[_LENGTH] = src.size
        seq = self._seq = self._seq + 1
        if end.spin:
            end.words[_DATA_SEQ] = seq  # after the data: x86 keeps stores in order
            end.wait(_ACK_SEQ, seq - 1)
        else:
            end.ping.release()
            end.pong.acquire()
        return unpack_ack(end.mm[_ACK_AT : _ACK_AT + ACK_BYTES])

    def close(self) -> None:
        self._view = None
        end = self._end
        end.close()
        _unlink(*end.names[: 1 if end.spin else 3])


class _HandoffPonger:
    def __init__(self, ctx: RoleContext) -> None:
        recv_link(role_link(ctx), "segment-ready message")
        self._end = _HandoffEnd(ctx, create=False)
        self._seq = 0  # the last data sequence seen (the pinger may be ahead already)

    def serve(self, handler: Handler) -> None:
        end = self._end
        words = end.words
        while not handler.done:
            if end.spin:
                self._seq = end.wait(_DATA_SEQ, self._seq)
            else:
                end.ping.acquire()
            a = end.data(int(words[_LENGTH]))
            ack = handler(a)
            del a
            end.mm[_ACK_AT : _ACK_AT + ACK_BYTES] = pack_ack(ack)
            if end.spin:
                words[_ACK_SEQ] = self._seq
            else:
                end.pong.release()

    def close(self) -> None:
        self._end.close()


def _handoff_floor(name: str, label: str, compared_with: str) -> MethodSpec:
    return MethodSpec(
        name,
        label,
        _HandoffPinger,
        _HandoffPonger,
        available=module_missing("posix_ipc", "posix_ipc"),
        idle_cpu=not name.startswith("spin_"),
        group="floor",
        baseline=compared_with,
        receiver_array="view of the reused segment",
    )


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

SEM_COPY = _handoff_floor(
    "sem_copy",
    "np.copyto into a warm, reused /dev/shm segment, a semaphore post there and one back "
    "(a blocking shared-memory send's floor: no names, ring or library)",
    "shmrdv_send",
)

SEM_FILL = _handoff_floor(
    "sem_fill",
    "sem_copy with the copy made untimed before the handoff (a blocking zero-copy send's floor)",
    "shmrdv_allocate",
)

SPIN_COPY = _handoff_floor(
    "spin_copy",
    "sem_copy told by a word in the segment that the other side polls from Python "
    "(a polling shared-memory send's floor)",
    "shmrdv_busy",
)

SPIN_FILL = _handoff_floor(
    "spin_fill",
    "spin_copy with the copy made untimed before the handoff (a polling zero-copy send's floor)",
    "shmrdv_busy_allocate",
)
