"""`relaytrain verify` against runs whose producer was broken, not their files: each test runs the real
trainer (`relaytrain train`, one process or two under torchrun) with one mutation of the code that makes
verify's evidence (tests/producer_mutations.py) or with changed data settings, and shows verify exits 1
with a one-line reason, while the same scenario without the mutation verifies OK.

Every run trains the tiny model on two small prepared sources mixed 1:1, stops at step 3 (saved there)
and resumes to step 6; the first half is shared (copied under another run name in the same run.dir)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relaytrain.data.prepare import prepare_dataset

from conftest import TINY, child_env, cli_in_process
from shared_runs import once_per_session

HERE = Path(__file__).resolve().parent
WRAPPER = HERE / "producer_mutations.py"


def _text(seed: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "data", "order", "step", "sample", "token", "window"]
    return "\n\n".join(" ".join(words[(i * seed + j * 7) % len(words)] for j in range(40)) for i in range(60))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """Two prepared sources (byte tokenizer), and a run stopped at step 3 with its checkpoint (`stopped`),
    made once per session for every xdist worker (tests/shared_runs.py); each test's runs go under its own
    name in runs/."""

    def make(tmp: Path) -> None:
        for name, seed in (("a", 3), ("b", 5)):
            (tmp / f"{name}.txt").write_text(_text(seed))
            prepare_dataset([str(tmp / f"{name}.txt")], tmp / "data" / name, val_fraction=0.05)
        train(tmp, "stopped", "--train.stop_at_step=3")

    return once_per_session(tmp_path_factory, "producers", make)


def args(workdir: Path, name: str, *extra: str) -> list[str]:
    sources = f'--data.sources=["{workdir / "data" / "a"}", "{workdir / "data" / "b"}"]'
    return ["train", *TINY, sources, "--data.weights=[1.0, 1.0]", f"--run.dir={workdir / 'runs'}",
            f"--run.name={name}", "--train.max_steps=6", "--checkpoint.interval=2", *extra]  # fmt: skip


def train(workdir: Path, name: str, *extra: str, mutation: str = "", nproc: int = 1) -> None:
    program = [str(WRAPPER)] if mutation else ["-m", "relaytrain.cli"]
    if nproc > 1:
        program = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *program]
    env = child_env(PRODUCER_MUTATION=mutation) if mutation else child_env()
    proc = subprocess.run([sys.executable, *program, *args(workdir, name, *extra)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def verify(workdir: Path, name: str, *flags: str) -> tuple[int, list[str]]:
    proc = cli_in_process(["verify", str(workdir / "runs" / name), *flags], workdir)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, proc.stdout.splitlines()


@pytest.fixture(scope="session")
def stopped(workdir) -> Path:
    """A run stopped at step 3 with its checkpoint (made with `workdir`): each test resumes a copy of it."""
    return workdir / "runs" / "stopped"


def resume(workdir: Path, stopped: Path, name: str, *extra: str, mutation: str = "") -> None:
    shutil.copytree(stopped, workdir / "runs" / name, symlinks=True)
    train(workdir, name, *extra, mutation=mutation)


def test_an_unmutated_resume_verifies(workdir, stopped):
    resume(workdir, stopped, "clean")
    code, out = verify(workdir, "clean")
    assert code == 0, out
    assert out[1].startswith("data: the tokens of 6 step record(s) match the prepared data read again")
    assert "2 source(s)" in out[1]
    assert "productive: the ledger's step time of 6 logged step(s) is " in out[3]  # both processes'


def test_a_loader_reseeded_on_resume_fails(workdir, stopped):
    resume(workdir, stopped, "reseed", mutation="reseed")
    code, out = verify(workdir, "reseed")
    assert code == 1
    assert (
        "data: step 4 (attempt " in out[0] and "the data settings changed since step 3: seed 0 -> 1" in out[0]
    )
    assert out[1].startswith("data: step 4, rank 0 (dp rank 0/1): the tokens it read are not global samples "
                             "[24, 32) of the run's data")  # fmt: skip


def test_a_resume_one_batch_ahead_fails(workdir, stopped):
    resume(workdir, stopped, "ahead", mutation="skip_batch")
    code, out = verify(workdir, "ahead")
    assert code == 1
    wrong = "data: step 4, rank 0 (dp rank 0/1): the tokens it read are not global samples [24, 32) of "
    assert any(line.startswith(wrong + "the run's data (it read step 5's (one batch ahead))") for line in out)
    assert any(line.startswith("samples: ") for line in out)


@pytest.mark.parametrize(
    ("setting", "change"),
    [
        ("--data.shuffle=false", "shuffle true -> false"),
        ("--data.weights=[1.0, 3.0]", "weights [1.0, 1.0] -> [1.0, 3.0]"),
    ],
)
def test_changed_data_settings_on_resume_fail_unless_allowed(workdir, stopped, setting, change):
    name = "shuffle" if "shuffle" in setting else "weights"
    resume(workdir, stopped, name, setting)
    code, out = verify(workdir, name)
    assert code == 1
    assert out[0].startswith("data: step 4 (attempt ") and f"changed since step 3: {change} (" in out[0]
    code, out = verify(workdir, name, "--allow-data-change")
    assert code == 0, out
    assert f"data settings changed at step 3 ({change}), allowed by --allow-data-change" in out[1]


def test_the_ledger_windows_of_a_process_dropped_fail(workdir, stopped):
    resume(workdir, stopped, "nowindows", mutation="drop_windows")
    code, out = verify(workdir, "nowindows")
    assert code == 1
    unmeasured = "ledger: the process that began at step 3 logged steps 4-6 (its train records) that no "
    assert unmeasured + "ledger window covers: their time is not measured" in out


def test_a_stop_whose_time_is_not_recorded_fails(workdir):
    train(workdir, "nostop", "--train.stop_at_step=3", mutation="unrecorded_stop")
    train(workdir, "nostop")
    code, out = verify(workdir, "nostop")
    assert code == 1
    (line,) = [line for line in out if line.startswith("ledger: ")]
    assert line.startswith("ledger: checkpoint step_3 was committed ") and line.endswith(
        " s after the last record of process, before the next allocation began: that process's stop (its "
        "save and its exit) is not recorded"
    )


def test_checkpoint_saves_counted_productive_fail(workdir):
    train(workdir, "saves", mutation="saves_productive")
    code, out = verify(workdir, "saves")
    assert code == 1
    assert out[0].startswith("ledger: productive: process's ledger puts ")
    assert "its train records' step times add up to " in out[0] and " more than 1% of its " in out[0]


@pytest.mark.parametrize("mutation", ["", "other_shard"])
def test_a_rank_reading_another_ranks_share_fails(workdir, mutation):
    name = f"two{mutation}"
    train(workdir, name, "--train.max_steps=3", mutation=mutation, nproc=2)
    code, out = verify(workdir, name)
    if not mutation:
        assert code == 0, out
        return
    assert code == 1
    assert out == [  # the index records are the loader's own counters: only the tokens show it
        "data: step 1, rank 0 (dp rank 0/2): the tokens it read are not global samples [0, 4) of the run's "
        "data (it read dp rank 1's share); 6 record(s) of attempt " + out[0].rsplit("attempt ", 1)[1]
    ]
