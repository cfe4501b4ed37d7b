"""Which rendezvous carries a key: its route, derived once per pair of key ends.

As TensorFlow's ``BaseRemoteRendezvous``, a step sends only keys whose src task is its own
and receives only keys whose dst task is its own. Both ends here: the step's
``LocalRendezvous``; else the first transport of the *producer's* priority list that the
peer takes and that ``can_reach`` it, so both ends pick the same one. A route depends on
(src device, src incarnation, dst device), never the edge name (``Ends``), and is kept
once the peer's presence record is final.

A receive started before that listens on this worker's pick and, if the final record
picks another transport, on that one too (``RaceRecv``, one leg per transport, started by
``PickWatch``): the first value ends the race, an error only once every leg failed.

Thread model (``docs/threads.md``): thread-safe (thread ``shmrdv-pick``); no lock is held
across a transport call or a ``done``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import AbortedError, InvalidArgumentError
from ._keys import DeviceName, ParsedKey
from ._rendezvous import Canceller, DoneCallback, Received, RecvSlot
from ._transport import PeerRecord, Sighting, Transport, TransportContext

__all__ = ["Ends", "RaceRecv", "Routes", "explain_absent_producer"]

_log = logging.getLogger("shmrdv.worker")

# How many pairs of key ends a worker remembers (a job has few devices; cleared when full).
ENDS_MAX = 4096


class Ends:
    """What a key's ends mean here: may steps send / receive it, the ``peer`` task (None
    when both ends or neither are this worker), and its ``transport`` once final."""

    __slots__ = ("dst_own", "local", "peer", "receives", "sends", "src_own", "transport", "wait")

    def __init__(self, pk: ParsedKey, task: DeviceName, incarnation: int) -> None:
        self.src_own = task.same_task(pk.src)
        self.dst_own = task.same_task(pk.dst)
        inc_ok = not self.src_own or pk.src_incarnation in (0, incarnation)
        self.sends = self.src_own and inc_ok
        self.receives = self.dst_own and inc_ok
        self.local = self.src_own and self.dst_own
        self.peer: DeviceName | None = None  # both ends or neither here: no peer
        if self.src_own != self.dst_own:
            self.peer = pk.dst if self.src_own else pk.src
        self.transport: Transport | None = None
        self.wait: Callable[[RecvSlot, float], None] | None = None


class Routes:
    """The routing of one Worker, shared by its steps (see the module docstring)."""

    def __init__(
        self,
        ctx: TransportContext,
        order: tuple[str, ...],
        transport: Callable[[str], Transport],
        active: Callable[[], tuple[Transport, ...]],
    ) -> None:
        self.ctx = ctx
        self.order = order  # the worker's transport priority list
        self._transport = transport  # the named transport (created on first use)
        self._active = active  # the transports created so far
        self._lock = threading.Lock()
        # (src device, src incarnation, dst device) -> what they mean here.
        self.ends: dict[tuple[str, int, str], Ends] = {}
        # (peer task, this worker produces) -> transport: each direction its producer's pick.
        self._peer_routes: dict[tuple[tuple[str, int, int], bool], Transport] = {}
        # Blocked receives that have waited long, by id of their slot: (step, key, since).
        self._long_waits: dict[int, tuple[int, ParsedKey, float]] = {}
        self._picks = PickWatch()
        # What every call of this worker's steps raises once closed or forked off.
        self.refused: Callable[[], BaseException] | None = None

    def of(self, pk: ParsedKey) -> Ends:
        ends = self.ends.get((pk.src_device, pk.src_incarnation, pk.dst_device))
        if ends is None:
            ends = Ends(pk, self.ctx.task, self.ctx.incarnation)
            with self._lock:
                if len(self.ends) >= ENDS_MAX:
                    self.ends.clear()
                ends = self.ends.setdefault(
                    (pk.src_device, pk.src_incarnation, pk.dst_device), ends
                )
        return ends

    def send_error(self, pk: ParsedKey, ends: Ends) -> Exception:
        if not ends.src_own:
            return not_this_task(pk, "src", self.ctx.task_name)
        return AbortedError(
            f"key {pk.full_key!r} names incarnation {pk.src_incarnation:016x} of "
            f"{self.ctx.task_name}, but this worker is incarnation {self.ctx.incarnation:016x}: "
            "the key is from a previous run of this worker"
        )

    def recv_error(self, pk: ParsedKey, ends: Ends) -> Exception:
        if not ends.dst_own:
            return not_this_task(pk, "dst", self.ctx.task_name)
        return AbortedError(
            f"RecvTensor expects a different device incarnation: {pk.src_incarnation:016x} "
            f'vs. {self.ctx.incarnation:016x}. Your worker job ("{self.ctx.task_name}") was '
            f"probably restarted; key {pk.full_key!r}"
        )

    def transport(self, ends: Ends, pk: ParsedKey) -> Transport:
        """The transport to ``ends.peer`` (set); ``InvalidArgumentError`` if none reaches it."""
        t = ends.transport
        if t is not None:
            return t
        peer = ends.peer
        assert peer is not None
        tk = (peer.task_key(), ends.src_own)
        t = self._peer_routes.get(tk)
        if t is None:
            record = self.ctx.peers.lookup(peer)
            t = self._choose(record, pk, producer=ends.src_own)
            if not record.final:
                return t  # provisional: ask again next time
            with self._lock:
                t = self._peer_routes.setdefault(tk, t)
        ends.wait = t.wait
        ends.transport = t
        return t

    def others_reaching(self, ends: Ends, first: Transport) -> bool:
        """Whether a receive started on ``first`` may have to listen on another transport
        too (one not made yet is not made for this)."""
        assert ends.peer is not None
        record = self.ctx.peers.lookup(ends.peer)
        if record.final:
            return True  # final since ``transport`` looked: the watch settles it at once
        made = {t.name: t for t in self._active()}
        return any(
            n != first.name
            and n in record.transports
            and (n not in made or made[n].can_reach(record))
            for n in self.order
        )

    def race(
        self,
        ends: Ends,
        pk: ParsedKey,
        first: Transport,
        step_id: int,
        done: DoneCallback,
        copy: bool,
    ) -> RaceRecv:
        """A callback receive on ``first`` that also listens on the producer's pick once its
        record is final (when ``others_reaching``)."""

        def leg(t: Transport, leg_done: DoneCallback) -> Canceller:
            return t.start_recv(step_id, pk, leg_done, copy=copy)

        def pick() -> tuple[LegStarter | None] | None:
            t = ends.transport or self.transport(ends, pk)
            if ends.transport is None:
                return None  # still provisional
            return (None if t is first else functools.partial(leg, t),)

        race = RaceRecv(done, [functools.partial(leg, first)], f"key {pk.full_key!r}")
        self._picks.watch(race, pick)
        return race

    def _choose(self, record: PeerRecord, pk: ParsedKey, *, producer: bool) -> Transport:
        if producer or not record.final:
            # A provisional record does not know the producer's order: ours is the best guess.
            order = [n for n in self.order if n in record.transports]
        else:
            order = [n for n in record.transports if n in self.order]
        for name in order:
            t = self._transport(name)
            if t.can_reach(record):
                return t
        where = "this host" if record.same_host else "another host"
        raise InvalidArgumentError(
            f"key {pk.full_key!r}: task {record.task} is on {where} and takes transports "
            f"{record.transports}; none of this worker's transports={self.order} reaches it"
        )

    def abort_step(self, step_id: int, error: BaseException) -> None:
        for t in self._active():
            t.abort_step(step_id, error)

    def diagnose(self, pk: ParsedKey, *, probe: bool = False) -> str | None:
        """Why a receive of ``pk`` may be waiting (``probe``: ask the transport too), or
        None. Lists presence records: for a timeout or ``stats()``, never per message."""
        peers = self.ctx.peers
        try:
            record = peers.lookup(pk.src)
        except Exception as e:  # a diagnosis never replaces the error it explains
            return f"the presence record of {pk.src} cannot be read: {e}"
        hints = []
        ends = self.of(pk)
        if probe and ends.peer is not None:
            try:
                hint = self.transport(ends, pk).explain_wait(record)
            except Exception:
                _log.debug("explaining the wait for %r failed", pk.full_key, exc_info=True)
                hint = None
            if hint is not None:
                hints.append(hint)
        if record.same_host:
            absent = explain_absent_producer(record.task, peers.sightings(pk.src))
            if absent is not None:
                hints.append(absent)
        return "; ".join(hints) or None

    def long_wait(self, slot: RecvSlot, entry: tuple[int, ParsedKey, float] | None) -> None:
        """Record (``entry``: step, key, since) or forget (None) a long wait of ``slot``."""
        with self._lock:
            if entry is None:
                self._long_waits.pop(id(slot), None)
            else:
                self._long_waits[id(slot)] = entry

    def waiting(self) -> list[dict[str, Any]]:
        """The blocked receives waiting for over a second: step, key, seconds, diagnosis."""
        with self._lock:
            waits = list(self._long_waits.values())
        now = time.monotonic()
        hints: dict[str, str | None] = {}  # one look (and probe) per producer task
        for _, pk, _ in waits:
            if str(pk.src) not in hints:
                hints[str(pk.src)] = self.diagnose(pk, probe=True)
        return [
            {
                "step": step,
                "key": pk.full_key,
                "waited_s": round(now - since, 3),
                "diagnosis": hints[str(pk.src)],
            }
            for step, pk, since in waits
        ]


def explain_absent_producer(task: str, found: list[Sighting] | None) -> str | None:
    """Where ``task`` lives if not alive in this worker's namespace; None if it is, or if
    this host keeps no presence records (``found`` None)."""
    if found is None or any(s.alive and s.ours for s in found):
        return None
    elsewhere = sorted({s.namespace for s in found if s.alive and not s.ours})
    if elsewhere:
        pids = sorted({s.pid for s in found if s.alive and not s.ours})
        return (
            f"task {task} is alive in namespace id {', '.join(elsewhere)} "
            f"(pid {', '.join(map(str, pids))}), not in this worker's: producer and consumer "
            "must share the namespace"
        )
    return (
        f"task {task} is not alive anywhere on this host (no live presence record of this "
        "user in any namespace): it has not started, it exited, or it runs on another host"
    )


def not_this_task(pk: ParsedKey, side: str, task_name: str) -> InvalidArgumentError:
    """TensorFlow's "Invalid rendezvous key (src|dst)", saying what to do instead."""
    device = pk.src if side == "src" else pk.dst
    role, verb = ("producer", "sends") if side == "src" else ("consumer", "receives")
    call = "send" if side == "src" else "recv"
    named = (
        f"task {device.task_part}"
        if device.has_task
        else f"device {str(device) or '(empty)'}, which names no task (it needs /job: and /task:)"
    )
    return InvalidArgumentError(
        f"Invalid rendezvous key ({side}): {pk.full_key} @ {task_name}: the key's {role} "
        f"({side}) is {named}, but this worker is {task_name}, and a worker {verb} only keys "
        f"whose {side} device is on its own task; call {call} on the Worker of the task the "
        f"key names, or build the key with a {side} device of this task (e.g. "
        f"{task_name}/device:CPU:0)"
    )


