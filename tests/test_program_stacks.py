"""examples/deepspeed_zero3.py and examples/megatron_gpt.py (docs/programs.md) under torchrun on gloo:
a run stopped by a signal mid-training saves, and the next run resumes to exactly the losses of an
uninterrupted run. Skipped where the `deepspeed` / `megatron` extra is not installed.

The DeepSpeed runs use the example's default config (examples/deepspeed/zero3_offload.json: ZeRO-3,
optimizer and parameters offloaded to CPU, bf16, DeepSpeedCPUAdam). DeepSpeed builds that optimizer's
C++ op on its first use on a machine (minutes; cached in ~/.cache/torch_extensions), so .ci/run builds
it before the tests; the Slurm test (tests/test_e2e_stacks.py) uses the torch-AdamW config instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import needs
from conftest import REPO, child_env

DEEPSPEED = REPO / "examples" / "deepspeed_zero3.py"
DS_CONFIGS = REPO / "examples" / "deepspeed"
MEGATRON = REPO / "examples" / "megatron_gpt.py"
TORCHRUN = ["-m", "relaytrain.job.torchrun", "--standalone", "--nproc_per_node=2",
            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR2"]  # fmt: skip


def clean_env(run_dir: Path) -> dict[str, str]:
    """No Slurm, torchrun or rank variables from the test's own environment."""
    prefixes = ("PET_", "TORCHELASTIC_", "SLURM_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_")
    env = {k: v for k, v in child_env(RELAYTRAIN_RUN_DIR=str(run_dir)).items() if not k.startswith(prefixes)}
    return {**env, "SLURM_CONF": os.environ.get("SLURM_CONF", "")} if "SLURM_CONF" in os.environ else env


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "out" / "losses.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def run(example: Path, run_dir: Path, *args: str, stop: signal.Signals | None = None) -> tuple[int, str]:
    """The example under relaytrain.job.torchrun; ``stop`` sent to torchrun (which forwards it to the
    workers) once 2 steps are logged."""
    cmd = [sys.executable, *TORCHRUN, str(example), "--out", str(run_dir / "out"), "--steps", "6", *args]
    proc = subprocess.Popen(
        cmd, env=clean_env(run_dir), cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    if stop is not None:
        log, deadline = run_dir / "out" / "losses.jsonl", time.monotonic() + 400
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.1)
        proc.send_signal(stop)
    output, _ = proc.communicate(timeout=600)
    return proc.returncode, output


def stop_and_resume(example: Path, tmp_path: Path, stop: signal.Signals, *args: str) -> str:
    """The uninterrupted run's output; asserts the stopped and resumed run logs its losses."""
    ref, interrupted = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    interrupted.mkdir()
    code, reference = run(example, ref, *args)
    assert code == 0, reference[-4000:]
    code, output = run(example, interrupted, *args, "--step-delay", "0.5", stop=stop)
    assert code == 128 + stop, output[-4000:]  # torchrun forwarded the signal (docs/programs.md)
    state = json.loads((interrupted / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["saved"] and state["reason"] == "signal", state
    assert 2 <= state["step"] < 6 and max(losses(interrupted)) == state["step"]
    code, output = run(example, interrupted, *args)
    assert code == 0 and f"resuming at step {state['step']}" in output, output[-4000:]
    assert losses(interrupted) == losses(ref)  # every step once, each with the uninterrupted run's loss
    assert json.loads((interrupted / "run_state.json").read_text())["status"] == "finished"
    return reference


def test_the_torch_adamw_config_is_the_cpu_adam_config_without_its_optimizer():
    """The Slurm test's cheaper config offloads the same way; only the optimizer (and dtype) differ."""
    full = json.loads((DS_CONFIGS / "zero3_offload.json").read_text())
    cheap = json.loads((DS_CONFIGS / "zero3_offload_torch_adamw.json").read_text())
    for config in (full, cheap):
        zero = config["zero_optimization"]
        assert zero["stage"] == 3
        assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
        assert "train_batch_size" not in config  # follows the world size
    assert full["optimizer"]["type"] == "AdamW" and "zero_force_ds_cpu_optimizer" not in full
    assert "optimizer" not in cheap and cheap["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.slow
def test_deepspeed_zero3_cpu_offload_stops_on_sigterm_and_resumes_to_the_uninterrupted_losses(tmp_path):
    needs.module("deepspeed")
    reference = stop_and_resume(DEEPSPEED, tmp_path, signal.SIGTERM)  # as a preemption sends it
    assert "ZeRO stage 3, DeepSpeedCPUAdam, offloaded to CPU: optimizer, parameters" in reference


@pytest.mark.slow
def test_megatron_tensor_parallel_stops_on_the_signal_and_resumes_to_the_uninterrupted_losses(tmp_path):
    needs.module("megatron.core")
    stop_and_resume(MEGATRON, tmp_path, signal.SIGUSR2)
