"""The project's own tests use shmrdv's pytest plugin with its leak check always on.

Shared fixtures: ``ns`` (a fresh namespace, what dead workers left in it collected
afterwards), ``names`` (fresh ``Names`` for tests below the Worker, which must leave
nothing) and a session-wide start of multiprocessing's resource tracker. Shared
functions are in ``tests/helpers.py``.
"""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from shmrdv._shm.naming import Names


def pytest_configure(config: pytest.Config) -> None:
    # Installed, the plugin arrives through the pytest11 entry point; from a bare checkout
    # register it here. The project's tests always run with it enabled (users opt in with
    # --shmrdv or the ini option).
    if not config.pluginmanager.has_plugin("shmrdv"):
        import shmrdv.pytest_plugin

        config.pluginmanager.register(shmrdv.pytest_plugin, "shmrdv")
    config.option.shmrdv = True


@pytest.fixture(scope="session", autouse=True)
def _resource_tracker() -> None:
    """Start multiprocessing's resource tracker before any leak check counts children.

    The first ``spawn`` starts it, and it lives as long as this process: started inside a
    test, the per-test leak check would see a new child.
    """
    multiprocessing.resource_tracker.ensure_running()


@pytest.fixture
def ns(shmrdv_namespace: str) -> Iterator[str]:
    """The plugin's fresh ``shmrdv_namespace``; what dead workers left in it is collected
    afterwards (a test that kills a producer leaves its tensors for ``gc``)."""
    from shmrdv._shm.reaper import collect

    yield shmrdv_namespace
    collect(shmrdv_namespace)


@pytest.fixture
def names() -> Iterator[Names]:
    """``Names`` of a fresh random namespace; fails a test that leaves any of its objects
    in /dev/shm (semaphores included), after removing them."""
    from shmrdv._shm.naming import SHM_DIR, Names

    n = Names(secrets.token_hex(13))
    yield n
    left = [e for e in os.listdir(SHM_DIR) if n.prefix in e]
    for entry in left:
        os.unlink(os.path.join(SHM_DIR, entry))
    assert not left, f"test left {left} in {SHM_DIR}"
