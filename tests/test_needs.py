"""Under CI a missing package, program or cluster fails the run; elsewhere the test is skipped."""

from __future__ import annotations

import re
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


# The skips that do not depend on what the machine has installed, each with its reason.
NOT_AN_INSTALL_STEP = {
    "test_bench.py": "a machine with a GPU would run the hour-long GPU script; CI has none",
    "test_monitor_gpu.py": "POSIX signals and executables: not on Windows (a platform gate)",
    "test_torch_private.py": "torch releases that lack private names plan --simulate needs (a version gate)",
}


def test_no_test_skips_past_ci():
    """Every skip goes through tests/needs.py (a failure under CI), except the version and GPU gates
    above: a raw `pytest.skip` would hide a broken install step under CI."""
    raw = re.compile(r"pytest\.skip\(|pytest\.mark\.skipif|importorskip\(")
    found = sorted(
        path.name
        for path in (REPO / "tests").glob("*.py")
        if path.name not in ("needs.py", "test_needs.py") and raw.search(path.read_text())
    )
    assert found == sorted(NOT_AN_INSTALL_STEP), found
