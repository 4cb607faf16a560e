"""Shared fixtures: subprocess runners for the CLI and torchrun, tiny configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest

# Every process of the suite runs one intra-op thread: the tests' own, torchrun's ranks and the Slurm jobs'
# tasks (which inherit the submitting environment). The tiny models gain nothing from more, and on the 2
# cores the suite is sized for, a second thread's OpenMP spin beside the other processes' work cost 5 to
# 10 times the CPU of a 1-thread run. Set before torch is first imported, which reads it then.
os.environ["OMP_NUM_THREADS"] = "1"
if "torch" in sys.modules:  # a plugin imported it first
    sys.modules["torch"].set_num_threads(1)
# The commands the tests run as written (`python -m ...`, `relaytrain ...`, in shells and in Slurm jobs,
# which inherit the submitting environment) find this interpreter's own folder first, as in an activated
# virtual environment: not a version manager's shim (pyenv's is a bash script that costs every start a
# second of wall time on a loaded machine), and never another Python.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

import needs
import prebuilt
from shared_runs import once_per_session
from slurm_fixtures import slurm_cluster, suite_cluster  # noqa: F401  (the real-Slurm fixtures)
from slurm_grouping import (  # noqa: F401  (the Slurm tests' lanes, their lock, a guard)
    pytest_collection_finish,
    pytest_configure_node,
    pytest_runtest_protocol,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_xdist_make_scheduler,
)

REPO = Path(__file__).resolve().parents[1]

# Property tests (hypothesis) draw the same examples on every machine, so the README's test command
# passes or fails the same way everywhere; a failure prints the example to paste back. To explore new
# draws on a developer's machine: HYPOTHESIS_PROFILE=explore python -m pytest tests/test_config_fuzz.py
hypothesis.settings.register_profile("fixed", derandomize=True, print_blob=True)
hypothesis.settings.register_profile("explore", derandomize=False, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's C++ ops, built on this machine before a test starts ranks that load them."""
    needs.module("deepspeed")
    done = prebuilt.build_under_lock()  # waits for the session's background build, then loads
    output = done.stdout[-2000:] + done.stderr[-4000:]
    assert done.returncode == 0, f"building DeepSpeed's ops failed:\n{output}"


@pytest.fixture(autouse=True)
def _no_cluster_unless_asked(request, monkeypatch):
    """The suite_cluster fixture exports SLURM_CONF for the rest of its worker's session; a test that does
    not ask for the cluster sees none, whichever worker runs it (the README's `plan` lines read the
    cluster's node memory through sinfo when one is reachable, and came out "impossible" on 7.8 GiB
    nodes on a worker that had started the cluster)."""
    if "slurm_cluster" not in request.fixturenames:
        monkeypatch.delenv("SLURM_CONF", raising=False)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what will not run
def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA GPU: without one they are deselected, not skipped (CI has no GPU
    to install, and a skip under CI is a failure: tests/needs.py). A session that will run a test needing
    DeepSpeed's ops starts building them now, beside the first tests (one process: the first xdist worker,
    or the session itself without xdist). Under xdist the tests marked ``slow`` are handed out first."""
    import torch

    worker = getattr(config, "workerinput", {}).get("workerid", "gw0")
    if worker == "gw0" and any("deepspeed_ops" in getattr(item, "fixturenames", ()) for item in items):
        config._relaytrain_prebuild = prebuilt.start_in_background()

    gpu_only = (
        [] if torch.cuda.is_available() else [item for item in items if item.get_closest_marker("cuda")]
    )
    if gpu_only:
        config.hook.pytest_deselected(items=gpu_only)
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
    if hasattr(config, "workerinput"):
        # Under xdist the long tests go first: a worker takes the next test whenever it finishes one, so a
        # long test left for the end runs alone while the other workers have nothing left to do.
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# A model small enough that a step takes milliseconds on one CPU core.
TINY = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=320",
    "--train.seq_len=32",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=4",
    "--optim.warmup_steps=2",
    "--train.eval_every=0",
    "--metrics.log_every=1",
    "--metrics.tensorboard=false",
]


def fake_tool(bin_dir: Path, name: str, body: str) -> None:
    """An executable bash script `bin_dir/name` (a stand-in for a Slurm tool on PATH)."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.pop("SLURM_JOB_ID", None)
    env.update(extra)
    return env


def run_cli(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relaytrain.cli", *args],
        cwd=cwd,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_in_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`relaytrain ARGS` through the command's own entry (`relaytrain.cli:main`) in this process, its
    stdout and stderr captured: for the commands that read a run (verify, status, report), whose
    interpreter's start-up (torch) would cost more CPU than the command. Training keeps its processes."""
    import contextlib
    import io

    from relaytrain.cli import main

    assert args and args[0] != "train", "a training runs in its own process (run_cli)"
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["relaytrain", *args], code, out.getvalue(), err.getvalue())


def run_torchrun(nproc: int, args: list[str], cwd: Path, timeout: float = 600, **env: str):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "relaytrain.cli",
            *args,
        ],
        cwd=cwd,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kill_after_snapshots(proc: subprocess.Popen, shm: Path, count: int = 2) -> Path:
    """SIGKILL a local run (`proc`, snapshots in `shm`) once its node folder holds `count` finished
    snapshots (stopped to look again: none is being replaced then); the node folder."""
    import signal
    import time

    from relaytrain.checkpoint.snapshot import store

    node = None
    while proc.poll() is None:
        node = node or next(shm.glob("relaytrain-local-*/*"), None)
        if node is not None and len(store.holdings(node)) >= count:
            proc.send_signal(signal.SIGSTOP)
            if len(store.holdings(node)) >= count:
                break
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before {count} snapshots were written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return node


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r.get("kind", "train") == kind]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.fixture(scope="session")
def stopped_and_resumed_run(tmp_path_factory) -> Path:
    """A tiny single-process run stopped at step 3 (saved there) and resumed to step 6, checkpoints every
    2 steps: for `relaytrain verify` (tests/test_verify.py, tests/test_readme.py, ...). Made once per session
    for every xdist worker (tests/shared_runs.py): copy it to change it."""

    def make(tmp: Path) -> None:
        args = ["train", *TINY, f"--run.dir={tmp / 'runs'}", "--run.name=r", "--train.max_steps=6"]
        for extra in (["--train.stop_at_step=3"], []):
            proc = run_cli([*args, "--checkpoint.interval=2", *extra], tmp)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    return once_per_session(tmp_path_factory, "stopped-and-resumed", make) / "runs" / "r"


@pytest.fixture
def tiny_args(tmp_path: Path) -> list[str]:
    return [*TINY, f"--run.dir={tmp_path / 'runs'}"]
