"""End-to-end resilience through `relaytrain train` under torchrun (gloo, CPU, 2 ranks).

One scenario per launch, chained where a launch can prove several things:
signal to one rank -> same-step stop + resume code; time-budget stop + requeue (fake end time, fake
scontrol); final resume bit-exact against an uninterrupted run; a finished run refuses to restart;
a hung rank -> watchdog dump + exit 86; NaN rollback (N=2) and skip escalating to stop (N=1).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relaytrain.resilience import EXIT_NONFINITE

import faults
from conftest import TINY, child_env, run_cli
from shared_runs import once_per_session

pytestmark = pytest.mark.slow

STEPS = 24
BASE = [*TINY, f"--train.max_steps={STEPS}", "--checkpoint.interval=0", "--metrics.rank_logs=true"]


def torchrun_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "relaytrain.cli",
        "train",
        *BASE,
        f"--run.dir={run_dir.parent}",
        f"--run.name={run_dir.name}",
        *extra,
    ]


def start(run_dir: Path, *extra: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_cmd(run_dir, *extra),
        env=child_env(**env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in lines if r.get("kind") == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}  # later runs overwrite replayed steps


def marker(run_dir: Path) -> dict:
    return json.loads((run_dir / "run_state.json").read_text())


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in records(run_dir, "train")):
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended before step {step}: {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no step {step} within {timeout} s")


def worker_pid(parent: int, rank: int) -> int:
    """The pid of the torchrun worker with RANK=rank among the descendants of ``parent``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo = list(children.get(parent, []))
    while todo:
        pid = todo.pop()
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
        todo.extend(children.get(pid, []))
    raise AssertionError(f"no worker with RANK={rank} under pid {parent}")


def exit_codes(torchrun_output: str) -> set[str]:
    return set(re.findall(r"exitcode\s*:\s*(-?\d+)", torchrun_output))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The losses of an uninterrupted 2-rank run of BASE, step by step: the reference of the bit-exact
    checks here (made once per session: its tests may run on several xdist workers)."""

    def plain(folder: Path) -> None:
        rc, out = finish(start(folder / "reference"))
        assert rc == 0, out[-3000:]

    reference = losses(once_per_session(tmp_path_factory, "two-rank-reference", plain) / "reference")
    assert sorted(reference) == list(range(1, STEPS + 1))
    return reference


@pytest.fixture
def fake_scontrol(tmp_path) -> tuple[str, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\necho "$@" >> "$FAKE_SCONTROL_LOG"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}", tmp_path / "scontrol.log"


def test_stop_requeue_resume_bit_exact(tmp_path, fake_scontrol, uninterrupted):
    run_dir = tmp_path / "run"
    # 1. SIGUSR2 to rank 1 only: both ranks stop at the same step, exit 75 (outside Slurm the signal was
    #    sent by hand: reason `signal`, not the time limit).
    proc = start(run_dir)
    wait_for_step(run_dir, 3, proc)
    os.kill(worker_pid(proc.pid, 1), signal.SIGUSR2)
    rc, out = finish(proc)
    assert rc != 0 and exit_codes(out) == {"75"}, out[-3000:]
    state = marker(run_dir)
    stop_step = state["step"]
    assert (state["status"], state["reason"], state["saved"]) == ("stopped", "signal", True)
    assert 3 <= stop_step < STEPS and (run_dir / "checkpoints" / f"step_{stop_step}").is_dir()
    assert max(losses(run_dir)) == stop_step

    # 2. Resume inside a (fake) SLURM array task whose end time is within the time budget: the run saves
    #    after its first step, before any signal, and rank 0 requeues ARRAYJOBID_TASKID.
    path, log = fake_scontrol
    slurm_env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_ARRAY_JOB_ID": "4240",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_RESTART_COUNT": "1",
        "PATH": path,
        "FAKE_SCONTROL_LOG": str(log),
        "RELAYTRAIN_FAKE_JOB_END_TIME": str(time.time() + 300),
    }
    rc, out = finish(start(run_dir, **slurm_env))
    assert exit_codes(out) == {"75"}, out[-3000:]
    state = marker(run_dir)
    assert (state["status"], state["reason"], state["step"]) == ("stopped", "time_budget", stop_step + 1)
    assert (state["requeued"], state["requeue_id"], state["restart_count"]) == (True, "4240_2", 1)
    assert log.read_text().splitlines() == ["requeue 4240_2"]

    # 3. The requeued job resumes and finishes; every step's loss equals the uninterrupted run's.
    rc, out = finish(start(run_dir))
    assert rc == 0, out[-3000:]
    assert marker(run_dir)["status"] == "finished"
    assert losses(run_dir) == uninterrupted  # every step, 1 to STEPS (the fixture checks its steps)
    assert [r["event"] for r in records(run_dir, "event") if r["event"] in ("start", "resume")] == [
        "start",
        "resume",
        "resume",
    ]

    # 4. A stale requeue of the finished run exits 0 at once.
    proc = run_cli(["train", *BASE, f"--run.dir={tmp_path}", "--run.name=run"], cwd=tmp_path)
    assert proc.returncode == 0 and f"already finished at step {STEPS}" in proc.stdout + proc.stderr
    assert marker(run_dir)["status"] == "finished"


def test_hung_rank_dumps_stacks_and_fails_fast(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--train.max_steps=400", "--resilience.hang_timeout_s=15")
    wait_for_step(run_dir, 2, proc)
    watched, hung = worker_pid(proc.pid, 0), worker_pid(proc.pid, 1)
    os.kill(hung, signal.SIGSTOP)  # rank 1 freezes; rank 0 waits in its next collective
    try:
        # Once rank 0's watchdog has ended it, the frozen rank is killed here: torchrun's agent would wait
        # 30 s for it after its SIGTERM, which a stopped process never acts on (its --shutdown-timeout does
        # not shorten that wait once a worker has failed).
        deadline = time.monotonic() + 120
        while Path(f"/proc/{watched}").exists() and "zombie" not in _proc_state(watched):
            assert proc.poll() is None and time.monotonic() < deadline, "the watchdog did not end rank 0"
            time.sleep(0.2)
        os.kill(hung, signal.SIGKILL)
        rc, out = finish(proc, timeout=300)
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, sig)
    assert rc != 0 and "86" in exit_codes(out), out[-3000:]
    dump = (run_dir / "logs" / "hang_rank0.txt").read_text()
    assert "relaytrain hang watchdog: rank 0 step" in dump and "trainer.py" in dump
    # the hang monitor's backstop, after its cap (issue 53), and its line says so
    assert "(the backstop at 22.5 s = 1.5 x resilience.hang_timeout_s, after the hang monitor's cap" in dump
    state = marker(run_dir)
    assert (state["status"], state["reason"], state["requeue_requested"]) == ("failed", "hang", False)


def _proc_state(pid: int) -> str:
    """The state word of /proc/PID/status ("sleeping", "zombie", ...); "" once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    return next(
        (line.split("(")[-1].rstrip(")") for line in status.splitlines() if line.startswith("State:")), ""
    )


