"""The project's own tests use shmrdv's pytest plugin with its leak check always on."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Installed, the plugin arrives through the pytest11 entry point; from a bare checkout
    # register it here. The project's tests always run with it enabled (users opt in with
    # --shmrdv or the ini option).
    if not config.pluginmanager.has_plugin("shmrdv"):
        import shmrdv.pytest_plugin

        config.pluginmanager.register(shmrdv.pytest_plugin, "shmrdv")
    config.option.shmrdv = True
