"""A run whose checkpoints exist but none loads stops with one error and keeps them; it never starts
over at step 0 by itself (checkpoint.start_over_if_damaged opts in, still keeping them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from relaytrain.checkpoint import UnloadableCheckpoints, files
from relaytrain.checkpoint.schedule import retention_victims
from relaytrain.errors import UserError
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch import crash
from relaytrain.resilience.run_state import RunState, RunStateFile, recorded_checkpoint_step
from test_checkpoint import make, train_step

from conftest import run_cli


def snapshot(step_dir: Path) -> dict[str, str]:
    """Every file of a step directory with a hash of its bytes: 'untouched' means equal snapshots."""
    return {
        str(p.relative_to(step_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(step_dir.rglob("*"))
        if p.is_file()
    }


def saved(tmp_path: Path, steps: tuple[int, ...]) -> Path:
    mgr, parts, opt, state = make(tmp_path)
    for step in steps:
        train_step(parts, opt, state, step)
        mgr.save(step)
    mgr.close()
    return tmp_path / "run" / "checkpoints"


def test_the_only_checkpoint_damaged_is_an_error_that_leaves_it_untouched(tmp_path):
    ckpt = saved(tmp_path, (2,))
    (ckpt / "step_2" / "__0_0.distcp").unlink()
    before = snapshot(ckpt / "step_2")
    with pytest.raises(UnloadableCheckpoints) as err:
        make(tmp_path, seed=1)[0].load()
    text = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in text
    assert f"every checkpoint of this run in {ckpt} is damaged: step_2 (__0_0.distcp is missing)" in text
    assert "--checkpoint.start_over_if_damaged=true" in text
    assert snapshot(ckpt / "step_2") == before and files.read_latest(ckpt) == ckpt / "step_2"


def test_content_damage_found_while_loading_is_named(tmp_path):
    """A flipped byte in a shard passes the size check: the load finds it, and with no other checkpoint
    that is the error, not a fresh start."""
    ckpt = saved(tmp_path, (1,))
    shard = ckpt / "step_1" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(UnloadableCheckpoints, match=r"step_1 \(.*__0_0.distcp does not match its checksum"):
        make(tmp_path, seed=1)[0].load()


def test_damage_of_the_newest_falls_back_to_the_older(tmp_path):
    ckpt = saved(tmp_path, (1, 2))
    (ckpt / "step_2" / "__0_0.distcp").unlink()
    assert make(tmp_path, seed=1)[0].load(recorded_step=2) == 1


def test_a_recorded_resume_with_no_checkpoint_left_is_an_error(tmp_path):
    # No checkpoint and no record: a new run starts fresh, as always.
    assert make(tmp_path)[0].load() is None
    # The record says the run resumed from step 4, but its checkpoints are gone.
    with pytest.raises(UnloadableCheckpoints, match=r"says it has a checkpoint of step 4, but"):
        make(tmp_path)[0].load(recorded_step=4)
    # Only checkpoints after the recorded step would load: they are taken.
    saved(tmp_path, (6,))
    assert make(tmp_path, seed=1)[0].load(recorded_step=4) == 6


def test_start_over_keeps_the_damaged_checkpoint_through_saves_retention_and_requeues(tmp_path):
    ckpt = saved(tmp_path, (2,))
    (ckpt / "step_2" / "__0_0.distcp").unlink()
    before = snapshot(ckpt / "step_2")
    mgr, parts, opt, state = make(tmp_path, seed=1, start_over_if_damaged=True, keep_last=1)
    assert mgr.load() is None
    for step in (1, 2, 3):  # step 2 collides with the damaged one: not saved, never replaced
        train_step(parts, opt, state, step)
        mgr.save(step)
    mgr.close()
    assert snapshot(ckpt / "step_2") == before
    assert files.read_metadata(ckpt / "step_3")["kept_damaged"] == ["step_2"]
    # The requeued job (same config) resumes the new line, whose retention still keeps step_2.
    mgr, parts, opt, state = make(tmp_path, seed=1, start_over_if_damaged=True, keep_last=1)
    assert mgr.load() == 3
    train_step(parts, opt, state, 4)
    mgr.save(4)
    mgr.close()
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_2", "step_4"]
    assert snapshot(ckpt / "step_2") == before


def test_run_state_keeps_the_checkpoint_step_across_later_records(tmp_path):
    state = RunStateFile(RunDir(tmp_path))
    state.write(RunState.of("running", "", 4, checkpoint_step=4))
    state.note_checkpoint(6)
    assert (state.read().status, state.read().step, recorded_checkpoint_step(RunDir(tmp_path))) == (
        "running",
        4,
        6,
    )
    state.write(RunState.of("failed", "crash", 9, job_id="41", restart_count=0))
    assert state.read().checkpoint_step == 6 and recorded_checkpoint_step(RunDir(tmp_path)) == 6
    state.write(RunState.of("running", "", 0, checkpoint_step=0))  # started over: a new line of checkpoints
    assert recorded_checkpoint_step(RunDir(tmp_path)) == 0


def test_cli_refuses_with_exit_2_records_the_reason_and_opt_in_starts_over(tmp_path, tiny_args):
    args = ["train", *tiny_args, "--run.name=dmg", "--checkpoint.interval=2"]
    assert run_cli([*args, "--train.max_steps=2"], tmp_path).returncode == 0
    run_dir = tmp_path / "runs" / "dmg"
    assert RunStateFile(RunDir(run_dir)).read().checkpoint_step == 2  # noted at the commit
    # The checkpoint dir is gone altogether: the record says there was a checkpoint of step 2.
    (run_dir / "checkpoints").rename(run_dir / "moved")
    proc = run_cli([*args, "--train.max_steps=4"], tmp_path)
    assert proc.returncode == 2 and "says it has a checkpoint of step 2" in proc.stderr, proc.stderr[-3000:]
    (run_dir / "moved").rename(run_dir / "checkpoints")
    step_dir = run_dir / "checkpoints" / "step_2"
    (step_dir / "__0_0.distcp").unlink()
    before = snapshot(step_dir)
    proc = run_cli([*args, "--train.max_steps=4"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("relaytrain: error: every checkpoint of this run in ")
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "step 1/4" not in proc.stdout + proc.stderr and snapshot(step_dir) == before
    record = RunStateFile(RunDir(run_dir)).read()
    state = record.as_json()
    assert (state["status"], state["reason"], state["step"]) == ("failed", "damaged_checkpoint", 2)
    assert "__0_0.distcp is missing" in state["message"]
    # The batch script's crash check does not requeue it.
    facts = JobFacts.from_env({"SLURM_JOB_ID": "", "SLURM_RESTART_COUNT": "0"})
    assert crash.classify(record, facts, 1)[0] is False
    proc = run_cli([*args, "--train.max_steps=4", "--checkpoint.start_over_if_damaged=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting over at step 0" in proc.stdout + proc.stderr and snapshot(step_dir) == before
    losses = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if r.get("kind") == "train"][-4:] == [1, 2, 3, 4]


def test_retention_neither_deletes_nor_counts_a_kept_damaged_checkpoint(tmp_path):
    entries = [files.StepEntry(s, tmp_path / f"step_{s}", True) for s in (1, 2, 6)]
    damaged = tmp_path / "step_6"
    assert retention_victims(entries, tmp_path / "step_2", 2, 0, protected={damaged}) == []
    assert [e.step for e in retention_victims(entries, tmp_path / "step_2", 1, 0, {damaged})] == [1]