LegStarter = Callable[[DoneCallback], Canceller]

# ``PickWatch``'s pause doubles from the first to the last (a producer usually starts soon).
_FIRST_LOOK = 0.005
_LAST_LOOK = 0.1


class RaceRecv:
    """One receive over the legs ``starters`` and those ``add``ed later; call it to cancel."""

    def __init__(self, done: DoneCallback, starters: Sequence[LegStarter], what: str) -> None:
        self._done = done
        self._what = what
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._cancels: list[Canceller | None] = []
        self._ended = False
        self._cancelling = False
        self._error: BaseException | None = None
        try:
            for start in starters:
                if not self.add(start):
                    break
        except BaseException:
            self()
            raise

    @property
    def ended(self) -> bool:
        return self._ended

    def add(self, start: LegStarter) -> bool:
        """Start one more leg; ``False`` (nothing started) if the receive has ended."""
        with self._lock:
            if self._ended or self._cancelling:
                return False
            i = len(self._cancels)
            self._cancels.append(None)
            self._open.add(i)
        cancel = start(functools.partial(self._leg_done, i))
        with self._lock:
            ended = self._over()
            if not ended:  # (an ended race has let go of its legs: ``_let_go``)
                self._cancels[i] = cancel
            withdraw = ended and i in self._open
        if withdraw:  # the receive ended while the leg started
            cancel()
        return True

    def fail(self, error: BaseException) -> None:
        """End the receive with ``error`` (no pick could be made), unless a leg ends it."""
        done = self._done  # ``_ignore`` once ended; the real one if ``self()`` ends it
        if self():
            done(error, None)

    def _over(self) -> bool:
        """``_ended`` read again after the lock was free (a method: mypy must not narrow it)."""
        return self._ended

    def _leg_done(self, i: int, error: BaseException | None, received: Received | None) -> None:
        with self._lock:
            self._open.discard(i)
            if self._ended:
                if received is not None:
                    _log.error(
                        "%s: a second value arrived on another transport; dropped", self._what
                    )
                return
            if error is not None and self._open and not self._cancelling:
                if self._error is None:
                    self._error = error
                return  # another leg may still deliver
            self._ended = True
            if error is not None and self._error is not None and not self._cancelling:
                error = self._error
            others = [c for j, c in enumerate(self._cancels) if j in self._open and c is not None]
            done = self._let_go()
        for cancel in others:
            cancel()
        done(error, received)

    def __call__(self) -> bool:
        """Cancel: withdraw every open leg (``True``), or ``False`` if a value won."""
        with self._lock:
            if self._ended:
                return False
            self._cancelling = True
            open_legs = [c for j, c in enumerate(self._cancels) if j in self._open]
        removed = [c is not None and c() for c in open_legs]
        with self._lock:
            if self._over() or not all(removed):
                return False  # a leg's outcome is on its way (or came): it ends the race
            self._ended = True
            self._let_go()
            return True

    def _let_go(self) -> DoneCallback:
        """Drop the legs' cancellers and ``done`` (under the lock) and return ``done``: kept,
        their cycles through this race would hold the value, and its producer's pool slot,
        until a full collection."""
        done, self._done = self._done, _ignore
        self._cancels = []
        return done


