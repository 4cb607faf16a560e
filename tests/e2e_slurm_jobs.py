"""Helpers for tests/test_e2e_slurm.py: configs, the relaytrain CLI in-process, run files, job timing.

The jobs train a tiny model. A step delay injected from outside the trainer (faults/, set only on a
job's first run, through a ``slurm.setup`` line) stretches that run so that Slurm can signal, preempt or
kill it mid-training without using CPU; requeued runs go at full speed.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from tiny_config import TINY_TOML

import faults
from conftest import REPO, child_env
from slurm_fixtures import job_fields, wait_for

MODEL = (
    "\n"
    + TINY_TOML
    + """max_steps = {steps}
eval_every = 0

[optim]
warmup_steps = 2

[metrics]
log_every = 1
tensorboard = false
"""
)

# The resilience jobs: 200 steps, a checkpoint every 25; a 90 s signal lead (with --time 3 the signal
# comes 60-90 s after the start, Slurm checks limits every 30 s) and a 10 s time-budget margin.
RESILIENCE_STEPS = 200
RESILIENCE = """
[checkpoint]
interval = 25

[resilience]
signal_lead_s = 90
hard_deadline_s = 60
time_budget_margin_s = 10
"""
FIRST_RUN_ONLY = 'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then {}; fi'
SLOW_FIRST_RUN = FIRST_RUN_ONLY.format(faults.setup_line(step_delay_s=0.5))


def write_config(path: Path, runs: Path, name: str, steps: int, resilience: bool = False) -> Path:
    text = f'[run]\nname = "{name}"\ndir = "{runs}"\n' + MODEL.format(steps=steps)
    if resilience:
        text += RESILIENCE
    text += f'\n[slurm]\nprofile = "{REPO / "configs" / "clusters" / "local.toml"}"\n'
    path.write_text(text)
    return path


def setup_override(*lines: str) -> str:
    """A --slurm.setup=[...] override (TOML literal strings, so no escaping inside the lines)."""
    return "--slurm.setup=[" + ", ".join(f"'{line}'" for line in lines) + "]"


def cli(*args: str) -> tuple[int, str]:
    """`relaytrain ARGS` in this process (one torch import for all calls); returns (code, output)."""
    from relaytrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


def submitted_id(output: str) -> str:
    match = re.search(r"submitted job (?:array )?(\d+)", output)
    assert match, output
    return match.group(1)


def launch(*args: str) -> str:
    code, out = cli("launch", *args)
    assert code == 0, out
    return submitted_id(out)


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind") == kind]


def events(run_dir: Path) -> list[dict]:
    return records(run_dir, "event")


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir, "train")), default=0)


def marker(run_dir: Path) -> dict:
    path = run_dir / "run_state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def wait_step(run_dir: Path, job_id: str, step: int, timeout: float = 180) -> None:
    def reached() -> bool:
        state = job_fields(int(job_id.split("_")[0])).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job_id} is {state} before step {step}:\n{job_log(run_dir, job_id)}")
        return last_step(run_dir) >= step

    wait_for(reached, timeout, f"job {job_id} to reach step {step}", interval=1.0)


def job_output(run_dir: Path, job_id: str) -> str:
    """The job's whole output file (every run of a requeued job appends to it)."""
    path = run_dir / "slurm" / f"{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"


def job_log(run_dir: Path, job_id: str) -> str:
    """The end of the job's output, for assertion messages."""
    return job_output(run_dir, job_id)[-6000:]


def assert_losses_match(run_dir: Path, reference: dict[int, float]) -> None:
    """Every logged step, replayed ones included, has exactly the uninterrupted run's loss."""
    rows = records(run_dir, "train")
    assert {r["step"] for r in rows} == set(reference), f"{run_dir.name}: steps differ from the reference"
    wrong = [(r["step"], r["loss"], reference[r["step"]]) for r in rows if r["loss"] != reference[r["step"]]]
    assert not wrong, f"{run_dir.name}: losses differ from the reference (step, got, want): {wrong[:5]}"


def complete_checkpoints(run_dir: Path) -> list[int]:
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if (p / "COMPLETE").is_file())


def slurm_time(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def start_reference(run_dir: Path, config: Path) -> subprocess.Popen:
    """The uninterrupted run: plain `relaytrain train` under torchrun, same config and world size (2)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "relaytrain.cli", "train", str(config), f"--run.dir={run_dir.parent}",
           f"--run.name={run_dir.name}"]  # fmt: skip
    env = child_env()
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def save_seconds(log_text: str, step: int) -> float:
    """The emergency save's duration, from the checkpoint manager's 'committed' log line."""
    match = re.search(rf"checkpoint step {step} \(\w+\) committed: .*\(write ([\d.]+)s", log_text)
    assert match, f"no 'checkpoint step {step} ... committed' line in the job log"
    return float(match.group(1))
