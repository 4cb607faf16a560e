"""`relaytrain report` on a synthetic run that was requeued twice (three SLURM jobs)."""

from __future__ import annotations

import argparse
import csv
import json
import math
import struct
from pathlib import Path

import pytest

from relaytrain.errors import UserError
from relaytrain.inspection.report import make_report
from relaytrain.inspection.report_command import register
from relaytrain.job import RunDir
from relaytrain.monitor.gpu_monitor import COLUMNS
from relaytrain.monitor.history import load_history

TOKENS_PER_STEP = 524_288
DEVICES = 16


def _train(step: int, t: float, job: str, restart: int, loss_offset: float = 0.0) -> dict:
    return {
        "kind": "train",
        "step": step,
        "time": t,
        "job_id": job,
        "restart": restart,
        "loss": 2.0 + 5.0 * math.exp(-step / 80) + loss_offset,
        "lr": 3e-4,
        "grad_norm": 0.9,
        "tokens_per_s": TOKENS_PER_STEP / 1.0,
        "tokens_per_s_per_device": TOKENS_PER_STEP / DEVICES,
        "mfu": 0.41 + 0.01 * math.sin(step),
        "mem_allocated_gib": 30.0,
        "mem_reserved_gib": 34.0,
        "mem_peak_gib": 36.0,
        "time_step_s": 1.0,
        "time_data_s": 0.02,
        "time_forward_backward_s": 0.8,
        "time_optimizer_s": 0.1,
        "time_checkpoint_s": 0.05 if step % 50 == 0 else 0.0,
        "time_other_s": 0.03,
    }


def _event(event: str, step: int, t: float, job: str, restart: int, **fields) -> dict:
    return {
        "kind": "event",
        "event": event,
        "step": step,
        "time": t,
        "job_id": job,
        "restart": restart,
        **fields,
    }


def _eval(step: int, t: float, job: str, restart: int) -> dict:
    val = 2.1 + 5.0 * math.exp(-step / 80)
    return {
        "kind": "eval",
        "step": step,
        "time": t,
        "job_id": job,
        "restart": restart,
        "val_loss": val,
        "val_ppl": math.exp(val),
    }


def write_synthetic_run(run_dir: Path) -> None:
    """Job 1001 dies at step 120 after its step-100 checkpoint; job 1002 resumes from 100 (steps
    110 and 120 are logged twice) and stops at 200 with a checkpoint; job 1003 finishes at 300.
    Lost time: 1470-1125-10 = 335 s and 1660-1540-10 = 110 s; 20 steps recomputed."""
    recs = [_event("start", 0, 1000.0, "1001", 0)]
    for step in range(10, 121, 10):
        recs.append(_train(step, 1005.0 + step, "1001", 0))
        if step % 50 == 0:
            recs.append(_eval(step, 1005.5 + step, "1001", 0))
            recs.append(
                _event("checkpoint", step, 1005.6 + step, "1001", 0, path=f"checkpoints/step_{step:08d}")
            )
    recs.append(_event("resume", 100, 1425.0, "1002", 0, checkpoint="checkpoints/step_00000100"))
    for step in range(110, 201, 10):
        recs.append(_train(step, 1340.0 + step, "1002", 0, loss_offset=0.5 if step <= 120 else 0.0))
        if step % 50 == 0:
            recs.append(_eval(step, 1340.5 + step, "1002", 0))
    recs.append(_event("stop", 200, 1541.0, "1002", 0, reason="time limit"))
    recs.append(_event("resume", 200, 1641.0, "1003", 0))
    for step in range(210, 301, 10):
        recs.append(_train(step, 1450.0 + step, "1003", 0))
        if step % 50 == 0:
            recs.append(_eval(step, 1450.5 + step, "1003", 0))
    recs.append(_event("stop", 300, 1751.0, "1003", 0, reason="finished"))
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
        f.write('{"kind": "train", "step": 31')  # torn last line of a killed job

    gpu_dir = run_dir / "gpu"
    gpu_dir.mkdir()
    for host_index, host in enumerate(("gpu-node1", "gpu-node2")):
        with open(gpu_dir / f"{host}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for job, start, end in (("1001", 1000, 1126), ("1002", 1425, 1542), ("1003", 1641, 1752)):
                for t in range(start, end, 5):
                    for gpu in range(8):
                        util = 20 if t - start < 15 else 92 - 3 * host_index + (gpu + t) % 5
                        writer.writerow(
                            [t, "", host, job, gpu, 150 + 5 * util, util, util // 2, 60000, 81559, 60]
                        )


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


def test_history_stitches_requeued_jobs(tmp_path):
    write_synthetic_run(tmp_path / "run")
    history = load_history(RunDir(tmp_path / "run"))
    assert [s.job_id for s in history.segments] == ["1001", "1002", "1003"]
    assert history.skipped_lines == 1
    steps = [r["step"] for r in history.train]
    assert steps == list(range(10, 301, 10))  # each step once
    by_step = {r["step"]: r for r in history.train}
    assert by_step[110]["job_id"] == "1002" and by_step[110]["loss"] > by_step[100]["loss"]  # later wins
    assert [s.resume_step() for s in history.segments[1:]] == [100, 200]
    lost_s, lost_steps = history.lost_time()
    assert lost_s == pytest.approx(335.0 + 110.0)
    assert lost_steps == 20


def test_report_writes_plots_and_summary(tmp_path):
    run = tmp_path / "run"
    write_synthetic_run(run)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["report", str(run)])
    assert args.func(args) == 0

    out = run / "report"
    for name in ("loss", "throughput", "mfu", "memory", "step_time", "gpu"):
        width, height = _png_size(out / f"{name}.png")
        assert width >= 800 and height >= 400
    md = (out / "report.md").read_text()
    assert "| run | run |" in md
    assert "| last step | 300 |" in md
    assert "| restarts | 2 |" in md
    assert "1001, 1002, 1003" in md
    assert "7m 25s (20 steps recomputed)" in md  # 445 s
    assert "| mean tokens/s (all devices) | 524,288 |" in md
    assert "| mean MFU | 41.0 % |" in md
    assert f"| final train loss | {2.0 + 5.0 * math.exp(-300 / 80):.4f} |" in md
    assert "(step 300)" in md  # best validation loss is the last one
    assert "![gpu](gpu.png)" in md and "1 unreadable line(s)" in md


def test_report_takes_a_run_name_like_status_logs_and_verify(tmp_path):
    """`relaytrain report NAME` finds runs/NAME (or --runs DIR/NAME); a name that is no run is one line."""
    write_synthetic_run(tmp_path / "runs" / "mine")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["report", "mine", "--runs", str(tmp_path / "runs")])
    assert args.func(args) == 0 and (tmp_path / "runs" / "mine" / "report" / "report.md").is_file()
    args = parser.parse_args(["report", "nothing", "--runs", str(tmp_path / "runs")])
    with pytest.raises(UserError, match="no run 'nothing' under"):
        args.func(args)


