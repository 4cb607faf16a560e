"""End to end through `relaytrain train`: stop and resume reproduce the uninterrupted losses bit for bit,
and a checkpoint written at one layout continues the loss curve at another."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from relaytrain.checkpoint import files, load_model
from test_elastic import uninterrupted_two_rank_run

from conftest import losses_by_step, run_cli, run_torchrun

STEPS = ["--train.max_steps=6", "--checkpoint.interval=2"]


def train(tmp_path, tiny_args, name, *extra, nproc=1):
    args = ["train", *tiny_args, *STEPS, f"--run.name={name}", *extra]
    proc = run_cli(args, tmp_path) if nproc == 1 else run_torchrun(nproc, args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "runs" / name, proc.stdout + proc.stderr


def test_stop_and_resume_is_bit_exact_one_process(tmp_path, tiny_args):
    reference, _ = train(tmp_path, tiny_args, "ref")
    # stopped twice, once on a save step and once between saves, with both save modes
    run, out = train(tmp_path, tiny_args, "cut", "--train.stop_at_step=2")
    assert "stopping at step 2" in out
    _, out = train(tmp_path, tiny_args, "cut", "--train.stop_at_step=3", "--checkpoint.mode=async")
    assert "resuming from" in out and "step_2" in out
    assert (run / "checkpoints/step_3/COMPLETE").is_file()
    assert files.read_metadata(run / "checkpoints/step_3")["reason"] == "stop_at_step"
    _, out = train(tmp_path, tiny_args, "cut")
    assert "(step 3)" in out
    expected = losses_by_step(reference)
    assert sorted(expected) == list(range(1, 7))
    assert losses_by_step(run) == expected  # exact float equality, every step
    assert os.readlink(run / "checkpoints/latest") == "step_6"


# tests/test_elastic.py's uninterrupted 2-rank run (the same STEPS and tiny model) is the FSDP runs'
# reference: their micro batch is its (2: 2 ranks take 4 sequences each as 2 x 2).
FSDP_MICRO_BATCH = "--train.micro_batch_size=2"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    return uninterrupted_two_rank_run(tmp_path_factory)


@pytest.mark.slow
def test_fsdp_resume_and_resharding(tmp_path, tiny_args, reference_run):
    reference = reference_run / "runs" / "ref"
    tiny_args = [*tiny_args, FSDP_MICRO_BATCH]
    run, _ = train(tmp_path, tiny_args, "fsdp", "--train.stop_at_step=3", "--checkpoint.mode=async", nproc=2)
    # wall-clock saves (decided on rank 0, broadcast): every step here, on top of the interval ones
    extra = ["--checkpoint.interval_minutes=0.0001", "--checkpoint.keep_every=3"]
    _, out = train(tmp_path, tiny_args, "fsdp", *extra, nproc=2)
    expected = losses_by_step(reference)
    assert losses_by_step(run) == expected
    assert [e.step for e in files.list_steps(run / "checkpoints")] == [3, 4, 5, 6]  # keep_last=3 + every 3

    step3 = run / "checkpoints/step_3"
    assert files.read_metadata(step3)["world_size"] == 2
    later = {s: v for s, v in expected.items() if s > 3}
    # 2-rank FSDP -> 1 process, -> 2-rank tensor parallel, -> 2-stage pipeline
    one, out = train(tmp_path, tiny_args, "one", f"--checkpoint.resume={step3}")
    assert "resharding: saved with world size 2" in out
    tp, _ = train(tmp_path, tiny_args, "tp", "--parallel.tp=2", f"--checkpoint.resume={step3}", nproc=2)
    pp, _ = train(tmp_path, tiny_args, "pp", "--parallel.pp=2", f"--checkpoint.resume={step3}", nproc=2)
    for resumed in (one, tp, pp):
        assert losses_by_step(resumed) == pytest.approx(later, rel=1e-5)
    # the pipeline-split checkpoint loads as one model in one process
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_model(pp)(tokens), load_model(run)(tokens), atol=1e-4, rtol=0)


def test_requeue_after_explicit_resume_continues_its_own_progress(tmp_path, tiny_args):
    """checkpoint.resume=<step_4>, then retention deletes step_4: the requeued job (same command line)
    continues from its own newest checkpoint instead of failing on the deleted path."""
    run = tmp_path / "runs" / "requeue"
    common = ["--train.max_steps=14", "--checkpoint.interval=2", "--checkpoint.keep_last=3"]
    train(tmp_path, tiny_args, "requeue", *common, "--train.stop_at_step=8")
    again = [*common, f"--checkpoint.resume={run / 'checkpoints/step_4'}", "--train.stop_at_step=12"]
    _, out = train(tmp_path, tiny_args, "requeue", *again)
    assert "checkpoint.resume=" in out and "(step 4)" in out
    assert not (run / "checkpoints/step_4").exists()  # retention removed the path the job was started from
    _, out = train(tmp_path, tiny_args, "requeue", *again)
    assert "this run's progress since" in out and "(step 12)" in out
    assert files.read_metadata(run / "checkpoints/step_14")["resume_arg"] == str(run / "checkpoints/step_4")
