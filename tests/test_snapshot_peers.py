"""Two ranks on two (simulated) nodes: each rank's snapshot is replicated to the other node, and after a
crash that also wiped one node's snapshot folder the run resumes from the peer's replica, bit for bit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relaytrain.checkpoint.snapshot import store

import faults
from conftest import child_env, losses_by_step

# Each rank names its own node (as SLURMD_NODENAME does on a cluster): node0, node1.
WRAPPER = """import os, runpy, sys
os.environ["SLURMD_NODENAME"] = "node" + os.environ["RANK"]
sys.argv = ["relaytrain", *sys.argv[1:]]
runpy.run_module("relaytrain.cli", run_name="__main__")
"""


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def _torchrun(tmp_path, args):
    wrapper = tmp_path / "as_node.py"
    wrapper.write_text(WRAPPER)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return [*launcher, str(wrapper), *args]


@pytest.mark.slow
def test_wiped_node_resumes_from_the_peer_replica(tmp_path, tiny_args):
    shm = tmp_path / "shm"
    args = ["train", *tiny_args, "--train.max_steps=7", "--checkpoint.interval=0"]
    args += ["--checkpoint.snapshot_every=1", f"--checkpoint.snapshot_dir={shm}"]
    ref = subprocess.run(
        _torchrun(tmp_path, [*args, "--run.name=ref"]),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "1 replica(s) on other nodes" in ref.stdout + ref.stderr

    pipe = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    cut = _torchrun(tmp_path, [*args, "--run.name=cut"])
    proc = subprocess.Popen(
        cut, cwd=tmp_path, env=child_env(**faults.env(step_delay_s=0.3)), start_new_session=True, **pipe
    )
    log = tmp_path / "runs/cut/logs/rank_0.log"
    deadline = time.monotonic() + 300
    while "snapshot step 4:" not in (log.read_text() if log.is_file() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 4"
        time.sleep(0.05)
    for pid in [*_descendants(proc.pid), proc.pid]:  # the whole job: both ranks and the launcher
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    root = next(shm.glob("relaytrain-local-*"))
    held = {node: store.holdings(root / node) for node in ("node0", "node1")}
    # every node keeps its own rank's file and the other's replica (the kill may cut the newest step short)
    assert all(any(sorted(h[s]) == [0, 1] for s in h) for h in held.values()), held
    shutil.rmtree(root / "node1")  # node 1 lost its memory with its processes

    again = subprocess.run(cut, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "(1 of 2 rank file(s) from a peer node)" in log.read_text()
    assert losses_by_step(tmp_path / "runs/cut") == losses_by_step(tmp_path / "runs/ref")
