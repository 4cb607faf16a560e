"""Foreign programs on the launch side (docs/programs.md): `launch --command` with overrides and no
CONFIG, and `sweep --command` with the grid values put into the command of each array task."""

from __future__ import annotations

import json
import tomllib

import pytest

import test_slurm_script
from relaytrain.cli import main
from relaytrain.errors import UserError
from relaytrain.slurm.grid import parse_grid, render_command
from relaytrain.slurm.launch import LaunchRequest, sweep
from test_slurm_script import quiet, run_script, srun_calls

from conftest import fake_tool

work = test_slurm_script.work  # the fixture: fake srun/scontrol/sbatch on PATH, cwd in tmp_path

CPU = ["--gpus-per-node", "0", "--tasks-per-node", "1", "--nodes", "1"]


def resolved(work, name: str) -> dict:
    return tomllib.loads((work / "runs" / name / "slurm" / "config.toml").read_text())


def test_launch_command_takes_overrides_with_spaces_without_a_config(work, capsys):
    argv = ["launch", "--command", "python t.py", "--name", "p", *CPU, "--dry-run",
            "--slurm.setup=['export A=1 B=2']", "--resilience.max_requeues=3"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    config = resolved(work, "p")
    assert config["slurm"]["setup"] == ["export A=1 B=2"] and config["resilience"]["max_requeues"] == 3
    assert "export A=1 B=2\n" in (work / "runs/p/slurm/job.sh").read_text()
    # Overrides before the flags, and a real CONFIG first, keep working.
    assert (
        main(["launch", "--resilience.max_requeues=4", "--command", "true", "--name", "q", *CPU, "--dry-run"])
        == 0
    )
    assert resolved(work, "q")["resilience"]["max_requeues"] == 4
    assert main(["launch", "nope.toml", "--command", "true", "--name", "r", *CPU, "--dry-run"]) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_grid_placeholders_are_substituted_quoted_and_checked():
    grid = parse_grid(
        ["lr=1e-3,1e-4", "resilience.max_requeues=2", "tag=a b"], "train.py --lr {lr} --t {tag}"
    )
    assert grid == [("lr", ["1e-3", "1e-4"]), ("resilience.max_requeues", ["2"]), ("tag", ["a b"])]
    command = "python t.py --lr {lr} --out $RELAYTRAIN_RUN_DIR/${SUB:-x} --n {resilience.max_requeues} {tag}"
    point = {"lr": "1e-4", "resilience.max_requeues": "2", "tag": "a b"}
    assert render_command(command, point) == (
        "python t.py --lr 1e-4 --out $RELAYTRAIN_RUN_DIR/${SUB:-x} --n 2 'a b'"
    )
    with pytest.raises(UserError, match=r"uses \{lrr\}, which is not a --grid key"):
        parse_grid(["lr=1"], "t.py {lrr} {lr}")
    with pytest.raises(UserError, match=r"--grid lr is not used by --command: put \{lr\}"):
        parse_grid(["lr=1"], "t.py")
    with pytest.raises(UserError, match="section.key=value1,value2"):
        parse_grid(["lr=1"])  # a bare name only makes sense as a command placeholder
    with pytest.raises(UserError, match="given twice"):
        parse_grid(["lr=1", "lr=2"], "t.py {lr}")


def test_command_sweep_gives_each_array_task_its_command_run_dir_and_array_aware_requeue(work):
    req = LaunchRequest(command="python t.py --lr {lr} --seed {seed}", name="hp", signal="USR2@60",
                        overrides=["--resilience.hard_deadline_s=30"],
                        slurm={"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1})  # fmt: skip
    assert sweep(req, ["lr=0.1,0.2", "seed=1,2"], quiet) == 0
    script = work / "runs/hp-sweep/slurm/job.sh"
    text = script.read_text()
    assert "#SBATCH --array=0-3" in text and "#SBATCH --signal=B:USR2@60" in text
    rows = (work / "runs/hp-sweep/sweep.tsv").read_text().splitlines()
    assert rows[0] == "index\trun_name\tvalues\tcommand"
    assert rows[3] == "2\thp-2\tlr=0.2 seed=1\tpython t.py --lr 0.2 --seed 1"
    assert json.loads((work / "runs/hp-sweep/sweep.json").read_text())[2]["values"] == {
        "lr": "0.2",
        "seed": "1",
    }
    assert resolved(work, "hp-2")["resilience"]["slurm_signal"] == "SIGUSR2"
    entries = [json.loads(x) for x in (work / "runs/hp-2/slurm/jobs.jsonl").read_text().splitlines()]
    assert entries[0]["job_id"] == "101_2"
    # Array task 2's step exits 75: its own command ran, with its run directory, and the batch shell
    # requeued that array task (not the whole array) with reason program_exit.
    fake_tool(
        work / "bin",
        "srun",
        'printf "%s\\n" "$@" > "$FAKE_LOG.srun.$$"\n'
        'echo "$RELAYTRAIN_RUN_DIR" >> "$FAKE_LOG.dirs"\nexit 75\n',
    )
    fake_tool(
        work / "bin", "scontrol", 'if [[ $1 == requeue ]]; then echo "$@" >> "$FAKE_LOG.scontrol"; fi\n'
    )
    done = run_script(
        script, {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_JOB_ID": "101", "SLURM_JOB_ID": "104"}
    )
    assert done.returncode == 75, done.stdout + done.stderr
    (step,) = srun_calls(work)
    assert step[-3:] == ["bash", "-c", "python t.py --lr 0.2 --seed 1"]
    assert (work / "fake.dirs").read_text().strip() == str(work / "runs/hp-2")
    assert (work / "fake.scontrol").read_text().splitlines() == ["requeue 101_2"]
    state = json.loads((work / "runs/hp-2/run_state.json").read_text())
    assert state["reason"] == "program_exit" and state["requeue_requested"]
    assert not (work / "runs/hp-1/run_state.json").exists()


def test_command_sweep_refuses_bad_input_in_one_line(work, capsys):
    base = ["sweep", "--command", "python t.py --lr {lr}", "--name", "hp", *CPU, "--dry-run"]
    assert main([*base, "--grid", "lr=1", "--grid", "seed=1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "relaytrain: error: --grid seed is not used by --command: put {seed} where it goes"
    ]
    assert main([*base, "--grid", "lrate=1"]) == 2
    assert "not a --grid key" in capsys.readouterr().err
    assert main(["sweep", "--grid", "optim.lr=1", *CPU, "--dry-run"]) == 2
    assert "needs a CONFIG, or --command" in capsys.readouterr().err
