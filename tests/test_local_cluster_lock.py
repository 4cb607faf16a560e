"""One start or stop of the local cluster at a time (localcluster/lock.py): a second caller waits for
the first and then reuses its cluster. The interleaving is forced: another process holds the lock until
the test lets it go."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relaytrain.errors import UserError
from relaytrain.localcluster import lock

HOLDER = """
import sys, time
from pathlib import Path
from relaytrain.localcluster import lock
base, go = Path(sys.argv[1]), Path(sys.argv[2])
with lock.held(base):
    print("taken", flush=True)
    while not go.exists():
        time.sleep(0.05)
"""


def _hold_in_another_process(base: Path, go: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(base), str(go)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "taken"
    return holder


def test_a_second_caller_waits_until_the_first_lets_go(tmp_path):
    base, go = tmp_path / "cluster", tmp_path / "go"
    holder = _hold_in_another_process(base, go)
    entered = threading.Event()

    def second():
        with lock.held(base):
            entered.set()

    thread = threading.Thread(target=second)
    thread.start()
    try:
        assert not entered.wait(1.5), "the second caller went in while the first held the lock"
        go.touch()
        assert entered.wait(30), "the second caller never went in after the first let go"
    finally:
        go.touch()
        thread.join(30)
        holder.wait(30)


def test_waiting_too_long_is_one_line_naming_the_holder(tmp_path):
    base, go = tmp_path / "cluster", tmp_path / "go"
    holder = _hold_in_another_process(base, go)
    try:
        with pytest.raises(UserError, match=rf"pid {holder.pid}\).*{base.name}\.lock"), lock.held(base, 0.5):
            pass
    finally:
        go.touch()
        holder.wait(30)


def test_the_lock_is_reentrant_in_one_process(tmp_path):
    base = tmp_path / "cluster"
    start = time.monotonic()
    with lock.held(base, 2.0), lock.held(base, 2.0):  # cluster_up stops leftovers with cluster_down
        pass
    assert time.monotonic() - start < 2.0
    with lock.held(base, 0.5):  # and let go afterwards
        pass


@pytest.mark.slurm
def test_cluster_up_waits_for_a_start_in_progress_then_reuses_the_cluster(slurm_cluster, tmp_path):
    go = tmp_path / "go"
    holder = _hold_in_another_process(slurm_cluster.base_dir, go)
    up = subprocess.Popen(
        [sys.executable, "-m", "relaytrain.cli", "cluster", "up", "--nodes", str(len(slurm_cluster.nodes)),
         "--cpus-per-node", str(slurm_cluster.cpus_per_node)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        time.sleep(2.0)
        assert up.poll() is None, f"cluster up did not wait for the start in progress: {up.stdout.read()}"
        go.touch()
        out, _ = up.communicate(timeout=120)
        assert up.returncode == 0, out
        assert "already up" in out
    finally:
        go.touch()
        holder.wait(30)
        if up.poll() is None:
            up.kill()
