"""Elastic across requeues: a run stopped on 2 ranks continues on 1 or 4 with the same global batch.

The layout (data-parallel degree, micro batch x accumulation) is re-derived from the world the job got;
the checkpoint is resharded at load and the sampler continues at the exact sample. Losses match the
uninterrupted 2-rank run up to fp32 reduction order; the samples read are the same, index for index.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, child_env, cli_in_process, losses_by_step, read_metrics, run_cli
from shared_runs import once_per_session

HERE = Path(__file__).parent
# micro batch 2: 2 ranks take 4 sequences each as 2 x 2, 1 rank 8 as 2 x 4, 4 ranks 2 as 2 x 1.
STEPS = ["--train.max_steps=6", "--checkpoint.interval=2", "--train.micro_batch_size=2"]
# fp32 sums in another order: measured at most 1.1e-7 relative (AVX-512), the issue's own measurement
# 2.9e-7; the bound leaves room for other CPUs' kernels (AVX2, AMX).
REDUCTION_ORDER_RTOL = 1e-5


def train(tmp_path: Path, tiny_args: list[str], name: str, nproc: int, *extra: str) -> Path:
    log = tmp_path / f"samples-{name}"
    args = ["train", *tiny_args, *STEPS, f"--run.name={name}", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run([*cmd, str(HERE / "elastic_worker.py"), *args], cwd=tmp_path,
                          env=child_env(ELASTIC_SAMPLE_LOG=str(log)),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "runs" / name


def uninterrupted_two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run of STEPS (its folder: `runs/ref` and the sample logs `samples-ref.*`),
    made once per session: the reference here and of tests/test_checkpoint_resume.py's FSDP resume."""

    def make(folder: Path) -> None:
        train(folder, [*TINY, f"--run.dir={folder / 'runs'}"], "ref", 2)

    return once_per_session(tmp_path_factory, "elastic-reference", make)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    return uninterrupted_two_rank_run(tmp_path_factory)