def test_report_reads_run_like_status_logs_and_verify(tmp_path, monkeypatch):
    """A bare number is a Slurm job id to status and logs, not a directory of the working directory:
    report reads its RUN through the same owner (run_view.find_run), so it refuses what they refuse."""
    from relaytrain.inspection.run_view import find_run

    write_synthetic_run(tmp_path / "4711")
    write_synthetic_run(tmp_path / "runs" / "4712")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for target in ["4711", "4712", "runs/4712", str(tmp_path / "4711")]:
        args = parser.parse_args(["report", target])
        found = find_run(target, Path("runs"))
        if found is None:
            with pytest.raises(UserError, match=f"no run '{target}' under runs/"):
                args.func(args)
        else:
            assert args.func(args) == 0 and (found.root / "report" / "report.md").is_file(), target
    assert find_run("4711", Path("runs")) is None and find_run("4712", Path("runs")) is not None


def test_report_out_dir_and_missing_metrics(tmp_path):
    run = tmp_path / "run"
    write_synthetic_run(run)
    report = make_report(RunDir(run), tmp_path / "elsewhere")
    assert report == tmp_path / "elsewhere" / "report.md" and (tmp_path / "elsewhere" / "loss.png").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no metrics file"):
        make_report(RunDir(empty))
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no metric records"):
        make_report(RunDir(empty))
    with pytest.raises(UserError, match="does not exist"):
        make_report(RunDir(tmp_path / "nope"))


def _write(run_dir: Path, recs: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_run_trained_further_after_it_finished_is_no_restart(tmp_path):
    # Finished at step 50, then run again days later with train.max_steps=100 (a local run: no job id).
    recs = [_event("start", 0, 1000.0, None, 0)]
    recs += [_train(step, 1000.0 + step, None, 0) for step in range(10, 51, 10)]
    recs += [_event("finished", 50, 1051.0, None, 0), _event("resume", 50, 90000.0, None, 0)]
    recs += [_train(step, 90000.0 + step, None, 0) for step in range(60, 101, 10)]
    recs += [_event("finished", 100, 90101.0, None, 0)]
    _write(tmp_path / "run", recs)
    history = load_history(RunDir(tmp_path / "run"))
    assert len(history.segments) == 2 and history.segments[1].extends_finished
    assert history.restarts == 0 and history.lost_time() == (0.0, 0)
    md = make_report(RunDir(tmp_path / "run")).read_text()
    assert "| restarts | 0 |" in md and "| extended after finishing | 1 |" in md
    assert "| time lost to restarts | 0m 00s (0 steps recomputed) |" in md
    assert "50 (extended: train.max_steps raised) |" in md


def test_report_says_which_plots_it_wrote_and_when_there_are_none(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    program_run = tmp_path / "program"  # relaytrain.program records events only
    _write(program_run, [_event("start", 0, 1000.0, "7", 0), _event("finished", 12, 1010.0, "7", 0)])
    args = parser.parse_args(["report", str(program_run)])
    assert args.func(args) == 0
    said = capsys.readouterr().out
    assert "no plots" in said and "plots in" not in said
    assert not list((program_run / "report").glob("*.png"))
    trainer_run = tmp_path / "trainer"
    write_synthetic_run(trainer_run)
    args = parser.parse_args(["report", str(trainer_run)])
    assert args.func(args) == 0
    said = capsys.readouterr().out
    written = sorted(p.name for p in (trainer_run / "report").glob("*.png"))
    assert f"and {len(written)} plots in" in said and all(name in said for name in written)
