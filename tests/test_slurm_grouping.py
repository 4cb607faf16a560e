"""The Slurm tests share one local cluster: each lane on one xdist worker, the lanes at once, a module
that needs the whole cluster never beside another (slurm_grouping.py).

Each test here runs a small suite of its own under xdist with the project's grouping plugin, whose
tests note the worker that ran them, and reads where they ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

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
    assert "Slurm tests of slurm-lane-1 ran on 2 xdist workers" in done.stdout


def _run_grouped(tmp_path: Path, workers: int = 2, **env: str) -> subprocess.CompletedProcess:
    """The small suite in `tmp_path` under ``-n workers --dist loadgroup`` with the grouping plugin."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "slurm_grouping", "-p", "no:cacheprovider", "-n", str(workers),
         "--dist", "loadgroup"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(TESTS), **env}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


# Modules named as in slurm_grouping's tables: one of each lane that shares the cluster, and one that runs
# alone: it needs the whole cluster, or the cluster quiet. Each test notes when it held the cluster. Lane 1's
# shared module is short and the others long, so the lone module (in lane 1, after it) is ready to start
# while the other lanes still have tests to run.
TIMED_MODULE = """
import json, os, time, pytest
pytestmark = pytest.mark.slurm

@pytest.mark.parametrize("i", range({n}))
def test_on_the_cluster(i):
    start = time.monotonic()
    time.sleep(0.4)
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps([__name__, os.environ["PYTEST_XDIST_WORKER"], start, time.monotonic()]) + "\\n")
"""
IN_LANES = ("test_crash_recovery.py", "test_hang_slurm.py", "test_e2e_stacks.py")
ALONE = ("test_local_cluster.py", "test_straggler_slurm.py")


@pytest.mark.parametrize("alone", ALONE)
def test_the_lanes_run_at_once_and_a_module_that_runs_alone_never_beside_another(tmp_path, alone):
    import json

    import slurm_grouping

    assert [slurm_grouping.LANES[m] for m in (*IN_LANES, alone)] == [
        1,
        2,
        3,
        1,
    ] and slurm_grouping.LANE_COUNT == 3
    assert not any(slurm_grouping.runs_alone(m) for m in IN_LANES) and slurm_grouping.runs_alone(alone)
    assert ALONE[0] in slurm_grouping.WHOLE_CLUSTER and ALONE[1] in slurm_grouping.QUIET
    assert IN_LANES[0] < alone  # lane 1 runs its modules in this order
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: uses the cluster\naddopts =\n")
    for name, tests in ((IN_LANES[0], 2), (IN_LANES[1], 10), (IN_LANES[2], 10), (alone, 2)):
        (tmp_path / name).write_text(TIMED_MODULE.format(n=tests))
    where = tmp_path / "where.txt"
    done = _run_grouped(tmp_path, workers=len(IN_LANES), WHERE=str(where))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in where.read_text().splitlines()]
    spans: dict[str, tuple[float, float]] = {}
    for module, _, start, end in rows:
        first, last = spans.get(module, (start, end))
        spans[module] = (min(first, start), max(last, end))
    workers = {module: {w for m, w, *_ in rows if m == module} for module in spans}
    assert all(len(w) == 1 for w in workers.values()), workers
    lanes = [next(iter(workers[name.removesuffix(".py")])) for name in IN_LANES]
    assert len(set(lanes)) == len(IN_LANES), workers  # a worker a lane

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    lone = alone.removesuffix(".py")
    assert not any(overlap(lone, other) for other in spans if other != lone), spans
    names = [name.removesuffix(".py") for name in IN_LANES]
    assert all(overlap(a, b) for a in names for b in names if a < b), spans


