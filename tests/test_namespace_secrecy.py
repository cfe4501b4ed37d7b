"""The namespace token never leaves the process (DESIGN.md; issue 20 §2).

Every object name is keyed by the token, so a token in a log is a job's names given
away. One battery drives the error paths the suites reach (bad tokens, a duplicate
task, refused values, keys of other tasks, stale incarnations, timeouts with and
without a producer elsewhere, a full window, aborted, cleaned-up and closed steps, a
producer killed, a gRPC peer gone, a wrong gRPC bearer token, ``ls`` and ``gc``) over
in-process, shared-memory and gRPC workers, keeps every exception text (with its chain
and traceback), every log line of every level, the reprs and ``stats()``, and what child
processes printed, and greps all of it for the tokens (the gRPC bearer token too).
"""

from __future__ import annotations

import logging
import secrets
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from helpers import make_key

import shmrdv
from shmrdv._procs import ChildWorker
from shmrdv._shm.naming import Names
from shmrdv._shm.reaper import collect, list_objects

A = "/job:sec/replica:0/task:0"
B = "/job:sec/replica:0/task:1"
C = "/job:sec/replica:0/task:2"
ABSENT = "/job:sec/replica:0/task:9"
EXPIRE_S = 0.2


class _Texts(logging.Handler):
    """Every text the battery saw: log records (formatted, with tracebacks), exceptions,
    reprs, stats."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.texts: list[str] = []
        self.errors = 0
        # Re-entrant: a garbage collection inside ``add`` or ``fails`` may run a Worker's
        # finalizer, which logs ("worker ... collected") back into ``emit`` on this thread.
        self._lock = threading.RLock()

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        with self._lock:
            self.texts.append(text)

    def add(self, *objs: object) -> None:
        with self._lock:
            for obj in objs:
                self.texts.extend((repr(obj), str(obj)))

    def fails(self, call: Callable[[], object]) -> None:
        """Run ``call``, which must raise; keep the exception's full text."""
        try:
            got = call()
        except Exception as e:
            with self._lock:
                self.errors += 1
                self.texts.append("".join(traceback.format_exception(e)))
                self.texts.append(repr(e))
            return
        raise AssertionError(f"{call} returned {got!r} instead of raising")


