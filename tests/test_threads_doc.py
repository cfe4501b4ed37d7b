"""docs/threads.md is the one thread model: every library thread is in it, and each
module's "Thread model" paragraph points to it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import shmrdv

_PACKAGE = Path(shmrdv.__file__).resolve().parent
_DOC = (_PACKAGE.parent / "docs" / "threads.md").read_text(encoding="utf-8")
# Not library threads: the benchmark tool and the conformance helpers of testing.py.
_TOOLS = ("_bench/", "testing.py")


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        rel = path.relative_to(_PACKAGE).as_posix()
        if rel.startswith("_rpc/proto/"):
            continue
        out.append((rel, ast.parse(path.read_text(encoding="utf-8"), rel)))
    return out


def _thread_names(tree: ast.Module) -> list[str]:
    """The fixed start of every thread name given to Thread(...) or a ThreadPoolExecutor."""
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg not in ("name", "thread_name_prefix"):
                continue
            value = kw.value
            if isinstance(value, ast.JoinedStr) and value.values:
                value = value.values[0]
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                names.append(re.split(r"[ {]", value.value)[0])
    return names


def test_threads_doc_names_every_library_thread() -> None:
    found = {
        name
        for rel, tree in _modules()
        if not rel.startswith(_TOOLS)
        for name in _thread_names(tree)
        if name.startswith("shmrdv-")
    }
    assert "shmrdv-shm-dispatch" in found and "shmrdv-rpc-server" in found  # the scan works
    missing = sorted(name for name in found if name not in _DOC)
    assert missing == []


def test_threads_doc_is_where_each_thread_model_points() -> None:
    stray = []
    for rel, tree in _modules():
        doc = ast.get_docstring(tree) or ""
        if "Thread model" not in doc:
            continue
        paragraph = doc[doc.index("Thread model") :].split("\n\n")[0]
        if "docs/threads.md" not in paragraph:
            stray.append(rel)
    assert stray == []
