"""Run a Python script in a private mount namespace whose /dev/shm is a small tmpfs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO


def run_with_small_dev_shm(code: str, size: str = "8m") -> str:
    """Run ``code`` with /dev/shm a ``size`` tmpfs of its own; return its output.

    Skips (with the reason) when not root or when mount namespaces are not permitted;
    fails the test if the script exits non-zero or does not print ``child ok``.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs in a private mount namespace")
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        timeout=20,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private namespace: {probe.stderr.decode().strip()}")
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" -c "$1"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, code],
        capture_output=True,
        timeout=50,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=str(REPO),
    )
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, out
    assert "child ok" in out
    return out
