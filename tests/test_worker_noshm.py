"""A gRPC-only Worker needs no /dev/shm: it starts and passes the conformance battery
where /dev/shm is read-only or absent (issue 18 §3).

Each case runs ``tests/noshm_conformance.py`` (producer Worker in a child process,
consumer Worker in the script, both ``transports=("grpc",)``) in a private mount
namespace made for it; it skips where that namespace cannot be made (not root, no
``unshare``, mounts not permitted). In the slow set (``pytest -m slow``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, SHMRDV_PATH

# Each script exits 77 when it cannot make its /dev/shm: the case skips.
_SETUP = {
    # A read-only tmpfs over /dev/shm: every create fails with EROFS.
    "read-only": "mount -t tmpfs -o ro tmpfs /dev/shm || exit 77",
    # A /dev of its own without shm: a small tmpfs holding the few device nodes a
    # process needs (bind-mounted from the real /dev), moved over /dev. It is staged
    # under a private /dev/shm so that nothing is created outside the namespace.
    "absent": """
        set -e
        mount -t tmpfs tmpfs /dev/shm
        mkdir /dev/shm/dev
        mount -t tmpfs -o size=1m tmpfs /dev/shm/dev
        for n in null zero random urandom full; do
            [ -e /dev/$n ] || continue
            touch /dev/shm/dev/$n
            mount --bind /dev/$n /dev/shm/dev/$n
        done
        ln -s /proc/self/fd /dev/shm/dev/fd
        mount --move /dev/shm/dev /dev
        [ ! -e /dev/shm ]
    """,
}


@pytest.mark.slow  # ~10 s each: a Worker pair and the battery, twice (send, allocate)
@pytest.mark.parametrize("shm", sorted(_SETUP))
def test_worker_noshm_grpc_only_passes_conformance(shm: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount in a private mount namespace")
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    script = f'( {_SETUP[shm]} ) || exit 77\nexec "$0" "$1"'
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            sys.executable,
            str(REPO / "tests" / "noshm_conformance.py"),
        ],
        capture_output=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=SHMRDV_PATH),
        cwd=str(REPO),
    )
    out = proc.stdout.decode() + proc.stderr.decode()
    if proc.returncode == 77:
        pytest.skip(f"cannot make a {shm} /dev/shm here: {out.strip()}")
    assert proc.returncode == 0, out
    assert "conformance ok" in out, out
    assert "/dev/shm: " in out  # the script proved /dev/shm unusable first
