"""examples/lightning_train.py (docs/programs.md, "PyTorch Lightning"): relaytrain owns the requeue,
Lightning's SLURM auto-requeue is off; a signalled run saves, exits 75 and resumes to the same result."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import needs
from conftest import REPO, child_env

needs.module("lightning")

EXAMPLE = REPO / "examples" / "lightning_train.py"


def run(run_dir: Path, *args: str, signal_after_step: int | None = None) -> tuple[int, str]:
    env = child_env(RELAYTRAIN_RUN_DIR=str(run_dir))
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    out = run_dir / "out"
    cmd = [sys.executable, str(EXAMPLE), "--out", str(out), "--steps", "10", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if signal_after_step is not None:
        deadline = time.monotonic() + 120
        log = out / "losses.jsonl"
        while not (log.exists() and len(log.read_text().splitlines()) >= signal_after_step):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR2)
    output, _ = proc.communicate(timeout=180)
    return proc.returncode, output


def losses(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "out" / "losses.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_lightning_example_stops_on_the_signal_and_resumes_to_the_uninterrupted_result(tmp_path):
    ref, interrupted = tmp_path / "ref", tmp_path / "run"
    code, output = run(ref)
    assert code == 0, output
    code, output = run(interrupted, "--step-delay", "0.3", signal_after_step=2)
    assert code == 75, output
    state = json.loads((interrupted / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["saved"] and (interrupted / "out" / "last.ckpt").exists()
    code, output = run(interrupted)
    assert code == 0 and "resuming from" in output, output
    assert losses(interrupted) == losses(ref)  # every step once, each with the uninterrupted loss
    final = json.loads((interrupted / "out" / "final.json").read_text())
    assert final == json.loads((ref / "out" / "final.json").read_text())
    assert json.loads((interrupted / "run_state.json").read_text())["status"] == "finished"
