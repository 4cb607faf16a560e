"""What a run's own files say, with or without Slurm: `relaytrain logs RUN`, `status RUN` on a damaged
run_state.json and after a dry run, `report` on a file, a missing `checkpoint.resume` path, the stops
table of a trainer's own stop, and the throughput and MFU plots of a one-device CPU run."""

from __future__ import annotations

import json

import pytest

import test_slurm_script
from relaytrain.cli import main
from relaytrain.errors import UserError
from relaytrain.inspection.report import make_report
from relaytrain.job import RunDir
from relaytrain.monitor import plots
from relaytrain.monitor.history import load_history
from tiny_config import TINY_TOML

from conftest import REPO, run_cli

work = test_slurm_script.work  # fake srun/scontrol/sbatch on PATH, no sinfo answer, cwd in tmp_path


@pytest.fixture
def no_slurm(tmp_path, monkeypatch):
    """A login node without Slurm's configuration: every Slurm client fails."""
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_logs_takes_a_run_name_or_directory_without_slurm(no_slurm, capsys):
    """Before: `relaytrain logs mine` took `mine` for a job id and asked scontrol."""
    run = no_slurm / "runs" / "mine"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank_0.log").write_text("step 10 loss 2.5\n")
    (run / "run_state.json").write_text('{"status": "finished", "step": 10}')
    for target in ("mine", str(run)):
        assert main(["logs", target]) == 0
        out = capsys.readouterr()
        shown = "runs/mine" if target == "mine" else target  # the file it prints, named on stderr
        assert out.out == "step 10 loss 2.5\n" and out.err == f"==> {shown}/logs/rank_0.log <==\n"
    assert main(["logs", "mine", "-f"]) == 0  # nothing holds the run: following ends at once
    assert capsys.readouterr().out == "step 10 loss 2.5\n"
    # A launched run: its newest job's output, found through jobs.jsonl (Slurm is not asked).
    (run / "slurm").mkdir()
    log = str(run / "slurm" / "%j.out")
    (run / "slurm" / "jobs.jsonl").write_text(json.dumps({"job_id": "41", "log": log}) + "\n")
    (run / "slurm" / "41.out").write_text("job 41 output\n")
    assert main(["logs", "mine"]) == 0 and capsys.readouterr().out == "job 41 output\n"
    assert main(["logs", "nosuchrun"]) == 2
    assert "no run 'nosuchrun' under runs/" in capsys.readouterr().err
    (no_slurm / "runs" / "quiet").mkdir()
    (no_slurm / "runs" / "quiet" / "run_state.json").write_text("{}")
    assert main(["logs", "quiet"]) == 2 and "has no log yet" in capsys.readouterr().err


def test_status_says_a_damaged_run_state_is_damaged(no_slurm, capsys):
    """Before: "the run has not started yet" and exit 0."""
    run = no_slurm / "runs" / "broken"
    run.mkdir(parents=True)
    (run / "run_state.json").write_text('{"status": "stop')
    assert main(["status", "broken"]) == 1
    out = capsys.readouterr()
    assert "has not started" not in out.out and "damaged" in out.out
    assert out.err.startswith("relaytrain: error: runs/broken/run_state.json is damaged (")


def test_status_after_a_dry_run_says_no_job_was_submitted(work, capsys):
    """Before: an empty jobs table."""
    argv = ["launch", str(REPO / "configs/debug.toml"), "--gpus-per-node", "0", "--tasks-per-node", "1"]
    assert main([*argv, "--dry-run"]) == 0
    capsys.readouterr()
    assert main(["status", "debug"]) == 0
    out = capsys.readouterr().out
    assert "its Slurm jobs: none submitted" in out and "submit with: sbatch --parsable" in out
    assert "┃ job" not in out  # no empty table


def test_report_of_a_file_says_it_is_not_a_run_directory(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=r"afile is not a run directory \(a file\)"):
        make_report(RunDir(tmp_path / "afile"))


def test_a_missing_resume_path_is_refused_with_the_config(tmp_path, work, capsys):
    """Before: refused only after torch started and the run directory existed."""
    missing = tmp_path / "nowhere" / "step_00000010"
    done = run_cli(["train", f"--checkpoint.resume={missing}"], tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"relaytrain: error: checkpoint.resume={missing}: checkpoint path {missing} does not exist"
    ]
    assert "torch" not in done.stderr and not (tmp_path / "runs").exists()
    assert (
        main(["launch", str(REPO / "configs/debug.toml"), f"--checkpoint.resume={missing}", "--dry-run"]) == 2
    )
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_stops_table_fills_saved_and_exit_code_for_the_trainers_own_stops(tmp_path):
    """Before: the trainer's stop event held only its reason; the table's saved and exit code were empty."""
    config = tmp_path / "tiny.toml"
    config.write_text(
        f'[run]\nname = "s"\n{TINY_TOML}max_steps = 6\nstop_at_step = 3\n\n[metrics]\nlog_every = 1\n'
    )
    done = run_cli(["train", str(config)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    md = make_report(RunDir(tmp_path / "runs" / "s")).read_text()
    (row,) = [line for line in md.splitlines() if line.startswith("| local | 3 | stop |")]
    assert row == "| local | 3 | stop | stop_at_step | True |  | 0 |", row


def _one_device_cpu_run(run_dir) -> None:
    records = [
        {"kind": "train", "step": step, "time": 1000.0 + step, "loss": 3.0, "tokens_per_s": 900.0 + step,
         "tokens_per_s_per_device": 900.0 + step, "mfu": 0.2, "mfu_estimate": True}
        for step in range(1, 6)
    ]  # fmt: skip
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_one_device_throughput_is_one_visible_line_and_cpu_mfu_is_marked_an_estimate(tmp_path, monkeypatch):
    """Before: the all-devices line lay exactly under the per-device line; the MFU plot did not say that a
    CPU's MFU is an estimate (its peak is measured on this machine)."""
    drawn = {}

    def keep(fig, ax, path):
        drawn[path.name] = (ax.get_title(), ax.get_ylabel(), [line.get_label() for line in ax.get_lines()])
        return path

    monkeypatch.setattr(plots, "_save", keep)
    _one_device_cpu_run(tmp_path / "run")
    plots.plot_all(load_history(RunDir(tmp_path / "run")), {}, "run", tmp_path / "out")
    title, _, labels = drawn["throughput.png"]
    assert [label for label in labels if label.startswith("tokens/s")] == [
        "tokens/s (one device: all devices = per device)"
    ]
    title, ylabel, _ = drawn["mfu.png"]
    assert "estimate" in title and "estimate" in ylabel


def test_status_json_without_a_run_is_one_line_and_exit_2(no_slurm, capsys):
    """`--json` describes a run: the queue or a job id with it is refused in one line naming the fix."""
    assert main(["status", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "relaytrain status RUN --json" in err
    assert main(["status", "nosuchrun", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run 'nosuchrun'" in err
