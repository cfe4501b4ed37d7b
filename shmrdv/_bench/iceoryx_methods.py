"""iceoryx2 as a peer method of ``shmrdv bench``: the same handoff through its shared memory.

iceoryx2 (PyPI ``iceoryx2``, a Rust core with Python bindings) moves samples through a
publish-subscribe service: a publisher *loans* a sample from its data segment, writes the
payload into it and sends it; a subscriber maps that segment once and receives offsets.
Its Python receive hands out a pointer, which becomes a numpy view here. Four methods,
run where the package is installed (like ``ray`` and ``torch``):

* ``iceoryx2_send``: ``np.copyto`` of the prebuilt array into a fresh loan, timed (the
  twin of ``shmrdv_send``, which copies into a pool slot).
* ``iceoryx2_loan``: the producer writes into the loan in the untimed ``prepare`` (as a
  real producer makes its data in place) and the handoff only sends it: no copy at all
  (the twin of ``shmrdv_allocate``).
* ``iceoryx2_poll_send`` / ``iceoryx2_poll_loan``: the same, but both roles busy-poll
  ``receive()`` instead of blocking (the twins of ``shmrdv_busy`` and
  ``shmrdv_busy_allocate``).

Blocking needs a second service: publish-subscribe has no blocking receive, so the
blocking methods pair each direction with an *event* service, whose notifier the sender
signals after ``send`` and whose listener the receiver waits on (iceoryx2's documented
pattern, examples/python/event_based_communication).

The ack (the bench's 32 bytes) comes back the same way, on a second publish-subscribe
service. Every ``/dev/shm`` file starts with the runner's prefix (iceoryx2's
``global.prefix``), and its other files live under the run's scratch directory
(``global.root_path``), so the runner's sweep removes whatever a killed role leaves.

Sizing: the data service keeps the fewest samples a ping-pong needs (one subscriber, a
buffer of one, one borrowed, one loaned) and the publisher's slots are ``max_nbytes``
each, allocated once (``AllocationStrategy.Static``). iceoryx2's defaults would reserve
34 slots (8 subscribers, buffers of 2, ...): a 570 MB file for 16 MiB samples, against
the 50 MB of the 3 slots used here (``reserved_bytes`` measures it).

Read-only: the subscriber maps the publisher's segment read-only, although the buffer
that ``Sample.payload()`` describes claims to be writable (a write kills the process with
SIGSEGV); the view handed to the handler is marked read-only to say so.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .contract import (
    ACK_BYTES,
    Ack,
    MethodSpec,
    Pinger,
    Ponger,
    PullPonger,
    RoleContext,
    poll_for,
    recv_link,
    role_link,
    unpack_ack,
)
from .methods import register_method

__all__ = [
    "iceoryx_available",
    "iceoryx_pinger",
    "iceoryx_ponger",
    "iceoryx_sweep",
    "reserved_bytes",
]

F32 = npt.NDArray[np.float32]

# A listener's unix socket is <root_path><prefix><a 30-digit id>.event, and a socket path
# holds at most 107 bytes (sun_path).
_SOCKET_PATH_MAX = 107
_EVENT_NAME_BYTES = 36


def iceoryx_available() -> str | None:
    """``None`` where the ``iceoryx2`` package imports, else why the methods are skipped."""
    try:
        importlib.import_module("iceoryx2")
    except ImportError as e:
        return f"iceoryx2 not installed ({e})"
    return None


def _iox() -> Any:
    return importlib.import_module("iceoryx2")


class _Names:
    """The two roles' service names, from the runner's prefix and the method."""

    def __init__(self, ctx: RoleContext) -> None:
        stem = f"{ctx.prefix}{ctx.method}"
        self.data = f"{stem}/data"
        self.ack = f"{stem}/ack"
        self.data_ready = f"{stem}/data_ready"
        self.ack_ready = f"{stem}/ack_ready"


def _node(ctx: RoleContext) -> Any:
    """A node whose files carry the runner's prefix and live under its scratch directory.

    Signal handling is off: iceoryx2 would otherwise take SIGTERM, which the bench's
    children turn into ``SystemExit`` (``_procs``).
    """
    iox = _iox()
    root = os.path.join(ctx.scratch_dir, "iox") + "/"
    if len(os.fsencode(root + ctx.prefix)) + _EVENT_NAME_BYTES > _SOCKET_PATH_MAX:
        raise RuntimeError(
            f"iceoryx2's event sockets would live under {root!r}, too long a path for a unix "
            "socket: set TMPDIR to a shorter directory"
        )
    cfg = iox.config.default()
    cfg.global_cfg.prefix = iox.FileName.new(ctx.prefix)
    cfg.global_cfg.root_path = iox.Path.new(root)
    return (
        iox.NodeBuilder.new()
        .config(cfg)
        .signal_handling_mode(iox.SignalHandlingMode.Disabled)
        .create(iox.ServiceType.Ipc)
    )


def _pubsub(node: Any, name: str, create: bool) -> Any:
    """The publish-subscribe service ``name`` of bytes, sized for one ping-pong."""
    iox = _iox()
    builder = (
        node.service_builder(iox.ServiceName.new(name))
        .publish_subscribe(iox.Slice[ctypes.c_uint8])
        .max_publishers(1)
        .max_subscribers(1)
        .max_nodes(2)
        .history_size(0)
        .subscriber_max_buffer_size(1)
        .subscriber_max_borrowed_samples(1)
    )
    return builder.create() if create else builder.open()


def _publisher(service: Any, max_nbytes: int) -> Any:
    iox = _iox()
    return (
        service.publisher_builder()
        .initial_max_slice_len(max_nbytes)
        .allocation_strategy(iox.AllocationStrategy.Static)
        .max_loaned_samples(1)
        .create()
    )


def _event(node: Any, name: str, create: bool) -> Any:
    iox = _iox()
    builder = node.service_builder(iox.ServiceName.new(name)).event()
    return builder.create() if create else builder.open()


class _Views:
    """numpy views of loaned or received payloads; the ctypes array type cached per size."""

    def __init__(self) -> None:
        self._types: dict[int, Any] = {}

    def at(self, address: int, nbytes: int, *, writable: bool) -> F32:
        kind = self._types.get(nbytes)
        if kind is None:
            kind = self._types[nbytes] = ctypes.c_uint8 * nbytes
        a: F32 = np.frombuffer(memoryview(kind.from_address(address)), np.float32)
        if not writable:
            a.flags.writeable = False
        return a


class _End:
    """What both roles hold: a node, one publisher and one subscriber, and, when they block,
    one notifier (signalled after each send) and one listener (waited on to receive)."""

    def __init__(self, ctx: RoleContext, *, sends: str, receives: str, create: bool) -> None:
        names = _Names(ctx)
        self.blocking = "_poll" not in ctx.method
        self.node = _node(ctx)
        by_name = {"data": names.data, "ack": names.ack}
        ready = {"data": names.data_ready, "ack": names.ack_ready}
        out_service = _pubsub(self.node, by_name[sends], create)
        in_service = _pubsub(self.node, by_name[receives], create)
        self.publisher = _publisher(out_service, ctx.max_nbytes if sends == "data" else ACK_BYTES)
        self.subscriber = in_service.subscriber_builder().buffer_size(1).create()
        self.notifier: Any = None
        self.listener: Any = None
        if self.blocking:
            self.notifier = _event(self.node, ready[sends], create).notifier_builder().create()
            self.listener = _event(self.node, ready[receives], create).listener_builder().create()
        self._services: tuple[Any, ...] = (out_service, in_service)

    def publish(self, sample: Any) -> None:
        """Send an initialized sample, then wake the other role if it blocks."""
        sample.send()
        if self.notifier is not None:
            self.notifier.notify()

    def take(self) -> Any:
        """The next sample from the other role: wait for its event, or poll."""
        sub = self.subscriber
        sample = sub.receive()
        if sample is not None:
            return sample
        if self.listener is not None:
            # One notify per sample; a wake-up whose sample was already taken (it came
            # before the wait) finds nothing and waits again. blocking_wait, not
            # timed_wait (which sets a socket timeout per call: one more syscall); with
            # the node's signal handling off, SIGTERM still ends it (_procs: SystemExit).
            while sample is None:
                self.listener.blocking_wait()
                sample = sub.receive()
            return sample
        return poll_for(sub.receive, "iceoryx2")

    def close(self) -> None:
        for port in (self.listener, self.notifier, self.subscriber, self.publisher):
            if port is not None:
                port.delete()
        self.listener = self.notifier = None
        self._services = ()


class _IceoryxPinger:
    def __init__(self, ctx: RoleContext) -> None:
        # the ponger creates the services
        recv_link(role_link(ctx), f"{ctx.method} services", timeout=60.0)
        self._end = _End(ctx, sends="data", receives="ack", create=False)
        self._views = _Views()
        self._loan = ctx.method.endswith("_loan")
        self._ready: Any = None  # the loan that prepare() filled

    def _fill(self, src: F32) -> Any:
        uninit = self._end.publisher.loan_slice_uninit(src.nbytes)
        np.copyto(self._views.at(uninit.payload_ptr, src.nbytes, writable=True), src)
        return uninit.assume_init()

    def prepare(self, src: F32) -> None:
        if self._loan:
            self._ready = self._fill(src)

    def handoff(self, src: F32) -> Ack:
        if self._loan:
            sample, self._ready = self._ready, None
            if sample is None:
                raise RuntimeError("iceoryx2_loan: handoff() without prepare()")
        else:
            sample = self._fill(src)
        self._end.publish(sample)
        del sample
        got = self._end.take()
        try:
            return unpack_ack(ctypes.string_at(got.payload_ptr, ACK_BYTES))
        finally:
            got.delete()

    def close(self) -> None:
        if self._ready is not None:
            self._ready.delete()
            self._ready = None
        self._end.close()


class _IceoryxPonger(PullPonger):
    def __init__(self, ctx: RoleContext) -> None:
        link = role_link(ctx)
        self._end = _End(ctx, sends="ack", receives="data", create=True)
        self._views = _Views()
        self._sample: Any = None
        link.send("services created")

    def receive(self) -> npt.NDArray[Any]:
        sample = self._end.take()
        self._sample = sample
        return self._views.at(sample.payload_ptr, sample.header.number_of_elements, writable=False)

    def release(self) -> None:
        sample, self._sample = self._sample, None
        if sample is not None:
            sample.delete()

    def send_ack(self, data: bytes) -> None:
        uninit = self._end.publisher.loan_slice_uninit(ACK_BYTES)
        ctypes.memmove(uninit.payload_ptr, data, ACK_BYTES)
        self._end.publish(uninit.assume_init())

    def close(self) -> None:
        self.release()
        self._end.close()


def iceoryx_sweep(prefix: str, shared: Mapping[str, Any]) -> None:
    """Remove the management file iceoryx2 leaves in /dev/shm after its last node is gone.

    Runs in the runner once both roles have exited. ``…_node.<version>.global_mgmt`` stays
    behind even after a clean close (iceoryx2 0.10); anything else under ``prefix`` that a
    killed role left is the runner's sweep's.
    """
    with contextlib.suppress(OSError):
        for entry in os.listdir("/dev/shm"):
            if entry.startswith(prefix) and entry.endswith(".global_mgmt"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", entry))


def iceoryx_pinger(ctx: RoleContext) -> Pinger:
    return _IceoryxPinger(ctx)


def iceoryx_ponger(ctx: RoleContext) -> Ponger:
    return _IceoryxPonger(ctx)


def reserved_bytes(max_nbytes: int, *, defaults: bool) -> int:
    """The size of the data segment a publisher of ``max_nbytes`` samples creates up front.

    Creates a throwaway service (``/dev/shm`` files prefixed ``shmrdv_iox_probe<pid>_``,
    the rest in a temporary directory), reads the size, and removes them all. ``defaults``:
    iceoryx2's default service sizing rather than this module's one-ping-pong sizing. The
    file is sparse: a page takes memory once written.
    """
    prefix = f"shmrdv_iox_probe{os.getpid()}_"
    scratch = tempfile.mkdtemp(prefix="iox")
    ctx = RoleContext(
        role="probe",
        method="probe",
        link=None,
        shared={},
        prefix=prefix,
        scratch_dir=scratch,
        max_nbytes=max_nbytes,
    )
    iox = _iox()
    node = _node(ctx)
    name = iox.ServiceName.new(f"{prefix}probe")
    builder = node.service_builder(name).publish_subscribe(iox.Slice[ctypes.c_uint8])
    if defaults:
        service = builder.create()
        publisher = service.publisher_builder().initial_max_slice_len(max_nbytes).create()
    else:
        service = _pubsub(node, f"{prefix}probe", True)
        publisher = _publisher(service, max_nbytes)
    try:
        return sum(
            os.stat(os.path.join("/dev/shm", e)).st_size
            for e in os.listdir("/dev/shm")
            if e.startswith(prefix) and e.endswith(".data")
        )
    finally:
        publisher.delete()
        del service, node
        for e in os.listdir("/dev/shm"):
            if e.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", e))
        shutil.rmtree(scratch, ignore_errors=True)


def _spec(name: str, label: str, baseline: str, idle_cpu: bool) -> MethodSpec:
    return MethodSpec(
        name,
        label,
        iceoryx_pinger,
        iceoryx_ponger,
        available=iceoryx_available,
        sweep=iceoryx_sweep,
        idle_cpu=idle_cpu,
        baseline=baseline,
        receiver_array="read-only view of the publisher's segment",
    )


_REGISTERED: tuple[tuple[str, str, str, bool], ...] = (
    (
        "iceoryx2_send",
        "iceoryx2 publish-subscribe: copy into a loan, send, event wakes the receiver",
        "shmrdv_send",
        True,
    ),
    (
        "iceoryx2_loan",
        "iceoryx2: producer fills a loan (untimed), send, event wakes the receiver",
        "shmrdv_allocate",
        True,
    ),
    (
        "iceoryx2_poll_send",
        "iceoryx2 publish-subscribe: copy into a loan, send, receiver busy-polls",
        "shmrdv_busy",
        False,
    ),
    (
        "iceoryx2_poll_loan",
        "iceoryx2: producer fills a loan (untimed), send, receiver busy-polls",
        "shmrdv_busy_allocate",
        False,
    ),
)

for _name, _label, _baseline, _idle in _REGISTERED:
    register_method(_spec(_name, _label, _baseline, _idle))
del _name, _label, _baseline, _idle
