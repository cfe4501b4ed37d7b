"""tools/gen_protos.py: the committed generated modules match protos/ (the drift check)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gen_protos.py"
GENERATED = ROOT / "shmrdv" / "_rpc" / "proto"


def _committed_gencode_version() -> str:
    text = (GENERATED / "worker_pb2.py").read_text()
    match = re.search(r"^# Protobuf Python Version: (\S+)$", text, re.MULTILINE)
    assert match, "worker_pb2.py states no gencode version"
    return match.group(1)


@pytest.mark.timeout(120)
def test_gen_protos_check_committed_modules_up_to_date() -> None:
    pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools makes the gencode")
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--check"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    if proc.returncode == 1 and "this grpcio-tools makes" in proc.stdout:
        # Another grpcio-tools writes another version header: not drift of protos/.
        pytest.skip(
            f"installed grpcio-tools differs from the one that made the modules\n{proc.stdout}"
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout


def test_gen_protos_generated_imports_are_package_relative() -> None:
    for path in GENERATED.glob("*_pb2.py*"):
        text = path.read_text()
        assert "from shmrdv import" not in text, path.name
        assert "'shmrdv._rpc.proto." in text or path.suffix == ".pyi", path.name


def test_gen_protos_generated_modules_import_under_installed_protobuf() -> None:
    from google.protobuf import __version__ as runtime

    from shmrdv._rpc.proto import rendezvous_pb2, tensor_pb2, types_pb2, worker_pb2

    need = tuple(int(x) for x in _committed_gencode_version().split("."))
    have = tuple(int(x) for x in re.findall(r"\d+", runtime)[:3])
    assert have >= need
    # TensorFlow's numbers, our package (so TensorFlow's own descriptors never clash).
    assert worker_pb2.RecvTensorRequest.DESCRIPTOR.full_name == "shmrdv.tf.RecvTensorRequest"
    assert types_pb2.DT_HALF == 19 and types_pb2.DT_BFLOAT16 == 14
    assert tensor_pb2.TensorProto.DESCRIPTOR.fields_by_name["shmrdv_dtype"].number == 1001
    service = rendezvous_pb2.DESCRIPTOR.services_by_name["Rendezvous"]
    assert service.full_name == "shmrdv.Rendezvous"
    assert list(service.methods_by_name) == ["RecvTensorSeries"]
    assert service.methods_by_name["RecvTensorSeries"].server_streaming


def test_gen_protos_check_fails_on_drift(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools makes the gencode")
    sys.path.insert(0, str(TOOL.parent))
    try:
        import gen_protos
    finally:
        sys.path.remove(str(TOOL.parent))
    fresh = tmp_path / "proto"
    gen_protos.generate(fresh)
    managed = gen_protos._managed(fresh)
    assert set(managed) == set(gen_protos._managed(GENERATED))
    # A changed file is reported as drift, with a diff summary.
    (fresh / "worker_pb2.py").write_text(managed["worker_pb2.py"] + "# edited\n")
    old = gen_protos.OUT_DIR
    gen_protos.OUT_DIR = fresh
    try:
        assert gen_protos.check() == 1
    finally:
        gen_protos.OUT_DIR = old
