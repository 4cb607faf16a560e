"""A checkpoint save that fills the disk: one clear error, the previous checkpoint intact, and the run
continues, bit-exact, once space is freed. The run dir lives on a size-limited tmpfs (needs root to mount)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from relaytrain.checkpoint.save_errors import disk_full_error
from relaytrain.job import JobFacts, RunDir
from relaytrain.resilience.batch import crash
from relaytrain.resilience.run_state import RunStateFile
from tiny_config import TINY_TOML

import faults
import needs
from conftest import run_cli

CONFIG = (
    """[run]
name = "full"
dir = "{runs}"
"""
    + TINY_TOML
    + """max_steps = 30
[optim]
warmup_steps = 2
[metrics]
log_every = 1
tensorboard = false
[checkpoint]
interval = 10
mode = "{mode}"
"""
)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        needs.skip_or_fail(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def resize(mount: Path, size_bytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(mount)], check=True)


@pytest.mark.parametrize(
    ("mode", "held_s"),
    [("async", 0.0), ("sync", 0.0), ("async", 3.0)],
    ids=["async", "sync", "async-error-reported-after-records"],
)
def test_a_save_on_a_full_disk_fails_cleanly_and_the_run_continues_after_space_is_freed(
    tmp_path, small_fs, mode, held_s
):
    """`held_s`: the async save's failed write holds its error that long (faults/), so the loop writes its
    next records onto the disk the save filled before the save's failure is known: still one clear error,
    the save's."""
    ref_cfg = tmp_path / "ref.toml"
    ref_cfg.write_text(CONFIG.format(runs=tmp_path / "ref", mode=mode))
    assert run_cli(["train", str(ref_cfg)], tmp_path).returncode == 0
    reference = dict(losses(tmp_path / "ref" / "full"))
    ckpt_bytes = tree_bytes(tmp_path / "ref/full/checkpoints/step_10")
    cache_bytes = tree_bytes(tmp_path / "ref/.cache")  # the tokenized data lives under run.dir too

    # Room for the data, one checkpoint and the run's records, not for a second checkpoint.
    resize(small_fs, cache_bytes + int(ckpt_bytes * 1.6) + 256 * 1024)
    cfg = tmp_path / "full.toml"
    cfg.write_text(CONFIG.format(runs=small_fs, mode=mode))
    first = run_cli(
        ["train", str(cfg)], tmp_path, **(faults.env(save_error_delay_s=held_s) if held_s else {})
    )
    run_dir = small_fs / "full"
    if held_s:
        assert any("a checkpoint write's error" in f for f in faults.landed(first.stderr)), first.stderr[
            -3000:
        ]
    assert first.returncode == 2, first.stderr[-3000:]
    errors = [line for line in first.stderr.splitlines() if line.startswith("relaytrain: error:")]
    assert len(errors) == 1 and "no space left" in errors[0] and "step_10" in errors[0], first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_10"]  # the partial step_20 is gone
    assert (ckpts / "step_10" / "COMPLETE").is_file() and os.readlink(ckpts / "latest") == "step_10"
    record = RunStateFile(RunDir(run_dir)).read()
    state = record.as_json()
    assert state["status"] == "failed" and "no space left" in state["message"]
    # Under Slurm torchrun turns the exit 2 into 1: crash recovery must still not retry a full disk.
    assert crash.classify(record, JobFacts.from_env({}), 1)[0] is False

    resize(small_fs, 64 * 2**20)  # space freed
    second = run_cli(["train", str(cfg)], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resum" in second.stdout and "step_10" in second.stdout
    resumed = losses(run_dir)  # steps 1..30, the replayed 11..20 twice: all bit-identical
    assert {s for s, _ in resumed} == set(reference) and all(v == reference[s] for s, v in resumed)
    assert RunStateFile(RunDir(run_dir)).read().status == "finished"


def test_disk_full_is_found_behind_dcp_wrappers():
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = full

    class Failures(BaseException):  # the shape of torch's CheckpointException
        failures = {1: (wrapped, [])}

    assert disk_full_error(Failures()) is full
    assert disk_full_error(OSError(errno.EIO, "I/O error")) is None
    assert disk_full_error(None) is None
