"""status, cancel and doctor where Slurm is not installed or not configured; `status RUN` from its files.

"Not installed" is a PATH without Slurm's commands; "not configured" is the real client with a
configuration it cannot use. Nothing here imitates Slurm's answers.
"""

from __future__ import annotations

import json

import pytest

from relaytrain.cli import main
from relaytrain.job import RunDir
from relaytrain.resilience.run_state import RunState, RunStateFile

import needs


@pytest.fixture
def no_slurm(tmp_path, monkeypatch):
    """A PATH that holds no Slurm command."""
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return tmp_path


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("relaytrain: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "tool"), [(["status"], "squeue"), (["status", "123"], "scontrol"), (["cancel", "5"], "scancel")]
)
def test_a_command_that_cannot_ask_slurm_says_so_in_one_line(no_slurm, capsys, argv, tool):
    assert main(argv) == 2
    err = _one_error_line(capsys)
    assert f"{tool} not found" in err and "SLURM_CONF" in err


def test_an_unconfigured_slurm_client_is_one_line_not_an_empty_queue(tmp_path, monkeypatch, capsys):
    needs.program("squeue", "apt-get install slurm-client")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))  # answered at once, not after retries
    assert main(["status"]) == 2
    assert "SLURM_CONF=" in _one_error_line(capsys)
    (tmp_path / "empty.conf").write_text("")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "empty.conf"))  # the real squeue refuses it
    assert main(["status"]) == 2
    assert "squeue cannot read Slurm's configuration" in _one_error_line(capsys)
    assert main(["cancel", "5"]) == 2
    assert "scancel cannot read Slurm's configuration" in _one_error_line(capsys)
    assert main(["doctor"]) == 1  # sinfo cannot answer: the partition check fails
    assert "sinfo cannot read Slurm's configuration" in capsys.readouterr().out.replace("\n", " ")


def test_doctor_fails_without_slurm(no_slurm, capsys):
    assert main(["doctor"]) == 1
    assert "fail" in capsys.readouterr().out


def test_status_of_a_run_reads_its_directory_without_slurm(no_slurm, capsys):
    run = no_slurm / "runs" / "debug"
    damage = "step_5 is damaged: bad checksum"
    RunStateFile(RunDir(run)).write(
        RunState.of("failed", "error", 7, message="RuntimeError('boom')", checkpoint_error=damage)
    )
    (run / "metrics.jsonl").write_text(json.dumps({"step": 6, "time": 1.0, "loss": 2.0}) + "\n")
    for target in ("debug", str(run), "runs/debug"):
        assert main(["status", target]) == 0, target
        out = capsys.readouterr().out
        assert "failed (error)" in out and "boom" in out and "6" in out
        assert "checkpoint_error" in out and "step_5 is damaged" in out
    assert main(["status", "nosuchrun"]) == 2
    assert "no run 'nosuchrun'" in _one_error_line(capsys)


def test_status_of_a_launched_run_without_slurm_still_shows_the_run(no_slurm, capsys):
    run = no_slurm / "runs" / "big"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs.jsonl").write_text(json.dumps({"job_id": "42", "run_dir": str(run)}) + "\n")
    RunStateFile(RunDir(run)).write(RunState.of("stopped", "time_limit", 3))
    assert main(["status", "big"]) == 0
    out = capsys.readouterr().out
    assert "stopped (time_limit)" in out and "its Slurm jobs: unknown (scontrol not found" in out


@pytest.mark.slurm
def test_with_slurm_present_the_same_commands_answer(slurm_cluster, tmp_path, monkeypatch, capsys):
    """Slurm's ordinary refusals (an unknown job) are answers, not "Slurm cannot be asked"."""
    monkeypatch.chdir(tmp_path)
    assert main(["status", "--all"]) == 0
    capsys.readouterr()
    assert main(["status", "999999"]) == 2
    assert "no job or run '999999' found" in _one_error_line(capsys)
    run = tmp_path / "runs" / "done"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs.jsonl").write_text(json.dumps({"job_id": "999999", "run_dir": str(run)}) + "\n")
    RunStateFile(RunDir(run)).write(RunState.of("finished", "max_steps", 4))
    assert main(["status", "done"]) == 0
    out = capsys.readouterr().out
    assert "finished (max_steps)" in out and "999999" in out and "UNKNOWN" in out
    # scancel itself exits 0 for a job it does not know; it must not read as cancelled.
    assert main(["cancel", "999999"]) == 2
    line = _one_error_line(capsys)
    assert "could not cancel job 999999: Kill job error on job id 999999: Invalid job id" in line
    assert main(["doctor"]) == 0, capsys.readouterr().out