@pytest.fixture
def texts() -> Iterator[_Texts]:
    handler = _Texts()
    loggers = [logging.getLogger(), logging.getLogger("shmrdv")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _key(edge: str, src: str, dst: str, incarnation: int = 0) -> str:
    return make_key(edge, src=src, dst=dst, incarnation=incarnation)


def _bad_tokens(t: _Texts, ns: str) -> None:
    """Near misses of the real token, refused without being echoed."""
    from shmrdv._cluster import resolve_namespace

    for bad in (ns + "\n", ns.upper(), " " + ns, ns + "-x"):
        t.fails(lambda bad=bad: shmrdv.Worker(A, namespace=bad))
        t.fails(lambda bad=bad: shmrdv.namespace_id(bad))
        t.fails(lambda bad=bad: Names(bad))
        t.fails(lambda bad=bad: list_objects(bad))
        t.fails(lambda bad=bad: resolve_namespace(None, {"SHMRDV_NAMESPACE": bad}))


def _same_process(t: _Texts, ns: str, other_ns: str) -> None:
    """In-process and shared-memory paths between Workers of this process."""
    with (
        shmrdv.Worker(A, namespace=ns) as wa,
        shmrdv.Worker(B, namespace=ns, max_inflight_bytes=1024) as wb,
        shmrdv.Worker(C, namespace=other_ns) as wc,
    ):
        t.fails(lambda: shmrdv.Worker(A, namespace=ns))  # a duplicate task
        ra, rb = wa.rendezvous(1), wb.rendezvous(1)
        local, shm = _key("l", A, A), _key("s", A, B)
        for rdv, key in ((ra, local), (ra, shm)):
            t.fails(lambda rdv=rdv, key=key: rdv.send(key, np.array([1, None], dtype=object)))
            t.fails(lambda rdv=rdv, key=key: rdv.send(key, np.ma.masked_array([1], mask=[1])))
            t.fails(lambda rdv=rdv, key=key: rdv.send(key, [1, 2]))
        t.fails(lambda: ra.recv(local, timeout=EXPIRE_S))
        t.fails(lambda: ra.recv("not;a key", timeout=EXPIRE_S))
        t.fails(lambda: ra.send(_key("o", B, A), np.zeros(1)))  # src of another task
        t.fails(lambda: ra.recv(_key("o", B, B), timeout=EXPIRE_S))  # dst of another task
        stale = _key("i", A, B, incarnation=wa.incarnation ^ 1)
        t.fails(lambda: ra.send(stale, np.zeros(1)))
        t.fails(lambda: rb.recv(stale, timeout=EXPIRE_S))
        t.fails(lambda: rb.recv(_key("x", ABSENT, B), timeout=EXPIRE_S))  # nowhere
        t.fails(lambda: rb.recv(_key("x", C, B), timeout=EXPIRE_S))  # in another namespace
        # A full window: B's sends to A that A never takes.
        wb.rendezvous(1).send(_key("w", B, A), np.zeros(1024, np.uint8))
        t.fails(lambda: rb.send(_key("w", B, A), np.zeros(1024, np.uint8), timeout=EXPIRE_S))
        ra.send(shm, np.arange(4))
        t.add(rb.recv(shm, timeout=5), wa, wb, wc, ra, rb, wa.stats(), wb.stats(), wc.stats())
        fut = rb.recv_future(_key("f", A, B))
        wb.cleanup(1)
        t.fails(lambda: fut.result(timeout=5))
        t.fails(lambda: rb.recv(shm, timeout=EXPIRE_S))
        ra.start_abort(shmrdv.AbortedError("stop"))
        t.fails(lambda: ra.recv(local, timeout=EXPIRE_S))
        wa.close()
        t.fails(lambda: wa.rendezvous(2))
        t.fails(lambda: ra.send(shm, np.zeros(1)))
        t.add(wa, wa.stats())
        wb.cleanup(2)


def _killed_producer(t: _Texts, ns: str) -> None:
    """A producer process killed while its consumer waits, and one closed before."""
    with shmrdv.Worker(B, namespace=ns) as wb:
        child = ChildWorker(A, namespace=ns)
        try:
            t.add(child)
            rdv = wb.rendezvous(3)
            key = _key("k", A, B)
            child.send(key, np.arange(3), step=3)
            t.add(rdv.recv(key, timeout=10))
            fut = rdv.recv_future(key)
            child.kill()
            t.fails(lambda: fut.result(timeout=10))
            t.fails(lambda: child.send(key, np.zeros(1), step=3))
        finally:
            child.close()
        t.add(wb.stats(), list_objects(ns))
        wb.cleanup(3)


def _grpc(t: _Texts, ns: str) -> None:
    """The gRPC path: a stale incarnation, a cleaned-up step, a producer closed."""
    grpc_only = ("grpc",)
    with (
        shmrdv.Worker(A, namespace=ns, transports=grpc_only) as wa,
        shmrdv.Worker(B, namespace=ns, transports=grpc_only) as wb,
    ):
        ra, rb = wa.rendezvous(4), wb.rendezvous(4)
        key = _key("g", A, B)
        ra.send(key, np.arange(5))
        t.add(rb.recv(key, timeout=10), wa, wb, ra, rb, wa.stats(), wb.stats())
        t.fails(lambda: rb.recv(_key("g", A, B, incarnation=wa.incarnation ^ 1), timeout=5))
        t.fails(lambda: rb.recv(key, timeout=EXPIRE_S))
        wa.cleanup(4)
        t.fails(lambda: rb.recv(key, timeout=5))
        wa.close()
        t.fails(lambda: wb.rendezvous(5).recv(_key("h", A, B), timeout=EXPIRE_S))
        t.add(wa, wb, wb.stats())
        wb.cleanup(4)
        wb.cleanup(5)


def _grpc_wrong_bearer(t: _Texts, ns: str, bearers: tuple[str, str]) -> None:
    """The gRPC bearer token, a secret too: a consumer with the wrong one is refused."""
    with (
        shmrdv.Worker(A, namespace=ns, transports=("grpc",), token=bearers[0]) as wa,
        shmrdv.Worker(C, namespace=ns, transports=("grpc",), token=bearers[1]) as wc,
    ):
        key = _key("t", A, C)
        wa.rendezvous(6).send(key, np.arange(3))
        t.fails(lambda: wc.rendezvous(6).recv(key, timeout=5))
        t.add(wa, wc, wa.stats(), wc.stats())
        wa.cleanup(6)
        wc.cleanup(6)


def test_namespace_token_appears_in_no_message_log_repr_or_stats(
    texts: _Texts, capfd: pytest.CaptureFixture[str]
) -> None:
    ns, other_ns = shmrdv.new_namespace(), shmrdv.new_namespace()
    _bad_tokens(texts, ns)
    _same_process(texts, ns, other_ns)
    _killed_producer(texts, ns)
    _grpc(texts, ns)
    bearers = (secrets.token_hex(16), secrets.token_hex(16))
    _grpc_wrong_bearer(texts, ns, bearers)
    texts.add(collect(ns), list_objects(), Names(ns))
    out, err = capfd.readouterr()  # what child processes (and gRPC's C core) printed
    seen = [*texts.texts, out, err]
    assert texts.errors >= 45  # the battery ran
    for secret in (ns, other_ns, ns.upper(), *bearers):
        leaks = [text for text in seen if secret in text]
        assert not leaks, f"the namespace token appears in {len(leaks)} text(s): {leaks[:3]}"
    # The texts name the namespaces by their public ids instead.
    joined = "\n".join(seen)
    assert shmrdv.namespace_id(ns) in joined
    assert shmrdv.namespace_id(other_ns) in joined


def test_namespace_repr_of_every_public_value_hides_the_token() -> None:
    ns = shmrdv.new_namespace()
    names = Names(ns)
    assert ns not in repr(names) and names.namespace_id in repr(names)
    with shmrdv.Worker(A, namespace=ns) as w:
        shown: list[Any] = [w, w.rendezvous(0), w.stats()]
        assert all(ns not in repr(x) and ns not in str(x) for x in shown)
        # The worker says which namespace it is in, by the public id.
        assert w.namespace_id == names.namespace_id
        assert f"namespace_id={w.namespace_id}" in repr(w)
        assert w.stats()["namespace_id"] == w.namespace_id
        w.cleanup(0)