def samples_by_step(tmp_path: Path, name: str) -> dict[int, list[int]]:
    """Step -> the sorted global sample indices all ranks read at that step."""
    seen: dict[int, list[int]] = {}
    for path in tmp_path.glob(f"samples-{name}.*"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            seen.setdefault(rec["step"], []).extend(range(rec["first"], rec["first"] + rec["count"]))
    return {step: sorted(indices) for step, indices in seen.items()}


def events(run_dir: Path, name: str) -> list[dict]:
    return [r for r in read_metrics(run_dir, "event") if r["event"] == name]


@pytest.mark.slow
def test_resume_on_fewer_or_more_ranks_matches_the_uninterrupted_run(tmp_path, tiny_args, reference_run):
    reference = reference_run / "runs" / "ref"
    cut = train(tmp_path, tiny_args, "cut", 2, "--train.stop_at_step=3")
    shutil.copytree(cut, tmp_path / "runs" / "cut4", symlinks=True)
    for log in tmp_path.glob("samples-cut.*"):
        shutil.copy(log, str(log).replace("samples-cut.", "samples-cut4."))
    train(tmp_path, tiny_args, "cut", 1)
    wide = train(tmp_path, tiny_args, "cut4", 4)

    expected = losses_by_step(reference)
    expected_samples = samples_by_step(reference_run, "ref")
    assert cli_in_process(["verify", str(reference)], tmp_path).returncode == 0
    assert sorted(expected) == list(range(1, 7))
    # each step reads the global batch: 8 consecutive samples, 8*(step-1) onward
    assert expected_samples == {s: list(range(8 * (s - 1), 8 * s)) for s in range(1, 7)}
    worst = 0.0
    for run, name, world, split in ((cut, "cut", 1, (2, 4)), (wide, "cut4", 4, (2, 1))):
        losses = losses_by_step(run)
        assert sorted(losses) == list(range(1, 7))
        for step in range(1, 4):
            assert losses[step] == expected[step]  # before the resize: the same 2-rank run
        for step in range(4, 7):
            rel = abs(losses[step] - expected[step]) / abs(expected[step])
            worst = max(worst, rel)
            assert rel < REDUCTION_ORDER_RTOL, (name, step, losses[step], expected[step])
        assert samples_by_step(tmp_path, name) == expected_samples
        (resize,) = events(run, "resize")
        assert resize["step"] == 3
        assert (resize["from_world_size"], resize["world_size"]) == (2, world)
        assert (resize["from_dp"], resize["dp"]) == (2, world)
        assert (resize["from_micro_batch"], resize["from_grad_accum"]) == (2, 2)
        assert (resize["micro_batch"], resize["grad_accum"]) == split
        assert json.loads((run / "run_state.json").read_text())["status"] == "finished"
        verified = cli_in_process(["verify", str(run)], tmp_path)  # from the run's own sample records
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "samples: steps 1-6: global samples [0, 48) each consumed once" in verified.stdout
        # the tokens read again from the prepared data: a resize keeps the global order
        assert "data: the tokens of" in verified.stdout and "resized at step 3" in verified.stdout
    print(f"\nelastic resume: max relative loss difference after the resize {worst:.2e}")


def test_unchanged_layout_logs_no_resize(stopped_and_resumed_run):
    # the session's one-process run stopped and resumed on the same world (tests/conftest.py), read only
    run = stopped_and_resumed_run
    assert len(events(run, "resume")) == 1
    assert events(run, "resize") == []


def test_a_world_no_layout_fits_is_one_line_before_the_run_starts(tmp_path, tiny_args):
    for layout in ("--parallel.dp_shard=2", "--parallel.tp=2"):
        proc = run_cli(["train", *tiny_args, *STEPS, "--run.name=nofit", layout], tmp_path)
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        (line,) = (proc.stdout + proc.stderr).strip().splitlines()  # no "run failed ... exit code 1"
        assert line.startswith("relaytrain: error: no valid layout for 1 rank(s) on 1 node(s)")
        assert not (tmp_path / "runs" / "nofit").exists()


def test_in_a_slurm_job_a_world_no_layout_fits_is_recorded_and_not_requeued(tmp_path, tiny_args):
    from relaytrain.job import JobFacts
    from relaytrain.resilience.batch.crash import classify
    from relaytrain.resilience.run_state import RunState

    job = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    args = ["train", *tiny_args, *STEPS, "--run.name=nofit", "--parallel.dp_shard=2"]
    proc = run_cli(args, tmp_path, **job)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no valid layout for 1 rank(s) on 1 node(s)" in proc.stderr
    assert "Traceback" not in proc.stderr
    state = json.loads((tmp_path / "runs" / "nofit" / "run_state.json").read_text())
    assert state["status"] == "failed" and state["reason"] == "error"
    assert "no valid layout" in state["message"]
    assert state["requeue_pending"] is False and state["requeue_requested"] is False
    # torchrun exits 1 whatever its worker returned: the crash check must still not retry it
    assert state["user_error"].startswith("no valid layout")  # the error the user must fix, as its own field
    assert classify(RunState.from_json(state), JobFacts.from_env(job), 1)[0] is False


def _record(kind: str, step: int, restart: int, t: float, **fields) -> str:
    return json.dumps({"kind": kind, "step": step, "time": t, "job_id": "7", "restart": restart, **fields})


def test_status_and_report_show_the_node_count_of_each_run(tmp_path):
    from relaytrain.inspection.report import make_report
    from relaytrain.job import RunDir
    from relaytrain.monitor.history import load_history
    from relaytrain.monitor.plots import _restarts_by_step
    from relaytrain.slurm.jobs import nodes_per_run

    lines = [_record("event", 0, 0, 1.0, event="start", world_size=4, nodes=2)]
    lines += [_record("train", s, 0, 1.0 + s, loss=5.0 - 0.1 * s) for s in (1, 2, 3)]
    lines += [_record("event", 2, 1, 10.0, event="resume", world_size=2, nodes=1),
              _record("event", 2, 1, 10.0, event="resize", from_nodes=2, nodes=1, from_world_size=4,
                      world_size=2, from_dp=4, dp=2, from_micro_batch=2, micro_batch=2,
                      from_grad_accum=1, grad_accum=2)]  # fmt: skip
    lines += [_record("train", s, 1, 10.0 + s, loss=5.0 - 0.1 * s) for s in (3, 4)]
    lines += [_record("event", 4, 2, 20.0, event="resume", world_size=4, nodes=2)]
    lines += [_record("train", 5, 2, 21.0, loss=4.5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    assert nodes_per_run(RunDir(tmp_path), "7") == "2, 1, 2"
    assert nodes_per_run(RunDir(tmp_path), "8") == ""
    history = load_history(RunDir(tmp_path))
    assert [seg.nodes for seg in history.segments] == [2, 1, 2]
    labels = [label for _, label in _restarts_by_step(history)]
    assert "resized 2 -> 1 nodes (4 -> 2 ranks)" in labels[0] and "resized" not in labels[1]
    report = make_report(RunDir(tmp_path)).read_text()
    assert "| nodes |" in report and "(resized 2 -> 1 nodes (4 -> 2 ranks))" in report


def test_a_node_range_job_reserves_cpus_per_node_not_a_task_count(tmp_path, monkeypatch):
    """Slurm 22.05 rewrites the task count of an --ntasks-per-node job to nodes x tasks at each start and
    keeps it on requeue, so a 1-2 job that ran on 2 nodes could not restart on 1 (docs/elastic.md)."""
    from relaytrain.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "tiny.toml"
    config.write_text(f'[run]\nname = "el"\ndir = "{tmp_path / "runs"}"\n[slurm]\ncpus_per_task = 3\n')
    cpu = ["--gpus-per-node", "0", "--tasks-per-node", "2", "--time", "00:10:00", "--dry-run"]
    assert main(["launch", str(config), "--nodes", "1-2", *cpu]) == 0
    script = (tmp_path / "runs" / "el" / "slurm" / "job.sh").read_text()
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --mincpus=6" in sbatch and not [o for o in sbatch if "--ntasks" in o]
    srun = script.split("srun_options=(", 1)[1].split(")", 1)[0]
    assert "--ntasks-per-node=2" in srun and "--cpus-per-task=3" in srun
    assert main(["launch", str(config), "--nodes", "2", *cpu]) == 0
    script = (tmp_path / "runs" / "el" / "slurm" / "job.sh").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "--mincpus" not in script