# The cluster's life in a small suite: a stand-in for relaytrain.localcluster.cluster that notes when it
# was started and stopped, so that the order of the workers' ends can be read.
FAKE_CLUSTER_CONFTEST = """
import json, os, time, types
import slurm_fixtures
from slurm_fixtures import slurm_cluster, suite_cluster  # noqa: F401

STATE = os.environ["CLUSTER_STATE"]

def _info(started):
    nodes = [f"n{k}" for k in range(1, slurm_fixtures.CLUSTER_NODES + 1)]
    return types.SimpleNamespace(base_dir=STATE, nodes=nodes, env={}, started=started, cpus_per_node=4)

def running_cluster():
    return _info(False) if os.path.exists(STATE) else None

def cluster_up(nodes, cpus_per_node):
    try:
        os.close(os.open(STATE, os.O_CREAT | os.O_EXCL))
        return _info(True)
    except FileExistsError:
        return _info(False)

def cluster_down(base_dir):
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps(["down", base_dir, time.monotonic()]) + "\\n")

slurm_fixtures.local_cluster = types.SimpleNamespace(
    running_cluster=running_cluster, cluster_up=cluster_up, cluster_down=cluster_down,
    has_node_memory=lambda base: True)
slurm_fixtures._why_slurm_cannot_start = lambda: None
slurm_fixtures.lane_view = lambda info, module: info
"""
# One lane starts the cluster and is done at once; the other asks for it a moment later and is still
# using it a few seconds after the first lane's worker has finished.
LANE_MODULE = """
import json, os, time, pytest
pytestmark = pytest.mark.slurm

def test_on_the_cluster(request):
    time.sleep({before})
    request.getfixturevalue("slurm_cluster")
    time.sleep({after})
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps(["test", __name__, time.monotonic()]) + "\\n")
"""


def test_the_cluster_a_worker_started_is_stopped_after_every_worker_is_done(tmp_path):
    import json

    import slurm_grouping

    quick, slow = "test_readme.py", "test_hang_slurm.py"
    assert (slurm_grouping.LANES[quick], slurm_grouping.LANES[slow]) == (1, 2)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: uses the cluster\naddopts =\n")
    (tmp_path / "conftest.py").write_text(FAKE_CLUSTER_CONFTEST)
    (tmp_path / quick).write_text(LANE_MODULE.format(before=0, after=0))
    (tmp_path / slow).write_text(LANE_MODULE.format(before=1.5, after=3))
    where = tmp_path / "where.txt"
    done = _run_grouped(tmp_path, WHERE=str(where), CLUSTER_STATE=str(tmp_path / "state"))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in where.read_text().splitlines()]
    downs = [row for row in rows if row[0] == "down"]
    ends = {row[1]: row[2] for row in rows if row[0] == "test"}
    assert set(ends) == {"test_readme", "test_hang_slurm"}, rows
    assert len(downs) == 1 and downs[0][1] == str(tmp_path / "state"), rows  # stopped once, the one started
    assert downs[0][2] > max(ends.values()), rows  # not while the slow lane still used it


# A running cluster too small for the suite's lanes: each lane's worker asks for it at once, and each
# looks at it for a while first (the race forced: every look would see the small one without the lock).
SMALL_CLUSTER_CONFTEST = """
import json, os, time, types
import slurm_fixtures
from slurm_fixtures import slurm_cluster, suite_cluster  # noqa: F401

STATE = os.environ["CLUSTER_STATE"]

def _note(what):
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps([what, time.monotonic()]) + "\\n")

def running_cluster():
    if not os.path.exists(STATE):
        return None
    nodes = int(open(STATE).read())
    time.sleep(1.5)
    return types.SimpleNamespace(base_dir=STATE, nodes=[f"n{k}" for k in range(nodes)], env={},
                                 started=False, cpus_per_node=4)

def cluster_up(nodes, cpus_per_node):
    _note("up")
    open(STATE, "w").write(str(nodes))
    return types.SimpleNamespace(base_dir=STATE, nodes=[f"n{k}" for k in range(nodes)], env={},
                                 started=True, cpus_per_node=4)

def cluster_down(base_dir):
    _note("down")
    os.remove(STATE)

slurm_fixtures.local_cluster = types.SimpleNamespace(
    running_cluster=running_cluster, cluster_up=cluster_up, cluster_down=cluster_down,
    has_node_memory=lambda base: True)
slurm_fixtures._why_slurm_cannot_start = lambda: None
slurm_fixtures.lane_view = lambda info, module: info
"""


