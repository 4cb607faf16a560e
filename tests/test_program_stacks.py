"""examples/deepspeed_zero3.py and examples/megatron_gpt.py (docs/programs.md) under torchrun on gloo:
a run stopped by a signal mid-training saves, and the next run resumes to exactly the losses of an
uninterrupted run. Skipped where the `deepspeed` / `megatron` extra is not installed.

DeepSpeed: a 50-step run stopped at about step 11 and step 27 (20 or more steps after the last
resume), and the last checkpoint's optimizer state (each rank's fp32 master weights, Adam moments,
step counts) compared bit for bit: without examples/deepspeed_zero3.py's resume_cpu_adam the losses
differed from step 42 on, and a single stop at step 11 kept the losses but not the master weights.

The DeepSpeed runs use the example's default config (examples/deepspeed/zero3_offload.json: ZeRO-3,
optimizer and parameters offloaded to CPU, bf16, DeepSpeedCPUAdam). DeepSpeed builds that optimizer's
C++ op on its first use on a machine (minutes; cached in ~/.cache/torch_extensions), so the test
session builds it first (tests/prebuilt.py, the `deepspeed_ops` fixture); the Slurm test
(tests/test_e2e_stacks.py) uses the torch-AdamW config instead.
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
    return {r["step"]: r["loss"] for r in loss_rows(run_dir)}


def loss_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "out" / "losses.jsonl").read_text().splitlines()]


def run(
    example: Path, run_dir: Path, steps: int, *args: str, stop: signal.Signals | None = None, after: int = 2
) -> tuple[int, str]:
    """The example under relaytrain.job.torchrun for ``steps`` steps; ``stop`` sent to torchrun (which
    forwards it to the workers) once the run's loss log holds ``after`` steps."""
    out = ["--out", str(run_dir / "out"), "--steps", str(steps)]
    cmd = [sys.executable, *TORCHRUN, str(example), *out, *args]
    proc = subprocess.Popen(
        cmd, env=clean_env(run_dir), cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    if stop is not None:
        log, deadline = run_dir / "out" / "losses.jsonl", time.monotonic() + 600
        while not (log.exists() and len(log.read_text().splitlines()) >= after):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            # A step takes 0.5 s or more here (--step-delay): a 0.25 s look lands the signal within the
            # step logged, with a fifth of the looks of every 0.05 s.
            time.sleep(0.25)
        proc.send_signal(stop)
    output, _ = proc.communicate(timeout=800)
    return proc.returncode, output


def stop_and_resume(
    example: Path,
    tmp_path: Path,
    stop: signal.Signals,
    *args: str,
    steps: int = 6,
    stops: tuple[int, ...] = (2,),
) -> tuple[str, list[int]]:
    """The uninterrupted run's output and the steps the other run stopped at. Asserts that a run sent
    ``stop`` once it logged each of ``stops`` steps stops there (up to 3 steps later: the signal lands
    during a step), saves, resumes, and logs every step once with the uninterrupted run's loss."""
    ref, interrupted = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    interrupted.mkdir()
    code, reference = run(example, ref, steps, *args)
    assert code == 0, reference[-4000:]
    resumed_at, stopped = 0, []
    for after in stops:
        code, output = run(example, interrupted, steps, *args, "--step-delay", "0.5", stop=stop, after=after)
        assert code == 128 + stop, output[-4000:]  # torchrun forwarded the signal (docs/programs.md)
        if resumed_at:
            assert f"resuming at step {resumed_at}" in output, output[-4000:]
        state = json.loads((interrupted / "run_state.json").read_text())
        assert state["status"] == "stopped" and state["saved"] and state["reason"] == "signal", state
        assert after <= state["step"] <= after + 3 and max(losses(interrupted)) == state["step"], state
        resumed_at = state["step"]
        stopped.append(resumed_at)
    code, output = run(example, interrupted, steps, *args)
    assert code == 0 and f"resuming at step {resumed_at}" in output, output[-4000:]
    logged = [r["step"] for r in loss_rows(interrupted)]
    assert logged == [r["step"] for r in loss_rows(ref)] == list(range(1, steps + 1)), logged
    resumed, uninterrupted = losses(interrupted), losses(ref)
    differ = [step for step in uninterrupted if resumed[step] != uninterrupted[step]]
    assert not differ, (
        f"after stops at {stopped}, losses differ from the uninterrupted run's at steps {differ}"
    )
    assert json.loads((interrupted / "run_state.json").read_text())["status"] == "finished"
    return reference, stopped


def final_optimizer_state(checkpoint: Path) -> dict[str, object]:
    """Every rank's ZeRO optimizer state in a DeepSpeed checkpoint, flattened to 'file:key.key' -> value."""
    import torch

    flat: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}[{i}]", item)
        else:
            flat[prefix] = value

    for path in sorted(checkpoint.glob("*optim_states.pt")):
        walk(path.name, torch.load(path, weights_only=False)["optimizer_state_dict"])
    return flat


def same(a: object, b: object) -> bool:
    import torch

    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return repr(a) == repr(b)


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
def test_deepspeed_zero3_cpu_offload_stops_on_sigterm_and_resumes_to_the_uninterrupted_losses(
    tmp_path, deepspeed_ops
):
    """Two stops in a 50-step run, the last one 20 or more steps before the end: a resume that loses
    state shows in bf16 losses only some steps later (DeepSpeedCPUAdam's bias correction: step 36 on
    after a stop at 27)."""
    needs.module("deepspeed")
    # SIGTERM, as a preemption sends it
    reference, stopped = stop_and_resume(DEEPSPEED, tmp_path, signal.SIGTERM, steps=50, stops=(11, 27))
    assert 50 - stopped[-1] >= 20, stopped
    # The last checkpoint (step 50): each rank's fp32 master weights, Adam moments and step counts, bit
    # for bit (a drift shows here from the first resumed step on, in the bf16 losses only later).
    ref, resumed = (
        final_optimizer_state(tmp_path / run / "out" / "checkpoints" / "step50") for run in ("ref", "run")
    )
    assert sorted(ref) == sorted(resumed) and len(ref) > 4, sorted(ref)
    differ = [key for key in ref if not same(ref[key], resumed[key])]
    assert not differ, f"after stops at steps {stopped}, the final optimizer state differs in {differ}"
    assert "ZeRO stage 3, DeepSpeedCPUAdam, offloaded to CPU: optimizer, parameters" in reference


@pytest.mark.slow
def test_megatron_tensor_parallel_stops_on_the_signal_and_resumes_to_the_uninterrupted_losses(tmp_path):
    needs.module("megatron.core")
    stop_and_resume(MEGATRON, tmp_path, signal.SIGUSR2)
