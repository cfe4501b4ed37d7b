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
