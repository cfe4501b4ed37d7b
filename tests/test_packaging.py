"""Packaging: an editable install is typed-importable, and CI needs only the test extra."""

from __future__ import annotations

import configparser
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _editable_install_of_this_checkout() -> bool:
    try:
        dist = metadata.distribution("shmrdv")
    except metadata.PackageNotFoundError:
        return False
    text = dist.read_text("direct_url.json")
    if not text:
        return False
    info = json.loads(text)
    url = str(info.get("url", ""))
    return bool(info.get("dir_info", {}).get("editable")) and (
        Path(url.removeprefix("file://")).resolve() == ROOT
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_editable_install_is_found_by_mypy_in_another_directory(tmp_path: Path) -> None:
    # setuptools' default editable mode installs an import hook, which mypy cannot follow
    # ("Cannot find implementation or library stub"); package_dir "" = "." makes it a path.
    if not _editable_install_of_this_checkout():
        pytest.skip("shmrdv is not installed editable from this checkout (pip install -e .)")
    pytest.importorskip("mypy", reason="mypy comes with the 'ci' extra (.ci/run installs it)")
    user = tmp_path / "user_project.py"
    user.write_text("import shmrdv\n\nns: str = shmrdv.new_namespace()\n", encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(user)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_config_tolerates_a_missing_matplotlib() -> None:
    # Only bench --plot imports matplotlib (the "plot" extra); CI installs only "test".
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    assert cfg.getboolean("mypy-matplotlib.*", "ignore_missing_imports")
    assert "matplotlib" not in cfg["options.extras_require"]["test"]


def test_test_extra_holds_what_the_tests_need_only() -> None:
    # The README's test command installs the "test" extra; CI's own tools are in "ci".
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    test, ci = (cfg["options.extras_require"][name] for name in ("test", "ci"))
    for tool in ("mypy", "ruff", "grpcio-tools", "types-protobuf"):
        assert tool not in test and tool in ci


# Blocks google.protobuf, then sends across processes over shared memory and over gRPC.
_NO_PROTOBUF = """
import multiprocessing as mp
import sys

class _NoProtobuf:
    def find_spec(self, name, path=None, target=None):
        if name == "google.protobuf" or name.startswith("google.protobuf."):
            raise ImportError("protobuf is blocked in this test")
        return None

sys.meta_path.insert(0, _NoProtobuf())
import numpy as np
import shmrdv

A, B = "/job:p/replica:0/task:0", "/job:p/replica:0/task:1"

def produce(ns, transports):
    with shmrdv.Worker(A, namespace=ns, transports=transports) as w:
        key = shmrdv.create_key(A + "/device:CPU:0", 0, B + "/device:CPU:0", "x")
        w.rendezvous(0).send(key, np.arange(1000, dtype=np.float32))
        w.rendezvous(1).recv(shmrdv.create_key(B + "/device:CPU:0", 0, A + "/device:CPU:0", "done"), timeout=60)

if __name__ == "__main__":
    for transports in (("shm",), ("grpc",)):
        ns = shmrdv.new_namespace()
        with shmrdv.Worker(B, namespace=ns, transports=transports) as w:
            p = mp.get_context("spawn").Process(target=produce, args=(ns, transports))
            p.start()
            key = shmrdv.create_key(A + "/device:CPU:0", 0, B + "/device:CPU:0", "x")
            got = w.rendezvous(0).recv(key, timeout=60, copy=True)
            assert got.value.sum() == np.arange(1000).sum(), got
            w.rendezvous(1).send(shmrdv.create_key(B + "/device:CPU:0", 0, A + "/device:CPU:0", "done"), np.zeros(1))
            p.join(60)
            assert p.exitcode == 0, p.exitcode
            w.cleanup(0)
            w.cleanup(1)
        print("ok", transports[0])
    assert not [m for m in sys.modules if m.startswith("google.protobuf")]
"""


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_runtime_needs_no_protobuf(tmp_path: Path) -> None:
    script = tmp_path / "no_protobuf.py"
    script.write_text(_NO_PROTOBUF, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["ok", "shm", "ok", "grpc"], proc.stdout


def test_protobuf_is_a_test_requirement_only() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    assert "protobuf" not in cfg["options"]["install_requires"]
    assert "protobuf" in cfg["options.extras_require"]["test"]