def _ignore(error: BaseException | None, received: Received | None) -> None:
    """An ended race's ``done``."""


#: ``None`` while the producer's record is provisional; then the leg to add (or ``(None,)``).
Pick = Callable[[], "tuple[LegStarter | None] | None"]


class PickWatch:
    """Adds a receive's leg on its producer's pick once the record is final, in one daemon
    thread that runs while receives are watched; ``pick`` runs outside the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[tuple[RaceRecv, Pick]] = []
        self._running = False
        self._wake = threading.Event()

    def watch(self, race: RaceRecv, pick: Pick) -> None:
        with self._lock:
            self._watched.append((race, pick))
            start = not self._running
            self._running = True
        self._wake.set()  # a new receive: look soon again
        if start:
            threading.Thread(target=self._run, name="shmrdv-pick", daemon=True).start()

    def watching(self) -> int:
        with self._lock:
            return len(self._watched)

    def _run(self) -> None:
        pause = _FIRST_LOOK
        while True:
            if self._wake.wait(pause):
                self._wake.clear()
                pause = _FIRST_LOOK
            else:
                pause = min(pause * 2, _LAST_LOOK)
            with self._lock:
                watched = list(self._watched)
            done = [w for w in watched if self._look(*w)]
            with self._lock:
                for w in done:
                    self._watched.remove(w)
                if not self._watched:
                    self._running = False
                    return

    @staticmethod
    def _look(race: RaceRecv, pick: Pick) -> bool:
        """Whether ``race`` needs no more looking; an error of the pick ends the receive."""
        if race.ended:
            return True
        try:
            found = pick()
            if found is None:
                return False
            (leg,) = found
            if leg is not None:
                race.add(leg)
        except Exception as e:
            race.fail(e)
        return True