def test_nan_rollback_on_two_ranks_replays_exactly(tmp_path, capsys, uninterrupted):
    run_dir = tmp_path / "run"
    # Rank 1 (only) sees NaN at steps 5 and 6: both ranks skip step 5, then roll back to step 4. All of
    # BASE's steps, as the shared reference (a shorter run has another learning-rate schedule).
    rc, out = finish(
        start(
            run_dir,
            "--checkpoint.interval=2",
            "--resilience.nan_policy=rollback",
            "--resilience.nan_max_consecutive=2",
            **faults.env(nan_at_steps=(5, 6)),
        )
    )
    landed = ["NaN loss at step 5 on rank 1", "NaN loss at step 6 on rank 1"]
    assert faults.landed(out) == landed, f"the NaN faults did not land:\n{out[-3000:]}"
    assert rc == 0, out[-3000:]
    assert [r["step"] for r in records(run_dir, "event") if r["event"] == "rollback"] == [4]
    assert losses(run_dir) == uninterrupted  # steps 5.. replayed after the rollback, bit-exact
    assert marker(run_dir)["status"] == "finished"
    # verify reads the rolled-back run from its own records: the replayed steps' samples once each, in the
    # uninterrupted order, the data as read, and the ledger's windows
    from relaytrain.cli import main

    capsys.readouterr()
    assert main(["verify", str(run_dir)]) == 0, capsys.readouterr()
    print(capsys.readouterr().out)


def test_nan_skip_then_escalates_to_stop(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "train",
            *BASE,
            f"--run.dir={tmp_path}",
            "--run.name=run",
            "--resilience.nan_policy=skip",
            "--resilience.nan_max_consecutive=2",
        ],
        cwd=tmp_path,
        **faults.env(nan_at_steps=(3, 5, 6)),
    )
    landed = [f"NaN loss at step {step} on rank 0" for step in (3, 5, 6)]
    assert faults.landed(proc.stderr) == landed, f"the NaN faults did not land:\n{proc.stderr[-3000:]}"
    assert proc.returncode == EXIT_NONFINITE, proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = losses(run_dir)
    bad = seen[3] is None or seen[3] != seen[3]  # metrics.jsonl writes NaN as null
    assert bad and isinstance(seen[4], float) and seen[4] == seen[4]  # step 3 skipped; step 4 trained on
    state = marker(run_dir)
    assert (state["status"], state["reason"], state["requeue_requested"]) == ("failed", "nan", False)
    assert state["step"] == 5  # the last good step; step 6 escalated


def test_time_budget_stop_inside_evaluation(tmp_path):
    """A stop due during evaluation lets it finish (the stop step's val_loss is logged), then saves."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "train",
            *BASE,
            f"--run.dir={tmp_path}",
            "--run.name=run",
            "--train.eval_every=1",
            "--train.eval_steps=2",
        ],
        cwd=tmp_path,
        RELAYTRAIN_FAKE_JOB_END_TIME=str(time.time() + 300),
    )
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]
    state = marker(run_dir)
    assert (state["status"], state["reason"], state["step"]) == ("stopped", "time_budget", 1)
    evals = records(run_dir, "eval")
    assert [r["step"] for r in evals] == [1] and evals[0]["val_loss"] is not None
    assert (run_dir / "checkpoints" / "step_1").is_dir()
