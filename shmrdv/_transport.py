"""The seam between a Worker's router and its cross-process transports.

Everything a transport offers and everything it is given is declared here, and nothing
else passes between them (TensorPipe's ``Transport`` / ``Context`` split):

* ``TransportContext`` — what a transport knows of its worker: task, incarnation,
  namespace token, the peer directory and a "step cleaned up?" query. Frozen; a
  transport never sees the ``Worker``.
* ``PeerRecord`` / ``PeerDirectory`` — where another worker is (same host or not),
  which transports it takes, its gRPC address, whether the answer is final, its state
  (``TaskState``: alive, dead or absent, from the one liveness monitor of its host), and
  where else on this host its task was seen (``Sighting``).
* ``PresenceBoard`` — this host's presence records, from which the peer directory
  (``_cluster.Peers``) learns what it answers: the shared-memory one (``_shm/transport.py``,
  over ``_shm/presence.Monitor``), or none where /dev/shm cannot be used
  (``_cluster.NoPresence``: a gRPC-only worker).
* ``Transport`` — send, allocate, start a receive, help a blocked receiver wait, abort
  and clean up a step, close, stats, and whether it can reach a peer
  (TensorPipe's ``canCommunicateWithRemote``).

The router (``_router.py``) picks, per peer, the first transport of the worker's
priority list that the peer takes and that ``can_reach`` it. Both ends in one worker
never reach a transport: they stay in the step's in-process ``LocalRendezvous``. The
core modules (router, peers, diagnosis, worker's steps) know a transport only through
these declarations, never through a transport package's modules.

Thread model (``docs/threads.md``): every method may be called from any thread. ``done``
callbacks are called exactly once (unless the canceller returned ``True``), through
``invoke_done``, never under a lock of the transport.
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

__all__ = [
    "PeerDirectory",
    "PeerRecord",
    "PeerState",
    "PresenceBoard",
    "Sighting",
    "TaskState",
    "Transport",
    "TransportContext",
]

#: ``"absent"``: no presence record on this host; ``"alive"``: its owner holds its lock;
#: ``"dead"``: a record whose owner is gone (or from another boot).
PeerState = Literal["absent", "alive", "dead"]


@dataclass(frozen=True, slots=True)
class PeerRecord:
    """What this worker knows of another worker's task.

    ``final`` is True when the answer comes from the peer's own presence record on this
    host (it cannot change while that peer lives); a provisional answer (from the cluster
    spec, before the peer has started) must not be cached. ``incarnation`` and ``pid``
    are 0 when unknown.
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
    """A task's state, as its presence record on this host tells (iceoryx2's monitoring
    ``State``): ``"alive"`` while its owner holds the record's lock (``record`` says which
    run, its pid, address and transports), ``"dead"`` for a record nobody holds or one
    from another boot, ``"absent"`` for no record (not started, closed, or not known here).
    ``record`` is what the record says (None when absent or from another boot)."""

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
    """Answers, per peer task, where it is and whether it lives."""

    def lookup(self, task: DeviceName) -> PeerRecord:
        """Where ``task`` is and what it takes (cheap: one ``stat`` while nothing changed).

        Raises ``InternalError`` if its presence record is not ours or is corrupt.
        """
        ...

    def state(self, task: DeviceName) -> TaskState:
        """A fresh look at ``task``: alive, dead or absent, and what its record says (with
        the cluster's address for it). Cheap (one ``stat`` and one ``flock`` test while the
        record is unchanged), lock-free for the caller (it may run inside the garbage
        collector), bounded in descriptors. Raises ``InternalError`` if the record is not
        ours or is corrupt. Never blocks.
        """
        ...

    def sightings(self, task: DeviceName) -> list[Sighting] | None:
        """Where ``task`` has a presence record on this host, in any namespace of this user.

        None when this host keeps no presence records to look at. Costly (it lists them):
        for a diagnosis only, never per message. Never raises for what it finds.
        """
        ...


class PresenceBoard(Protocol):
    """This host's presence records of one namespace: a worker's own, and its peers'.

    A worker publishes its record for as long as it lives; a peer's record on this host
    says it is here, which transports it takes, its gRPC address and whether it lives.
    """

    def publish(
        self, task: str, incarnation: int, address: str | None, transports: tuple[str, ...]
    ) -> None:
        """Publish this worker's record (held until ``close``). Raises if it cannot."""
        ...

    def state(self, task: str) -> TaskState:
        """``task``'s state (canonical name), its record as a final same-host
        ``PeerRecord``: the host's liveness monitor (``PeerDirectory.state``)."""
        ...

    def sightings(self, task: str) -> list[Sighting] | None:
        """``PeerDirectory.sightings`` of ``task`` (canonical name)."""
        ...

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
    """One cross-process transport of a Worker (shared memory or gRPC)."""

    name: str

    def can_reach(self, peer: PeerRecord) -> bool:
        """Whether this transport can carry keys between this worker and ``peer``."""
        ...

    def explain_wait(self, peer: PeerRecord) -> str | None:
        """Why a receive from ``peer`` may be waiting, as this transport sees it now (e.g.
        its address does not answer, and the status it got); None: nothing to tell.

        For the message of a timeout and for ``stats()``, never per message. Blocks for a
        short probe at most (well under a second).
        """
        ...

    def send(
        self,
        step_id: int,
        key: ParsedKey,
        value: npt.NDArray[Any],
        is_dead: bool,
        timeout: float | None,
    ) -> None:
        """Hand ``value`` to the consumer of ``key`` (another worker).

        Never blocks on the consumer, unless a ``max_inflight_bytes`` window is set and
        full: then it waits up to ``timeout`` seconds (None: as long as it takes) and
        raises ``ResourceExhaustedError``, having sent nothing.
        """
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
    ) -> Canceller:
        """Receive the next value of ``key`` from its producer (another worker).

        ``Rendezvous.start_recv`` of one step, on this transport. ``done(error, received)``
        is called exactly once (in this thread if the value is already there) unless the
        returned canceller removes the waiter first and returns True. ``copy``: deliver a
        private copy. ``blocking``: the caller is a blocked receiver that will call
        ``wait`` until ``done`` has run (``done`` is quick and never blocks), so the
        transport need not wake another thread for it. May raise a ``RendezvousError`` at
        once (closed, step aborted); ``done`` is then never called.
        """
        ...

    def wait(self, slot: RecvSlot, timeout: float) -> None:
        """Block the calling receiver up to ``timeout`` seconds, helping the transport
        meanwhile (e.g. polling the doorbell as leader); return early once ``slot`` is
        filled. May return early for no reason: the caller loops."""
        ...

    def abort_step(self, step_id: int, error: BaseException) -> None:
        """Fail every pending receive of the step with ``error``; later ones fail at once."""
        ...

    def cleanup_step(self, step_id: int, error: BaseException) -> None:
        """Fail the step's pending receives with ``error`` (as ``abort_step``, if it was not
        aborted already) and free what the step still holds; called once per cleanup."""
        ...

    def close(self) -> None:
        """Release every resource; idempotent. Pending receives fail with the closed error."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters: bytes, messages, pending, live segments."""
        ...