def test_a_cluster_too_small_for_the_lanes_is_restarted_once_while_every_lane_asks_for_it(tmp_path):
    import json

    import slurm_fixtures

    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: uses the cluster\naddopts =\n")
    (tmp_path / "conftest.py").write_text(SMALL_CLUSTER_CONFTEST)
    for name in IN_LANES:
        (tmp_path / name).write_text(LANE_MODULE.format(before=0, after=0))
    state, where = tmp_path / "state", tmp_path / "where.txt"
    state.write_text(str(slurm_fixtures.NODES_PER_LANE))
    done = _run_grouped(tmp_path, workers=len(IN_LANES), WHERE=str(where), CLUSTER_STATE=str(state))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in where.read_text().splitlines()]
    assert [row[0] for row in rows if row[0] in ("down", "up")] == ["down", "up"], rows
    assert sum(row[0] == "test" for row in rows) == len(IN_LANES), rows


PLAIN_MODULE = """
import json, os, time

def test_plain(i=0):
    pass

def _note(start):
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps(["plain", os.environ["PYTEST_XDIST_WORKER"], start, time.monotonic()]) + "\\n")
""" + "".join(
    f"\ndef test_plain_{k}():\n    start = time.monotonic()\n    time.sleep(0.15)\n    _note(start)\n"
    for k in range(24)
)


@pytest.mark.parametrize("alone", ALONE)
def test_a_quiet_module_runs_while_no_other_test_runs(tmp_path, alone):
    """A ``QUIET`` module holds the machine's lock: no plain test runs beside it on another worker; a
    module that only needs the whole cluster lets them (the check sees an overlap where there is one)."""
    import json

    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: uses the cluster\naddopts =\n")
    (tmp_path / alone).write_text(TIMED_MODULE.format(n=3))
    (tmp_path / "test_plain.py").write_text(PLAIN_MODULE)
    where = tmp_path / "where.txt"
    done = _run_grouped(tmp_path, workers=2, WHERE=str(where))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in where.read_text().splitlines()]
    lone = [(start, end) for name, _, start, end in rows if name != "plain"]
    first, last = min(s for s, _ in lone), max(e for _, e in lone)
    plain = [(start, end) for name, _, start, end in rows if name == "plain"]
    assert len(lone) == 3 and len(plain) == 24, rows
    beside = [(s, e) for s, e in plain if s < last and first < e]
    if alone == "test_straggler_slurm.py":
        assert not beside, (first, last, beside)
    else:
        assert beside, (first, last, plain)


def test_a_waiting_exclusive_holder_goes_before_later_shared_ones(tmp_path):
    """The locks' turnstile: with a shared hold taken, an exclusive taker waits; a shared taker that comes
    after it waits behind it, where flock alone would let it in at once."""
    import threading
    import time

    import slurm_grouping

    path, order = tmp_path / "cluster.lock", []
    first = slurm_grouping._hold(path, exclusive=False)

    def take(name: str, exclusive: bool) -> None:
        with slurm_grouping._hold(path, exclusive):
            order.append(name)
            time.sleep(0.1)

    writer = threading.Thread(target=take, args=("exclusive", True))
    reader = threading.Thread(target=take, args=("shared", False))
    writer.start()
    time.sleep(0.3)  # the exclusive taker is waiting
    reader.start()
    time.sleep(0.3)
    assert order == [], order  # neither got in while the first shared hold is kept
    first.close()
    writer.join(10)
    reader.join(10)
    assert order == ["exclusive", "shared"], order
