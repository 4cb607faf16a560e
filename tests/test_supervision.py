"""The supervision front (resilience/rank/supervision.py) is the loop's one way to watch itself: the trainer,
and `relaytrain.program` for a user's own loop, build none of its parts and reach none of them past it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "relaytrain"
LOOPS = [SRC / "trainer.py", SRC / "program.py"]
# What the front owns: the trainer names none of them
PARTS = {"ShutdownController", "NanGuard", "HangWatchdog", "StragglerWatch", "StackSignal", "ProgressBoard",
         "StepClock", "controller", "nan_guard", "straggler", "stacks", "progress"}  # fmt: skip


def _offences(source: str, file: str = "trainer.py") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        name = (
            node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        )
        if name in PARTS:
            found.append(f"{file}:{node.lineno}: {name}")
        if isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] in PARTS:
            found.append(f"{file}:{node.lineno}: imports {node.name}")
    return found


@pytest.mark.parametrize("loop", LOOPS, ids=lambda p: p.name)
def test_the_loops_reach_the_supervision_parts_only_through_the_front(loop):
    offenders = _offences(loop.read_text(), loop.name)
    assert not offenders, "go through Supervision:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "source",
    [
        "from relaytrain.resilience import NanGuard\n",
        "self.controller = ShutdownController(cfg)\n",
        "reason = self.supervision.controller.agree(step)\n",
        "self.straggler.verdict\n",
    ],
)
def test_the_scan_sees_a_part_used_past_the_front(source):
    assert _offences(source)
