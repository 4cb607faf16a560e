"""The README opens with exactly the two quickstart commands, and CI runs the second one."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block and text.index(block.group(0)) < 200, "the README must open with the quickstart block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_commands():
    commands = quickstart_commands()
    assert len(commands) == 2
    assert commands[0].endswith("relaytrain train")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert quickstart_commands()[1] in ci


def test_torch_is_pinned_exactly():
    assert '"torch==2.13.0"' in (REPO / "pyproject.toml").read_text()
