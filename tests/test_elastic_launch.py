"""`--nodes MIN-MAX` from the CLI to the job script and `relaytrain plan`; `--name` checked as run.name."""

from __future__ import annotations

import pytest

from relaytrain.cli import main
from tiny_config import TINY_TOML

CPU = ["--gpus-per-node", "0", "--tasks-per-node", "2", "--time", "00:10:00"]
TINY = "\n" + TINY_TOML + "max_steps = 4\n"


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tiny.toml"
    path.write_text(TINY + f'[run]\nname = "el"\ndir = "{tmp_path / "runs"}"\n')
    return str(path)


def script(tmp_path, name="el") -> str:
    return (tmp_path / "runs" / name / "slurm" / "job.sh").read_text()


def test_a_node_range_reaches_sbatch_and_srun_takes_the_nodes_it_got(tmp_path, config):
    assert main(["launch", config, "--nodes", "1-2", *CPU, "--dry-run"]) == 0
    text = script(tmp_path)
    assert "#SBATCH --nodes=1-2\n" in text
    srun = text.split("srun_options=(", 1)[1].split(")", 1)[0]
    assert "--nodes" not in srun and "--ntasks-per-node=2" in srun  # every node of the allocation
    assert "python -m relaytrain.cli train" in text  # srun starts the ranks, also on one node
    assert "min_nodes = 1" in (tmp_path / "runs/el/slurm/config.toml").read_text()
    assert main(["launch", config, "--nodes", "2", *CPU, "--dry-run"]) == 0
    assert "#SBATCH --nodes=2\n" in script(tmp_path)
    assert "--nodes=2\n" in script(tmp_path).split("srun_options=(", 1)[1].split(")", 1)[0]


@pytest.mark.parametrize("value", ["3-1", "0-2", "two", "1-", "-2"])
def test_a_bad_node_range_is_one_line(config, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["launch", config, f"--nodes={value}", *CPU, "--dry-run"])
    assert exc.value.code == 2
    assert "--nodes" in capsys.readouterr().err


def test_plan_shows_each_count_and_refuses_a_range_with_an_impossible_count(config, capsys):
    assert main(["plan", config, "--nodes", "1-2", *CPU]) == 0
    out = capsys.readouterr().out
    assert "node range" in out and "2 x 2" in out and "2 x 1" in out  # micro x accum at 2 and 4 ranks
    # 3 nodes x 2 = 6 ranks: the global batch of 8 does not divide
    assert main(["plan", config, "--nodes", "2-3", *CPU]) == 1
    out = capsys.readouterr().out
    assert "impossible" in out and "divisible by the data-parallel degree 6" in out
    with pytest.raises(Exception, match="plan refused .* at 3 node\\(s\\).*narrow the --nodes range"):
        from relaytrain.slurm.launch import LaunchRequest, launch

        launch(
            LaunchRequest(
                config=config,
                slurm={"nodes": 3, "min_nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2},
                dry_run=True,
            ),  # fmt: skip
            lambda _line: None,
        )


@pytest.mark.parametrize("name", ["a%b", "x/y", " ", ".."])
def test_name_goes_through_the_run_name_check(tmp_path, config, capsys, name):
    assert main(["launch", config, "--name", name, *CPU, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "run.name=" in err and "not allowed" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / name.strip()).joinpath("slurm").exists()


def test_a_numeric_name_stays_a_name(tmp_path, config):
    assert main(["launch", config, "--name", "12", *CPU, "--dry-run"]) == 0
    assert 'name = "12"' in (tmp_path / "runs/12/slurm/config.toml").read_text()


def test_sweep_names_go_through_the_run_name_check(tmp_path, config, capsys):
    long = "n" * 199  # the point names (<name>-0) pass 200 bytes, the limit of run.name
    code = main(["sweep", config, "--grid", "optim.lr=1e-3,2e-3", *CPU, "--dry-run", f"--run.name={long}"])
    assert code == 2
    assert "run.name=" in capsys.readouterr().err
