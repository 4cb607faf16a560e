"""Every Slurm test on one xdist worker, whatever the pytest version.

The tests marked ``slurm`` share the one local cluster, so one worker must run them one after another
while the other worker runs the rest. pytest-xdist's own ``xdist_group`` mark renames each item's node
id on the worker (``item._nodeid``); from pytest 9.1 on a node id is computed from ``item._id`` and the
rename is lost, so the groups silently fall apart. Here the controller is told the Slurm tests' node
ids by the workers themselves (a file per worker, written before the worker reports its collection)
and schedules them as one group with a scheduler of its own.

A guard checks the outcome too: each Slurm test notes the worker it ran on, and the session fails when
Slurm tests ran on two workers.

tests/conftest.py imports the hooks; tests/test_slurm_grouping.py runs a small suite with them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

GROUP = "slurm"
_DIR_KEY = "relaytrain_slurm_group_dir"


def is_slurm_test(item: pytest.Item) -> bool:
    return item.get_closest_marker(GROUP) is not None


def _group_dir(config: pytest.Config) -> Path:
    """The controller's folder for the workers' notes (made once per session)."""
    if not hasattr(config, "_relaytrain_slurm_group_dir"):
        config._relaytrain_slurm_group_dir = Path(tempfile.mkdtemp(prefix="relaytrain-xdist-"))
    return config._relaytrain_slurm_group_dir


def _worker_dir(config: pytest.Config) -> Path | None:
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
    folder = _worker_dir(session.config)
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
            return GROUP if nodeid in self._slurm_ids else super()._split_scope(nodeid)

    return SlurmGroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Worker: note where each Slurm test ran."""
    folder = _worker_dir(item.config)
    if folder is not None and is_slurm_test(item):
        worker = item.config.workerinput["workerid"]
        with open(folder / f"ran-{worker}.txt", "a") as notes:
            notes.write(item.nodeid + "\n")
    yield


def workers_that_ran_slurm_tests(config: pytest.Config) -> dict[str, list[str]]:
    folder = _group_dir(config)
    return {
        path.stem.removeprefix("ran-"): path.read_text().split() for path in sorted(folder.glob("ran-*.txt"))
    }


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    """Controller: fail the session when Slurm tests ran on more than one worker."""
    config = session.config
    if _worker_dir(config) is not None or not hasattr(config, "_relaytrain_slurm_group_dir"):
        return
    ran = workers_that_ran_slurm_tests(config)
    shutil.rmtree(_group_dir(config), ignore_errors=True)
    if len(ran) > 1:
        where = "; ".join(f"{worker}: {len(ids)} ({ids[0]} ...)" for worker, ids in ran.items())
        config.get_terminal_writer().line(
            f"ERROR: Slurm tests ran on {len(ran)} xdist workers, which race for the one local cluster: "
            f"{where}",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
