#!/usr/bin/env python3
"""Regenerate (or, with ``--check``, verify) the committed protobuf modules.

Usage::

    python3 tools/gen_protos.py           # rewrite shmrdv/_rpc/proto/ from protos/shmrdv/*.proto
    python3 tools/gen_protos.py --check   # exit 1, with a summary, if the committed files drifted

Runs ``python -m grpc_tools.protoc`` (grpcio-tools) with ``-I protos`` and
``--python_out``/``--pyi_out`` into a temporary directory, then rewrites the generated
imports to be package-relative: the files are named ``shmrdv/<x>.proto`` in the
descriptor pool (a unique name beside TensorFlow's ``tensorflow/...`` files), so protoc
writes ``from shmrdv import x_pb2``, which would import from the real ``shmrdv``
package instead of ``shmrdv._rpc.proto``. No ``--grpc_python_out``: the services are
registered by hand with identity (de)serializers (shmrdv/_rpc/server.py), and grpc
gencode would tie the package to one grpcio version.

The gencode states the protobuf runtime it needs (``ValidateProtobufRuntimeVersion``):
that is the version this tool reports, and what setup.cfg must allow.

Documentation-only files (``DOC_ONLY``) are compiled to check that they are valid,
but produce no Python.

Exit status: 0 on success / no drift, 1 on drift, 2 when protoc fails.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "shmrdv"
OUT_DIR = ROOT / "shmrdv" / "_rpc" / "proto"
PACKAGE = "shmrdv._rpc.proto"

# tensorflow.WorkerService, for documentation (see the file's header): compiled, not generated.
DOC_ONLY = frozenset({"worker_service.proto"})

INIT_TEXT = '''"""Generated protobuf modules for protos/shmrdv/*.proto. Do not edit.

Regenerate with ``python3 tools/gen_protos.py``; ``--check`` fails when they drift.
shmrdv's wire coding (shmrdv/_rpc/wire.py) does not import these modules: they are
the reference its tests compare against and the schema other tools can use.
"""
'''

_FROM_IMPORT = re.compile(r"^from shmrdv import (\w+_pb2) as ", re.MULTILINE)
_MODULE_NAME = re.compile(r"'shmrdv\.(\w+_pb2)'")
_VERSION = re.compile(r"^# Protobuf Python Version: (\S+)$", re.MULTILINE)


def _protoc(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(f"gen_protos: protoc failed ({' '.join(cmd)}):\n{proc.stderr}")
        raise SystemExit(2)


def _fix(text: str) -> str:
    """Make the generated imports package-relative and name the real module path."""
    text = _FROM_IMPORT.sub(r"from . import \1 as ", text)
    return _MODULE_NAME.sub(rf"'{PACKAGE}.\1'", text)


def generate(out: Path) -> None:
    """Write the generated, import-fixed modules and ``__init__.py`` into ``out``."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    gen = [p for p in protos if p.name not in DOC_ONLY]
    doc = [p for p in protos if p.name in DOC_ONLY]
    with tempfile.TemporaryDirectory(prefix="shmrdv_gen_protos_") as tmp:
        raw = Path(tmp)
        _protoc([f"--python_out={raw}", f"--pyi_out={raw}", *map(str, gen)])
        if doc:
            _protoc([f"--descriptor_set_out={raw / 'doc.pb'}", *map(str, doc)])
        out.mkdir(parents=True, exist_ok=True)
        for path in sorted((raw / "shmrdv").iterdir()):
            (out / path.name).write_text(_fix(path.read_text()))
    (out / "__init__.py").write_text(INIT_TEXT)


def _managed(directory: Path) -> dict[str, str]:
    """The files this tool owns in ``directory``: ``__init__.py`` and ``*_pb2.py[i]``."""
    if not directory.is_dir():
        return {}
    return {
        p.name: p.read_text()
        for p in sorted(directory.iterdir())
        if p.is_file() and (p.name == "__init__.py" or re.fullmatch(r"\w+_pb2\.pyi?", p.name))
    }


def gencode_version(files: dict[str, str]) -> str | None:
    """The ``Protobuf Python Version`` the generated modules were made with (None if none)."""
    for text in files.values():
        match = _VERSION.search(text)
        if match:
            return match.group(1)
    return None


def check() -> int:
    """Regenerate into a temporary directory and compare; 0 when identical, else 1."""
    with tempfile.TemporaryDirectory(prefix="shmrdv_gen_protos_") as tmp:
        fresh_dir = Path(tmp) / "proto"
        generate(fresh_dir)
        fresh = _managed(fresh_dir)
    committed = _managed(OUT_DIR)
    if fresh == committed:
        print(f"gen_protos: {len(fresh)} files up to date (gencode {gencode_version(fresh)})")
        return 0
    where = OUT_DIR.relative_to(ROOT) if OUT_DIR.is_relative_to(ROOT) else OUT_DIR
    lines = [f"gen_protos: {where} differs from protos/ (run tools/gen_protos.py)"]
    have, want = gencode_version(committed), gencode_version(fresh)
    if have != want:
        lines.append(f"  committed gencode {have}, this grpcio-tools makes {want}")
    for name in sorted(fresh.keys() - committed.keys()):
        lines.append(f"  missing: {name}")
    for name in sorted(committed.keys() - fresh.keys()):
        lines.append(f"  stale:   {name}")
    for name in sorted(fresh.keys() & committed.keys()):
        if fresh[name] != committed[name]:
            diff = list(
                difflib.unified_diff(
                    committed[name].splitlines(),
                    fresh[name].splitlines(),
                    f"committed/{name}",
                    f"generated/{name}",
                    n=0,
                    lineterm="",
                )
            )
            lines.append(f"  differs: {name} ({len(diff)} diff lines)")
            lines.extend("    " + d for d in diff[:12])
    print("\n".join(lines))
    return 1


def write() -> int:
    """Regenerate in place, removing generated files no .proto produces any more."""
    with tempfile.TemporaryDirectory(prefix="shmrdv_gen_protos_") as tmp:
        fresh_dir = Path(tmp) / "proto"
        generate(fresh_dir)
        fresh = _managed(fresh_dir)
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for name in _managed(OUT_DIR).keys() - fresh.keys():
            (OUT_DIR / name).unlink()
        for name in fresh:
            shutil.copyfile(fresh_dir / name, OUT_DIR / name)
    version = gencode_version(fresh)
    print(f"gen_protos: wrote {len(fresh)} files; the gencode needs protobuf >= {version}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed modules differ"
    )
    args = parser.parse_args(argv)
    return check() if args.check else write()


if __name__ == "__main__":
    raise SystemExit(main())
