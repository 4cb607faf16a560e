"""The Slurm tests share one local cluster: they must all run on one xdist worker (slurm_grouping.py).

Each test here runs a small suite of its own under ``-n 2`` with the project's grouping plugin, whose
tests note the worker that ran them, and reads where they ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SLURM_MODULE = """
import os, time, pytest
pytestmark = pytest.mark.slurm

@pytest.mark.parametrize("i", range({n}))
def test_on_the_cluster(i):
    time.sleep(0.2)
    with open(os.environ["WHERE"], "a") as f:
        f.write("slurm " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""

MIXED_MODULE = """
import os, time, pytest

@pytest.mark.slurm
@pytest.mark.parametrize("i", range(3))
def test_marked(i):
    time.sleep(0.2)
    with open(os.environ["WHERE"], "a") as f:
        f.write("slurm " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    time.sleep(0.2)
    with open(os.environ["WHERE"], "a") as f:
        f.write("plain " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def _run_suite(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Counter]:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: uses the cluster\naddopts =\n")
    (tmp_path / "test_cluster_a.py").write_text(SLURM_MODULE.format(n=6))
    (tmp_path / "test_cluster_b.py").write_text(SLURM_MODULE.format(n=2))
    (tmp_path / "test_mixed.py").write_text(MIXED_MODULE)
    where = tmp_path / "where.txt"
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": str(TESTS)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "slurm_grouping", "-p", "no:cacheprovider", "-n", "2", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, Counter(where.read_text().split("\n")[:-1])


def test_every_slurm_test_runs_on_one_worker_while_the_other_runs_the_rest(tmp_path):
    done, ran = _run_suite(tmp_path, "--dist", "loadgroup", "-m", "slurm or not slurm")
    assert done.returncode == 0, done.stdout + done.stderr
    slurm_workers = {line.split()[1] for line in ran if line.startswith("slurm")}
    assert sum(n for line, n in ran.items() if line.startswith("slurm")) == 11
    assert len(slurm_workers) == 1, ran
    plain_workers = {line.split()[1] for line in ran if line.startswith("plain")}
    assert plain_workers - slurm_workers, f"the other worker ran none of the plain tests: {ran}"


def test_a_selection_of_slurm_tests_stays_on_one_worker(tmp_path):
    done, ran = _run_suite(tmp_path, "--dist", "loadgroup", "-m", "slurm", "test_cluster_a.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(ran) == 1 and sum(ran.values()) == 6, ran


def test_the_session_fails_when_slurm_tests_ran_on_two_workers(tmp_path):
    # Plain load balancing spreads the marked tests over both workers: the guard must fail the run.
    done, ran = _run_suite(tmp_path, "--dist", "load")
    assert len({line.split()[1] for line in ran if line.startswith("slurm")}) == 2, ran
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Slurm tests ran on 2 xdist workers" in done.stdout
