"""The Slurm tests in lanes, each on one xdist worker and on nodes of its own of the one local cluster.

The tests marked ``slurm`` share the one local cluster. Each test module is in one lane (``LANES``); the
controller schedules each lane as one unit of work, so a lane's modules run one after another on one
worker, and the lanes run at once. Each lane has nodes and partitions of its own
(tests/slurm_fixtures.py), so a module that kills nodes or needs idle nodes has its lane's nodes to
itself. Two kinds of module run while no other lane has jobs: one that needs the whole cluster (it stops
the cluster, or starts clusters of its own: ``WHOLE_CLUSTER``) and one that times ranks against each
other, which other lanes' processes on the same 2 cores would disturb (``QUIET``); each is listed with
the reason. Such a module holds the cluster lock exclusively, the others hold it shared. A module not
listed in ``LANES`` is in lane 1 and needs the whole cluster. A ``QUIET`` module also holds the machine's
lock exclusively, which every test not marked ``slurm`` holds shared while it runs: the tests that time
ranks against each other run with nothing else on the cores. Both locks let a waiting exclusive holder in
before new shared ones (``_hold``): without it the shared holders, one after another, keep it out.

pytest-xdist's own ``xdist_group`` mark renames each item's node id on the worker (``item._nodeid``);
from pytest 9.1 on a node id is computed from ``item._id`` and the rename is lost, so the groups
silently fall apart. Here the controller is told the Slurm tests' node ids by the workers themselves
(a file per worker, written before the worker reports its collection) and schedules them with a
scheduler of its own.

A guard checks the outcome too: each Slurm test notes the worker it ran on, and the session fails when
one lane's tests ran on two workers.

tests/conftest.py imports the hooks; tests/test_slurm_grouping.py runs small suites with them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

GROUP = "slurm"
_DIR_KEY = "relaytrain_slurm_group_dir"

# Each Slurm test module's lane, balanced by the modules' measured durations (--durations=0): the modules
# that run alone (WHOLE_CLUSTER, QUIET) stop every lane while they run, so lane 1 holds them, and the
# others are shared out evenly.
LANES = {
    "test_local_cluster.py": 1,
    "test_local_cluster_lock.py": 1,
    "test_readme.py": 1,
    "test_straggler_slurm.py": 1,
    "test_preflight_slurm.py": 1,
    "test_e2e_slurm.py": 1,
    "test_crash_recovery.py": 1,
    "test_run_lock.py": 1,
    "test_snapshot_slurm.py": 1,
    "test_notify_slurm.py": 2,
    "test_howto_slurm.py": 2,
    "test_elastic_slurm.py": 2,
    "test_hang_slurm.py": 2,
    "test_cli_without_slurm.py": 2,
    "test_survivors_slurm.py": 2,
    "test_e2e_stacks.py": 3,
    "test_bench_chaos.py": 3,
    "test_bench_goodput.py": 3,
    "test_spare_slurm.py": 3,
    "test_e2e_programs.py": 3,
}
LANE_COUNT = max(LANES.values())
# The modules that need the whole cluster, and why. Every other module has its lane's nodes.
WHOLE_CLUSTER = {
    "test_local_cluster.py": "stops and restarts the cluster; preempts a job on every node",
    "test_local_cluster_lock.py": "starts and stops clusters of its own beside the suite's",
    "test_readme.py": "its documented cluster walkthroughs start the cluster and end with "
    "`relaytrain cluster down`, which cancels every job on the cluster",
}
# The modules that run on their lane's nodes while no other lane has jobs and no other test runs, and why.
QUIET = {
    "test_straggler_slurm.py": "the throttled rank is named against its peer's times: other lanes' ranks "
    "and other tests on the same cores slow one rank's steps more than the other's",
    "test_preflight_slurm.py": "a clean node's compute must stay within 40 % of the others'; a 2-node job "
    "and its spare",
}


def is_slurm_test(item: pytest.Item) -> bool:
    return item.get_closest_marker(GROUP) is not None


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::")[0]).name


def lane_number(nodeid: str) -> int:
    return LANES.get(_module(nodeid), 1)


def lane_of(nodeid: str) -> str:
    return f"{GROUP}-lane-{lane_number(nodeid)}"


def needs_whole_cluster(nodeid: str) -> bool:
    return _module(nodeid) in WHOLE_CLUSTER or _module(nodeid) not in LANES


def runs_alone(nodeid: str) -> bool:
    """Whether the module runs while no other lane has jobs."""
    return needs_whole_cluster(nodeid) or _module(nodeid) in QUIET


def _group_dir(config: pytest.Config) -> Path:
    """The controller's folder for the workers' notes (made once per session)."""
    if not hasattr(config, "_relaytrain_slurm_group_dir"):
        config._relaytrain_slurm_group_dir = Path(tempfile.mkdtemp(prefix="relaytrain-xdist-"))
    return config._relaytrain_slurm_group_dir


def worker_dir(config: pytest.Config) -> Path | None:
    """On an xdist worker, the controller's folder for the workers' notes; None without xdist."""
    workerinput = getattr(config, "workerinput", None)
    return Path(workerinput[_DIR_KEY]) if workerinput and _DIR_KEY in workerinput else None


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Controller: tell each worker where to leave its notes."""
    node.workerinput[_DIR_KEY] = str(_group_dir(node.config))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Worker: name the Slurm tests before xdist's own hook reports the collection."""
    folder = worker_dir(session.config)
    if folder is None:
        return
    ids = sorted(item.nodeid for item in session.items if is_slurm_test(item))
    worker = session.config.workerinput["workerid"]
    _write_atomically(folder / f"collected-{worker}.json", json.dumps(ids))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Controller: with ``--dist loadgroup``, every Slurm test is one unit of work."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    folder = _group_dir(config)

    class SlurmGroupScheduling(LoadGroupScheduling):
        _slurm_ids: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._slurm_ids is None:  # first asked once every worker has collected
                self._slurm_ids = set()
                for path in folder.glob("collected-*.json"):
                    self._slurm_ids.update(json.loads(path.read_text()))
            return lane_of(nodeid) if nodeid in self._slurm_ids else super()._split_scope(nodeid)

    return SlurmGroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Worker: note where each Slurm test ran."""
    folder = worker_dir(item.config)
    if folder is not None and is_slurm_test(item):
        worker = item.config.workerinput["workerid"]
        with open(folder / f"ran-{worker}.txt", "a") as notes:
            notes.write(item.nodeid + "\n")
    yield


def _hold(path: Path, exclusive: bool):
    """``path`` opened and flocked, exclusively or shared; closing it lets go. A waiting exclusive holder
    goes before shared ones that come after it: every taker first takes ``<path>.turnstile``, a shared
    one for as long as it waits, an exclusive one until it holds ``path`` (flock itself lets shared holders
    in while an exclusive one waits, so back-to-back shared holds would keep it out for good)."""
    with open(path.with_name(path.name + ".turnstile"), "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        held = open(path, "a")  # noqa: SIM115 - the caller closes it
        fcntl.flock(held, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    return held


class _ClusterLock:
    """This worker's hold on the cluster lock: taken before a module's first Slurm test (its module
    fixtures' jobs included), let go after the last one on this worker (their teardown included). A
    ``QUIET`` module holds the machine's lock too."""

    module: str | None = None
    files: tuple = ()

    @classmethod
    def take(cls, folder: Path, nodeid: str) -> None:
        if cls.module == _module(nodeid):
            return
        cls.let_go()
        files = [_hold(folder / "cluster.lock", runs_alone(nodeid))]
        if _module(nodeid) in QUIET:  # after the cluster's: one order for every taker of both
            files.append(_hold(folder / "machine.lock", exclusive=True))
        cls.files, cls.module = tuple(files), _module(nodeid)

    @classmethod
    def let_go(cls) -> None:
        for held in cls.files:
            held.close()  # releases the flock
        cls.files, cls.module = (), None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Worker: a Slurm test runs under the cluster lock, exclusive for a module that runs alone, shared
    otherwise; any other test under the machine's lock, shared."""
    folder = worker_dir(item.config)
    if folder is None:
        yield
        return
    if not is_slurm_test(item):
        with _hold(folder / "machine.lock", exclusive=False):
            yield
        return
    _ClusterLock.take(folder, item.nodeid)
    yield
    if nextitem is None or not is_slurm_test(nextitem) or _module(nextitem.nodeid) != _module(item.nodeid):
        _ClusterLock.let_go()


def workers_that_ran_slurm_tests(config: pytest.Config) -> dict[str, list[str]]:
    folder = _group_dir(config)
    return {
        path.stem.removeprefix("ran-"): path.read_text().split() for path in sorted(folder.glob("ran-*.txt"))
    }


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    """Controller: fail the session when one lane's Slurm tests ran on more than one worker."""
    config = session.config
    if worker_dir(config) is not None or not hasattr(config, "_relaytrain_slurm_group_dir"):
        return
    ran = workers_that_ran_slurm_tests(config)
    from slurm_fixtures import stop_the_cluster_a_worker_started  # it imports this module

    stop_the_cluster_a_worker_started(_group_dir(config))
    shutil.rmtree(_group_dir(config), ignore_errors=True)
    by_lane: dict[str, dict[str, list[str]]] = {}
    for worker, ids in ran.items():
        for nodeid in ids:
            by_lane.setdefault(lane_of(nodeid), {}).setdefault(worker, []).append(nodeid)
    for lane, workers in sorted(by_lane.items()):
        if len(workers) > 1:
            where = "; ".join(f"{worker}: {len(ids)} ({ids[0]} ...)" for worker, ids in workers.items())
            config.get_terminal_writer().line(
                f"ERROR: Slurm tests of {lane} ran on {len(workers)} xdist workers, which race for the one "
                f"local cluster: {where}",
                red=True,
            )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
