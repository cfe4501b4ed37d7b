"""The seam between a Worker's router and its cross-process transports (TensorPipe's
``Transport`` / ``Context`` split): what a transport is given (``TransportContext``, never
the Worker), what it offers (``Transport``), and how peers are found (``PeerDirectory``
over a host's ``PresenceBoard``). The core knows a transport only through these.

The receive contract, said once for every transport: ``start_recv`` returns a canceller
that removes the waiter and returns True (``done`` will then never run), or returns False
when the value is delivered or on its way. Otherwise ``done(error, received)`` runs
exactly once, through ``invoke_done``, never under a lock of the transport, in the calling
thread if the value is already there. ``blocking=True`` means the caller will call
``wait`` until ``done`` has run and ``done`` never blocks, so no other thread need be woken.
A call that cannot start (closed, step aborted) raises a ``RendezvousError`` and never
calls ``done``.

Thread model (``docs/threads.md``): every method may be called from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy.typing as npt

from ._keys import DeviceName, ParsedKey
from ._rendezvous import DoneCallback

if TYPE_CHECKING:
    from ._rendezvous import Canceller, RecvSlot

__all__ = ["PeerDirectory", "PeerRecord", "PeerState", "PresenceBoard", "Sighting", "TaskState"]
__all__ += ["Transport", "TransportContext"]

#: ``"absent"``: no presence record on this host; ``"alive"``: its owner holds its lock;
#: ``"dead"``: a record whose owner is gone (or from another boot).
PeerState = Literal["absent", "alive", "dead"]


@dataclass(frozen=True, slots=True)
class PeerRecord:
    """What this worker knows of another worker's task.

    ``final``: from the peer's own presence record on this host (fixed while it lives);
    a provisional answer (the cluster spec's, before the peer started) is never cached.
    ``incarnation`` and ``pid`` are 0 when unknown.
    """

    task: str  # canonical: /job:<j>/replica:<r>/task:<t>
    same_host: bool
    transports: tuple[str, ...]
    address: str | None
    final: bool
    incarnation: int = 0
    pid: int = 0


@dataclass(frozen=True, slots=True)
class TaskState:
    """A task's state from its presence record on this host (iceoryx2's monitoring
    ``State``); ``record`` is what the record says (None when absent or from another boot)."""

    state: PeerState
    record: PeerRecord | None = None


@dataclass(frozen=True, slots=True)
class Sighting:
    """A presence record of a task found on this host, in some namespace of this user."""

    namespace: str  # as it appears in object names (the namespace id)
    pid: int
    alive: bool
    ours: bool  # in the namespace of the worker that looked


class PeerDirectory(Protocol):
    """Per peer task: where it is and whether it lives. Raises ``InternalError`` for a
    presence record that is not ours or is corrupt; never blocks."""

    def lookup(self, task: DeviceName) -> PeerRecord:
        """Where ``task`` is and what it takes (one ``stat`` while nothing changed)."""
        ...

    def state(self, task: DeviceName) -> TaskState:
        """A fresh look at ``task``, lock-free for the caller (it may run inside the
        garbage collector) and bounded in descriptors."""
        ...

    def sightings(self, task: DeviceName) -> list[Sighting] | None:
        """Where ``task`` has a record on this host in any namespace of this user (None:
        no records kept here). Lists them: for a diagnosis, never per message."""
        ...


class PresenceBoard(Protocol):
    """This host's presence records of one namespace: this worker's own (published until
    ``close``) and its peers' (``PeerDirectory``'s source, by canonical task name)."""

    def publish(
        self, task: str, incarnation: int, address: str | None, transports: tuple[str, ...]
    ) -> None: ...

    def state(self, task: str) -> TaskState: ...

    def sightings(self, task: str) -> list[Sighting] | None: ...

    def close(self) -> None:
        """Withdraw the published record and release every descriptor. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What a transport is given of its worker (never the Worker itself)."""

    task: DeviceName  # this worker's task, canonical (job, replica, task set)
    task_name: str  # str(task)
    incarnation: int
    namespace: str  # the job's namespace token (secret: names its OS objects)
    peers: PeerDirectory
    cleaned_up: Callable[[int], bool]  # has Worker.cleanup(step_id) run (and is remembered)?
    # Backpressure: bytes in flight to one consumer task at most (None: no window).
    max_inflight_bytes: int | None = None


class Transport(Protocol):
    """One cross-process transport of a Worker (shared memory or gRPC); ``Rendezvous``'s
    calls for one step, with the contract of the module docstring."""

    name: str

    def can_reach(self, peer: PeerRecord) -> bool:
        """Whether this transport can carry keys to and from ``peer`` (TensorPipe's
        ``canCommunicateWithRemote``)."""
        ...

    def explain_wait(self, peer: PeerRecord) -> str | None:
        """Why a receive from ``peer`` may be waiting, as this transport sees it (None:
        nothing to tell). For a timeout or ``stats()``; blocks a short probe at most."""
        ...

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None,
    ) -> None:
        """``Rendezvous.send``: blocks only for room in a full ``max_inflight_bytes`` window."""
        ...

    def allocate(self, step_id: int, key: ParsedKey, shape: Any, dtype: Any) -> npt.NDArray[Any]:
        """Memory the consumer of ``key`` will see without a copy (or a plain array)."""
        ...

    def start_recv(
        self,
        step_id: int,
        key: ParsedKey,
        done: DoneCallback,
        *,
        copy: bool = False,
        blocking: bool = False,
    ) -> Canceller: ...

    def wait(self, slot: RecvSlot, timeout: float) -> None:
        """Block a ``blocking`` receiver up to ``timeout`` s, helping the transport meanwhile
        (e.g. polling the doorbell as leader); may return early: the caller loops."""
        ...

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Fail every pending receive of the step with ``error``; later ones fail at once."""
        ...

    def cleanup_step(self, step_id: int, error: BaseException) -> None:
        """``abort_step`` (unless aborted before), then free what the step still holds."""
        ...

    def close(self) -> None:
        """Release every resource; idempotent. Pending receives fail with the closed error."""
        ...

    def stats(self) -> dict[str, int]: ...
