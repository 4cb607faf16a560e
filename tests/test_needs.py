"""Under CI a missing package, program or cluster fails the run; elsewhere the test is skipped."""

from __future__ import annotations

import subprocess

import pytest

import needs
from conftest import REPO


@pytest.mark.parametrize(
    "ask", [lambda: needs.module("no_such_module_for_relaytrain"), lambda: needs.program("no-such-tool", "x")]
)
def test_a_missing_need_fails_under_ci_and_skips_elsewhere(monkeypatch, ask):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        ask()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        ask()


def test_ci_run_sets_ci_before_the_tests():
    script = (REPO / ".ci" / "run").read_text()
    done = subprocess.run(
        ["bash", "-c", script.split("\nif ")[0].replace('cd "$(dirname "$0")/.."', "") + '\necho "CI=$CI"'],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip().endswith("CI=true"), done.stdout + done.stderr
