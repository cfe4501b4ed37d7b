"""The README and docs/api.md stay true: every python example runs, the Quickstart has two
commands, CI runs the second, the command-line table and the PyTorch section say what users need."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
# The pages whose python examples are run: the README and the API guide.
PAGES = {"README.md": README, "docs/api.md": API}


def _python_blocks(text: str = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _examples() -> list[tuple[str, int]]:
    return [(page, i) for page, text in PAGES.items() for i in range(len(_python_blocks(text)))]


def _quickstart_commands() -> list[str]:
    m = re.search(r"^## Quickstart\s*$(.*?)(?=^## )", README, re.S | re.M)
    assert m, "README has no '## Quickstart' section"
    blocks = re.findall(r"```[a-z]*\n(.*?)```", m.group(1), re.S)
    return [
        line.strip()
        for b in blocks
        for line in b.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_readme_quickstart_has_exactly_two_commands() -> None:
    cmds = _quickstart_commands()
    assert len(cmds) == 2, cmds
    assert "shmrdv demo" in cmds[0]
    assert "pytest" in cmds[1]


def test_readme_ci_runs_the_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _quickstart_commands()[1] in ci.splitlines()


def test_readme_has_python_examples() -> None:
    assert len(_python_blocks()) >= 3
    assert len(_python_blocks(API)) >= 4  # the guide, backpressure, bounds, PyTorch


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("page", "index"), _examples())
@pytest.mark.slow
def test_readme_example_runs(page: str, index: int, tmp_path: Path) -> None:
    block = _python_blocks(PAGES[page])[index]
    if re.search(r"^import torch$", block, re.M):
        pytest.importorskip("torch")  # the "PyTorch users" example runs where torch is
    env = dict(os.environ)
    env.pop("SHMRDV_NAMESPACE", None)
    if "def test_" in block:
        # An example test file: run it the way the README says, with pytest --shmrdv.
        script = tmp_path / f"test_readme_example_{index}.py"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--shmrdv",
            "-p",
            "no:cacheprovider",
            str(script),
        ]
    else:
        script = tmp_path / f"readme_example_{index}.py"
        cmd = [sys.executable, str(script)]
    script.write_text(block, encoding="utf-8")
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, f"{page} example {index} failed:\n{proc.stdout}\n{proc.stderr}"


def _section(title: str, page: str = "README.md") -> str:
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", PAGES[page], re.S | re.M)
    assert m, f"{page} has no '## {title}' section"
    return m.group(1)


def _cli_table() -> dict[str, str]:
    """The command line table: the command's first word -> the whole row."""
    rows = {}
    for line in _section("Command line").splitlines():
        m = re.match(r"\| `(\w+)", line)
        if m:
            rows.setdefault(m.group(1), "")
            rows[m.group(1)] += line
    return rows


def test_readme_cli_table_names_every_command_and_its_namespace_option() -> None:
    rows = _cli_table()
    assert set(rows) == {"demo", "bench", "ls", "gc", "serve", "namespace"}, set(rows)
    for command in ("ls", "gc", "serve"):
        assert "--namespace" in rows[command], rows[command]
    assert "TF_CONFIG" in rows["serve"] and "SHMRDV_NAMESPACE" in rows["serve"]


def test_readme_cli_table_says_plot_needs_the_plot_extra() -> None:
    row = _cli_table()["bench"]
    assert "--plot" in row and "matplotlib" in row and "[plot]" in row, row


def test_readme_cli_table_explains_the_two_hosts_comparison() -> None:
    row = _cli_table()["demo"]
    assert "--hosts 2" in row and "network path" in row and "same-host" in row, row


def test_api_pytorch_section_has_a_torch_example() -> None:
    body = _section("PyTorch users", "docs/api.md")
    (block,) = re.findall(r"```python\n(.*?)```", body, re.S)
    assert ".numpy()" in block and "torch.from_numpy" in block


def test_api_pytorch_section_says_it_needs_torch_before_its_example() -> None:
    prose = _section("PyTorch users", "docs/api.md").split("```python", 1)[0]
    assert "needs PyTorch" in prose and "pip install torch" in prose, prose


def test_readme_links_the_pytorch_section() -> None:
    assert "](docs/api.md#pytorch-users)" in README
    assert "\n## PyTorch users\n" in (ROOT / "docs" / "api.md").read_text(encoding="utf-8")


def test_readme_is_a_short_page() -> None:
    assert len(README.splitlines()) <= 250


def test_readme_states_no_test_counts() -> None:
    # Counts go stale with every test added (it said 1,405 when 1,406 were collected).
    for page, text in PAGES.items():
        counts = re.findall(r"\b\d[\d,]*\s+tests\b", text)
        assert not counts, f"{page} states test counts that go stale: {counts}"
