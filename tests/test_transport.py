"""The seam of _transport.py: the core reaches a transport package only through it."""

from __future__ import annotations

import ast
from pathlib import Path

import shmrdv

_PACKAGE = Path(shmrdv.__file__).resolve().parent
_TRANSPORTS = ("_shm", "_rpc")
# Who may import a transport package: the Worker builds the transports and the presence
# board; the command line and the pytest plugin list and collect /dev/shm objects; the
# package exports TLSConfig.
_BUILDERS = {"__init__.py", "_worker.py", "_cli.py", "pytest_plugin.py"}


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports as written: ``._shm.board``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def _reaches_transport(module: str) -> bool:
    parts = module.lstrip(".").split(".")
    if parts[0] == "shmrdv":
        parts = parts[1:]
    return bool(parts) and parts[0] in _TRANSPORTS


def test_transport_core_modules_import_no_transport_package() -> None:
    core = sorted(p for p in _PACKAGE.glob("*.py") if p.name not in _BUILDERS)
    assert {p.name for p in core} >= {
        "_cluster.py",
        "_rendezvous.py",
        "_routes.py",
        "_transport.py",
    }
    offenders = {
        p.name: sorted(m for m in _imported(p) if _reaches_transport(m))
        for p in core
        if any(_reaches_transport(m) for m in _imported(p))
    }
    assert offenders == {}
