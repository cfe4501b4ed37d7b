"""The conformance battery: the behaviours every shmrdv transport must show, as plain checks.

A *pair* is a producer that sends keys to a consumer (a ``Rendezvous`` in this process).
The producer may live in another process or on another host behind a proxy: the checks
only call ``producer.send`` with plain numpy arrays, never rely on object identity across
the pair, and call ``pair.settle()`` where they need the sends to have landed.

Each check is a function ``check_<behaviour>(pair)`` that raises ``AssertionError`` (or
the unexpected error) when the behaviour is wrong. Every wait is bounded (``WAIT_S``), so
a broken transport fails instead of hanging. Run them all with ``run_conformance``, or
one test per check with pytest::

    import pytest
    from shmrdv.testing import CHECKS

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check, my_pair):   # my_pair: a fixture yielding a RendezvousPair
        check(my_pair)

The checks live in ``shmrdv._conformance`` (delivery: what arrives; completion: how
a receive completes); this module is their public face. The reference is
``shmrdv.LocalRendezvous`` (research/tf_rendezvous.md §2.2 for the
TensorFlow behaviour each check pins down, and where shmrdv departs from it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ._conformance import (
    EXPIRE_S,
    PROMPT_S,
    WAIT_S,
    Producer,
    RendezvousPair,
    assert_same,
    check_abort_fails_pending,
    check_abort_first_error_wins,
    check_arecv,
    check_arecv_cancel_removes_waiter,
    check_arecv_timeout_removes_waiter,
    check_bad_key_reported,
    check_copy_true,
    check_done_exception_is_logged,
    check_dtypes_round_trip,
    check_fifo_channel,
    check_is_dead_travels,
    check_large_value,
    check_many_keys_interleaved,
    check_object_array_refused,
    check_plain_subclasses_arrive,
    check_recv_after_send,
    check_recv_async_done_once,
    check_recv_before_send,
    check_recv_future_cancel,
    check_recv_future_lets_go,
    check_recv_future_result,
    check_recv_timeout_removes_waiter,
    check_state_losing_subclass_refused,
    check_waiters_fifo,
    sample_values,
)
from ._procs import ChildError, ChildWorker

__all__ = [
    "CHECKS",
    "ChildError",
    "ChildWorker",
    "run_in_worker",
    "EXPIRE_S",
    "PROMPT_S",
    "WAIT_S",
    "Producer",
    "RendezvousPair",
    "assert_same",
    "run_conformance",
    "sample_values",
]

_T = TypeVar("_T")

CHECKS: list[Callable[[RendezvousPair], None]] = [
    check_recv_after_send,
    check_recv_before_send,
    check_fifo_channel,
    check_waiters_fifo,
    check_many_keys_interleaved,
    check_is_dead_travels,
    check_dtypes_round_trip,
    check_recv_timeout_removes_waiter,
    check_recv_async_done_once,
    check_done_exception_is_logged,
    check_recv_future_result,
    check_recv_future_cancel,
    check_recv_future_lets_go,
    check_arecv,
    check_arecv_timeout_removes_waiter,
    check_arecv_cancel_removes_waiter,
    check_abort_fails_pending,
    check_abort_first_error_wins,
    check_object_array_refused,
    check_state_losing_subclass_refused,
    check_plain_subclasses_arrive,
    check_copy_true,
    check_large_value,
    check_bad_key_reported,
]


def run_conformance(
    make_pair: Callable[[], contextlib.AbstractContextManager[RendezvousPair]],
    checks: Iterable[Callable[[RendezvousPair], None]] | None = None,
) -> None:
    """Run every check (or those given), each on a fresh pair from ``make_pair()``.

    All checks run even when some fail; then ``AssertionError`` lists the failures,
    chained to the first one. Blocks for as long as the checks take (a few seconds).
    Call it where no event loop is running: the asyncio checks use ``asyncio.run``.
    """
    failures: list[tuple[str, BaseException]] = []
    selected = list(CHECKS if checks is None else checks)
    for check in selected:
        try:
            with make_pair() as pair:
                check(pair)
        except Exception as e:
            failures.append((check.__name__, e))
    if failures:
        lines = "\n".join(f"  {name}: {type(e).__name__}: {e}" for name, e in failures)
        raise AssertionError(
            f"{len(failures)} of {len(selected)} conformance checks failed:\n{lines}"
        ) from failures[0][1]


def run_in_worker(
    task: str, fn: Callable[..., _T], *args: Any, timeout: float = 60.0, **worker_kwargs: Any
) -> _T:
    """Run ``fn(worker, *args)`` in a fresh child process holding a ``Worker`` for ``task``.

    Returns what ``fn`` returns (it must pickle) or raises what it raised; the child and
    its Worker are closed before this returns. ``fn`` must be importable by name (a
    module-level function). ``worker_kwargs`` go to ``shmrdv.Worker`` (``namespace=`` ...).
    """
    with ChildWorker(task, reply_timeout=timeout, **worker_kwargs) as child:
        result: _T = child.call(fn, *args)
        return result
