"""One run per run directory (relaytrain.resilience.run_kind): a `--command` launch needs a run name of
its own, a directory holding another kind of run (trainer vs program) or another command's run is
refused in one line, and a program run outside a launch gets `runs/<program>` of its own, never the
working directory. Conflicting launch flags are refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import test_slurm_script
from relaytrain.cli import main

from conftest import REPO, child_env, run_cli

work = test_slurm_script.work  # fake srun/scontrol/sbatch on PATH, no sinfo answer, cwd in tmp_path

CPU = ["--gpus-per-node", "0", "--tasks-per-node", "1", "--nodes", "1", "--dry-run"]
DEBUG = str(REPO / "configs" / "debug.toml")


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relaytrain: error: "), err
    return err[0]


def test_a_command_launch_needs_a_run_name_of_its_own(work, capsys):
    """Before: the program's run directory was the config's run.name, `debug` by default."""
    assert main(["launch", "--command", "python examples/ddp_train.py --out x", *CPU]) == 2
    assert "--command needs --name NAME" in one_error(capsys) and not (work / "runs").exists()
    assert main(["launch", DEBUG, "--command", "python examples/ddp_train.py", *CPU]) == 2
    assert "e.g. --name ddp_train" in one_error(capsys) and not (work / "runs").exists()
    grid = ["--grid", "lr=1,2"]
    assert main(["sweep", "--command", "python t.py --lr {lr}", *grid, *CPU]) == 2
    assert "sweep --command needs --name NAME" in one_error(capsys)
    assert main(["launch", "--command", "python t.py", "--run.name=mine", *CPU]) == 0
    assert json.loads((work / "runs/mine/run_kind.json").read_text()) == {
        "kind": "program",
        "command": "python t.py",
    }


def test_a_run_directory_holding_another_kind_of_run_is_refused(work, capsys):
    assert main(["launch", DEBUG, *CPU]) == 0  # relaytrain's trainer in runs/debug
    capsys.readouterr()
    assert main(["launch", "--command", "python a.py", "--name", "debug", *CPU]) == 2
    assert "runs/debug holds a relaytrain train run, not the run of --command 'python a.py'" in one_error(
        capsys
    )
    assert main(["launch", "--command", "python a.py", "--name", "p", *CPU]) == 0
    assert main(["launch", "--command", "python a.py", "--name", "p", *CPU]) == 0  # the same run again
    capsys.readouterr()
    assert main(["launch", "--command", "python b.py", "--name", "p", *CPU]) == 2
    assert "holds the run of --command 'python a.py', not the run of --command 'python b.py'" in one_error(
        capsys
    )
    assert main(["launch", DEBUG, "--name", "p", *CPU]) == 2
    assert "holds the run of --command 'python a.py', not a relaytrain train run" in one_error(capsys)
    # A sweep point is checked like a launch; a trainer run from before run_kind.json is known by its
    # resolved config.toml.
    (work / "runs" / "old-0").mkdir(parents=True)
    (work / "runs" / "old-0" / "config.toml").write_text("")
    assert main(["sweep", "--command", "python t.py {lr}", "--name", "old", "--grid", "lr=1,2", *CPU]) == 2
    assert "runs/old-0 holds a relaytrain train run" in one_error(capsys)


def test_the_trainer_refuses_a_programs_run_directory(tmp_path):
    run = tmp_path / "runs" / "p"
    run.mkdir(parents=True)
    (run / "run_kind.json").write_text('{"kind": "program", "command": "python a.py"}\n')
    done = run_cli(["train", "--run.name=p", "--train.max_steps=1"], tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "holds the run of --command 'python a.py', not a relaytrain train run" in done.stderr
    assert not (run / "config.toml").exists() and not (run / "metrics.jsonl").exists()


PROGRAM = """from relaytrain import program
program.install({run_dir})
program.finish(3)
"""


def _program(path, cwd, run_dir: str = "") -> subprocess.CompletedProcess:
    path.write_text(PROGRAM.format(run_dir=repr(run_dir) if run_dir else ""))
    env = child_env()
    for key in [k for k in env if k.startswith(("SLURM_", "RELAYTRAIN_"))] + ["RANK"]:
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_program_outside_a_launch_gets_a_run_directory_of_its_own(tmp_path):
    """Before: run_state.json, metrics.jsonl and run.lock landed in the working directory, and every
    program started there appended to the same run."""
    for name in ("alpha", "beta"):
        done = _program(tmp_path / f"{name}.py", tmp_path)
        assert done.returncode == 0, done.stderr
        run = tmp_path / "runs" / name
        said = f"relaytrain.program: run directory {run} (no RELAYTRAIN_RUN_DIR; set it, or install(run_dir"
        assert done.stderr.strip().startswith(said) and len(done.stderr.strip().splitlines()) == 1, (
            done.stderr
        )
        assert json.loads((run / "run_state.json").read_text())["status"] == "finished"
        events = [json.loads(line)["event"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert events == ["start", "finished"]  # its own history, not the other program's
    assert not any((tmp_path / name).exists() for name in ("run_state.json", "metrics.jsonl", "run.lock"))
    # install(run_dir=...) chooses another; a trainer's run directory is refused in one line.
    trainer = tmp_path / "runs" / "debug"
    trainer.mkdir()
    (trainer / "config.toml").write_text("")
    done = _program(tmp_path / "gamma.py", tmp_path, str(trainer))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"relaytrain: error: the run directory {trainer} holds a relaytrain train run, not a program's run "
        "(relaytrain.program): give this run its own name (--name NAME, or --run.name=NAME)"
    ]
    assert not (trainer / "run_state.json").exists()


def test_conflicting_launch_flags_are_refused_in_one_line(work, capsys):
    """Before: `--after 1234 --jobid 99` was accepted and --after ignored."""
    assert main(["launch", DEBUG, "--after", "1234", "--jobid", "99", "--dry-run"]) == 2
    assert "--after 1234 and --jobid 99 conflict" in one_error(capsys)
    assert not (work / "runs").exists()
    assert main(["launch", "--command", "python t.py", "--name", "p", "--force", *CPU]) == 2
    assert "a --command launch runs no plan" in one_error(capsys)
    assert main(["sweep", "--command", "t {x}", "--name", "s", "--grid", "x=1", "--force", *CPU]) == 2
    assert "drop --force" in one_error(capsys)
