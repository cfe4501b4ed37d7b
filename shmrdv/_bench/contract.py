"""The contract every method of ``shmrdv bench`` follows.

Contract
========
A *method* moves a prepared float32 array from a **pinger** to a **ponger** and a tiny
ack back. The runner (``runner.py``, ``pair.py``) spawns one pinger process and, unless the method
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
sweeps it afterwards); ``scratch_dir`` for sockets; ``max_nbytes``; ``pending`` (``--pending N``); ``keys``, the
key pattern of this run of a method that has keys (``MethodSpec.key_patterns``, one of
``common.KEY_PATTERNS``; None for one that has none); and ``handler`` for single-process
methods (``ponger is None``), whose pinger plays both roles.

Acks are four int64s (``Ack``: head stamp, tail stamp, arrival time in
``perf_counter_ns``, an extra word); ``pack_ack`` / ``unpack_ack`` give 32 bytes.
``perf_counter_ns`` is ``CLOCK_MONOTONIC``, system-wide on Linux, so arrival minus
the pinger's start is the one-way time.

Adding a method: write the two factories and a ``MethodSpec`` in a module of its
family, and register it in ``methods.py`` (the one registry, ``METHODS``): the peers'
specs are listed there in report order; ``shmrdv_methods`` (shmrdv's own) and
``iceoryx_methods`` (iceoryx2's) call ``methods.register_method`` when the runner
imports them.
"""

from __future__ import annotations

import importlib.util
import resource
import struct
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "ACK_BYTES",
    "F32",
    "KIND_CHECK",
    "KIND_FAULTS",
    "KIND_PROBE_END",
    "KIND_PROBE_START",
    "KIND_STOP",
    "KIND_TIMED",
    "NBYTES",
    "Ack",
    "Handler",
    "MethodSpec",
    "Pinger",
    "Ponger",
    "Preparer",
    "PullPonger",
    "RoleContext",
    "make_stamp",
    "module_missing",
    "pack_ack",
    "poll_for",
    "recv_link",
    "role_link",
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
NBYTES = struct.Struct("<Q")  # a message's length, ahead of its name or frame


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
            # The fastest full read numpy has (far above memcpy when cached): what is timed is
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
    keys: str | None = None  # the key pattern (common.KEY_PATTERNS) of a method with keys


class Pinger(Protocol):
    def handoff(self, src: F32) -> Ack: ...

    def close(self) -> None: ...


@runtime_checkable
class Preparer(Protocol):
    """A pinger with the optional ``prepare(src)``: it builds its buffer before each handoff,
    untimed (see the module docstring)."""

    def prepare(self, src: F32) -> None: ...


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


def role_link(ctx: RoleContext) -> Connection:
    """The link to the other role; ``RuntimeError`` naming the method if there is none."""
    if ctx.link is None:
        raise RuntimeError(f"{ctx.method}: the runner gave the {ctx.role} no link")
    return ctx.link


def recv_link(conn: Connection, what: str, timeout: float = 60.0) -> Any:
    """The next object on ``conn``, or ``TimeoutError`` after ``timeout`` seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} from the other role within {timeout:g} s")
    return conn.recv()


# A polling role spins for this long, then sleeps 1 ms between looks: between cells (no
# handoff for seconds) it does not hold a CPU; in a cell the gap between handoffs is
# microseconds, so every handoff is found by the spin.
POLL_SPIN_S = 0.5
_POLL_IDLE_SLEEP_S = 0.001
_POLL_TIMEOUT_S = 600.0  # a polling role gives up after this long without a message

_T = TypeVar("_T")


def poll_for(look: Callable[[], _T | None], what: str) -> _T:
    """Busy-poll ``look()`` until it returns something (see ``POLL_SPIN_S``): what a
    polling method's receive does. ``TimeoutError`` naming ``what`` after 10 minutes."""
    got = look()
    if got is not None:
        return got
    spin_until = time.perf_counter() + POLL_SPIN_S
    deadline = time.monotonic() + _POLL_TIMEOUT_S
    while got is None:
        got = look()
        if got is None and time.perf_counter() > spin_until:
            time.sleep(_POLL_IDLE_SLEEP_S)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: nothing received in {_POLL_TIMEOUT_S:g} s")
    return got


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
    ponger blocks in its receive, so its idle CPU share can be measured. ``key_patterns``:
    the key patterns (``common.KEY_PATTERNS``) the method can run, each a run of its own
    when ``--keys`` asks for it; empty for a method that names nothing by key (the peers).
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
    key_patterns: tuple[str, ...] = ()


def module_missing(module: str, dist: str) -> Callable[[], str | None]:
    """An ``available`` that skips the method when ``module`` (of ``dist``) is not installed."""

    def available() -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{dist} not installed"
        return None

    return available
