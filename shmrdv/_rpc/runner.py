"""Runner: a receive's ``done`` callbacks, run off gRPC's channel thread.

Thread model (docs/threads.md): reused daemon threads ("shmrdv-rpc-done"), made on demand and ended after
``_IDLE_EXIT`` seconds without work or at ``shutdown``; the task queue is guarded by one
condition. A task runs outside that lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Runner"]

# A callback thread with nothing to run for this long ends.
_IDLE_EXIT = 10.0


class Runner:
    """Runs ``done`` callbacks off gRPC's thread, on reused threads.

    gRPC calls a future's callbacks in its channel thread, which must not block: a
    callback that waits there (say, for another receive on that channel) would stop the
    channel. So a caller's ``done`` runs here: on an idle thread if there is one, else on
    a new one (so a ``done`` that blocks never holds up another), which ends after
    ``_IDLE_EXIT`` seconds without work or at ``shutdown``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._tasks: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._idle = 0
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        task = (fn, args)
        with self._cond:
            if not self._closed:
                self._tasks.append(task)
                if self._idle >= len(self._tasks):
                    self._cond.notify()
                    return
                thread = threading.Thread(target=self._work, name="shmrdv-rpc-done", daemon=True)
                self._threads.add(thread)
            else:
                thread = None
        if thread is None:
            fn(*args)
            return
        try:
            thread.start()
        except RuntimeError:  # "can't start new thread": run it here rather than never
            with self._cond:
                self._threads.discard(thread)
                try:
                    self._tasks.remove(task)
                except ValueError:
                    return  # an idle thread took it meanwhile
            fn(*args)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                self._idle += 1
                while not self._tasks and not self._closed:
                    if not self._cond.wait(_IDLE_EXIT) and not self._tasks:
                        break
                self._idle -= 1
                if not self._tasks:
                    self._threads.discard(me)
                    return
                fn, args = self._tasks.popleft()
            fn(*args)
            # Not kept while this thread idles: a receive's value (a pool slot) and its
            # future would stay alive until the next task.
            del fn, args

    def shutdown(self, timeout: float) -> None:
        """Let the threads finish what they run and end; join them (not the caller's)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
