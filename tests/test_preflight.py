"""relaytrain preflight: the judge (each node against the median and the plan's needs, one line per node),
the storage and memory readings through their seams, the plan's figures, the status row, and the command
on two gloo ranks through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from relaytrain.job import RunDir
from relaytrain.preflight import measure
from relaytrain.preflight.judge import GIB, Thresholds, judge, report_lines, summary
from relaytrain.preflight.needs import run_needs

from conftest import child_env, fake_tool, run_cli, run_torchrun

Usage = namedtuple("Usage", "total used free")


def _rank(rank: int, node: str, **figures) -> dict:
    return {"rank": rank, "node": node, "figures": figures}


def test_a_node_further_below_the_median_than_the_threshold_is_named_once():
    ranks = [_rank(0, "n1", gflops=100.0), _rank(1, "n2", gflops=50.0), _rank(2, "n3", gflops=90.0),
             _rank(3, "n4", gflops=104.0)]  # fmt: skip
    problems = judge(ranks, {})
    lines = report_lines(problems)
    # median 95: n2 is 47 % below (named), n3 5 % below (not)
    assert lines == ["preflight: n2 compute 47 % below the median (50.0 vs 95.0 GFLOP/s)"]
    assert summary(problems) == "1 of 4 node(s) below threshold: n2"
    assert report_lines(judge(ranks, {}, Thresholds(compute_pct=50.0))) == []


def test_a_node_is_judged_by_its_worst_rank_and_gets_one_line_for_all_it_lacks():
    ranks = [_rank(0, "n1", gflops=100.0, gbps=10.0), _rank(1, "n1", gflops=99.0, gbps=10.0),
             _rank(2, "n2", gflops=40.0, gbps=3.0), _rank(3, "n2", gflops=100.0, gbps=10.0),
             _rank(4, "n3", gflops=101.0, gbps=11.0)]  # fmt: skip
    ranks[2]["figures"]["host_free_bytes"] = 2 * GIB
    lines = report_lines(judge(ranks, {"host_bytes": 4 * GIB}))
    assert len(lines) == 1 and lines[0].startswith("preflight: n2 compute 60 % below the median")
    assert "network 70 % below the median (3.0 vs 10.0 GB/s)" in lines[0]
    assert "host memory 2.0 GiB free of the 4.0 GiB the run needs" in lines[0]


def test_one_node_has_no_median_to_fall_below():
    assert report_lines(judge([_rank(0, "n1", gflops=1.0, gbps=0.1)], {})) == []


def test_gpu_health_problems_are_named():
    ranks = [_rank(0, "g1"), _rank(1, "g2")]
    ranks[1]["gpu"] = {"index": 3, "ecc_uncorrected": 2, "retired_pages_pending": True, "temperature_c": 95}
    ranks[0]["gpu"] = {"index": 0, "ecc_uncorrected": 0, "retired_pages_pending": False, "temperature_c": 60}
    (line,) = report_lines(judge(ranks, {}))
    assert line.startswith("preflight: g2 GPU 3: 2 uncorrected ECC errors; GPU 3: pages pending retirement")
    assert "95 C, over 90 C" in line


def test_storage_free_space_short_of_a_save_through_the_seam(tmp_path):
    reading = measure.storage_probe(tmp_path / "ck", disk_usage=lambda path: Usage(10 * GIB, 9 * GIB, GIB))
    assert reading["free_bytes"] == GIB and "error" not in reading and reading["write_mb_s"] > 0
    assert not list((tmp_path / "ck").iterdir())  # the probe file is gone
    ranks = [_rank(0, "n1", storage_free_bytes=reading["free_bytes"])]
    (line,) = report_lines(judge(ranks, {"save_bytes": 3 * GIB}))
    assert line == "preflight: n1 checkpoint storage 1.0 GiB free of the 3.0 GiB the run needs"
    (line,) = report_lines(judge([_rank(0, "n1", storage_free_bytes=0)], {"save_bytes": 36 * 1024**2}))
    assert line == "preflight: n1 checkpoint storage 0.0 MiB free of the 36.0 MiB the run needs"  # not GiB


def test_a_checkpoint_folder_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    reading = measure.storage_probe(blocker / "ck")  # a folder under a file: mkdir fails
    assert "write-read-fsync failed" in reading["error"]
    ranks = [{**_rank(0, "n1"), "storage_error": reading["error"]}]
    (line,) = report_lines(judge(ranks, {}))
    assert line.startswith("preflight: n1 checkpoint storage write-read-fsync failed")


def test_free_space_reads_the_nearest_existing_folder(tmp_path):
    asked = []

    def usage(path):
        asked.append(Path(path))
        return Usage(8, 4, 123)

    assert measure.free_bytes(tmp_path / "not/made/yet", disk_usage=usage) == 123
    assert asked == [tmp_path]


def test_the_needs_are_the_plans_figures():
    from relaytrain.config import load_config
    from relaytrain.plan.checks import make_plan
    from relaytrain.plan.host_memory import host_memory_parts
    from relaytrain.plan.snapshot_memory import snapshot_bytes_per_node

    cfg = load_config(None, ["--checkpoint.snapshot_every=5", "--checkpoint.snapshot_replicas=1"])
    needs = run_needs(cfg, nodes=2, per_node=2, gpus_per_node=0)
    plan = make_plan(cfg, 2, 0, tasks_per_node=2)
    parts = host_memory_parts(cfg, plan.memory, plan.dims, 2, 2, plan.parameters, 0)
    assert needs.host_bytes == sum(v for _, v in parts) > 0
    assert needs.shm_bytes == snapshot_bytes_per_node(cfg, plan.dims, 2, 2, plan.parameters)[0] > 0
    assert needs.save_bytes == plan.checkpoint_bytes > 0
    off = run_needs(load_config(None, ["--checkpoint.enabled=false"]), 1, 1, 0)
    assert off.shm_bytes == off.save_bytes == 0


def test_status_shows_the_newest_preflight(tmp_path):
    from relaytrain.inspection.run_view import run_rows

    run = RunDir(tmp_path / "r")
    run.preflights.mkdir(parents=True)
    run.run_state.write_text('{"status": "stopped", "step": 3}')
    for job, told in (("76", "2 node(s) passed"), ("77", "1 of 2 node(s) below threshold: n2")):
        record = {"job": job, "summary": told, "lines": [f"preflight: n2 compute x{job}"][: job == "77"]}
        run.preflight(job).write_text(json.dumps(record))
        time.sleep(0.01)
    rows = [row for row in run_rows(run) if row[0].startswith("preflight")]
    assert rows == [
        ("preflight", "job 77: 1 of 2 node(s) below threshold: n2 (preflight/77.json)"),
        ("preflight node", "n2 compute x77"),
    ]


def test_in_a_slurm_allocation_it_runs_as_one_task_per_node(tmp_path):
    fake_tool(tmp_path / "bin", "srun", 'echo "$@" > "$SRUN_ARGS"; exit 1\n')
    env = {
        "SLURM_JOB_ID": "42",
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SRUN_ARGS": str(tmp_path / "a"),
    }
    done = run_cli(["preflight", "--budget", "2", "--nodes", "4", "--run.dir=runs"], tmp_path, **env)
    assert done.returncode == 1, done.stderr  # the step's exit status: a node below threshold
    words = (tmp_path / "a").read_text().split()
    assert words[0] == "--ntasks-per-node=1" and words[1] == sys.executable
    assert words[2:] == [
        "-m",
        "relaytrain.cli",
        "preflight",
        "--run.dir=runs",
        "--nodes",
        "4",
        "--budget",
        "2.0",
    ]


@pytest.mark.slow
def test_preflight_on_two_gloo_ranks_writes_every_nodes_results_and_names_a_bad_one(tmp_path):
    """The first run is docs/howto/preflight.md's line as the page writes it (torchrun started by the
    command), a 1 s budget appended; the second runs the ranks under torchrun with a blocked folder."""
    from test_docs_cli import bash_lines

    page = Path(__file__).parents[1] / "docs" / "howto" / "preflight.md"
    (line,) = [line for line in bash_lines(page) if "--nproc-per-node 2" in line]
    (tmp_path / "configs").symlink_to(page.parents[2] / "configs")
    done = subprocess.run(["bash", "-c", f"{line} --budget 1"], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    args = ["preflight", "--budget", "1", f"--run.dir={tmp_path / 'runs'}"]
    (path,) = RunDir.of(tmp_path / "runs", "debug").preflights.glob("local-*.json")
    record = json.loads(path.read_text())
    assert record["summary"] == "2 node(s) passed" and len(record["ranks"]) == 2
    assert all(r["figures"]["gflops"] > 0 and r["figures"]["gbps"] > 0 for r in record["ranks"])
    assert record["ranks"][0]["figures"]["storage_free_bytes"] > 0 and record["needs"]["save_bytes"] > 0
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a checkpoint folder that cannot be made: the first node is named, exit 1
    done = run_torchrun(2, [*args, f"--checkpoint.dir={blocker / 'ck'}"], tmp_path, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    named = [
        line for line in done.stdout.splitlines() if line.startswith("preflight: ") and "storage" in line
    ]
    assert len(named) == 1 and named[0].endswith(
        ":0 checkpoint storage write-read-fsync failed: Not a directory"
    )


@pytest.mark.cuda
def test_nvml_reads_the_gpus_health():
    health = measure.gpu_health(0)
    assert health is not None and health["sm_clock_max_mhz"] > 0 and 0 < health["temperature_c"] < 120
    assert set(health) >= {"ecc_uncorrected", "retired_pages", "retired_pages_pending"}


def test_the_in_job_check_runs_only_in_slurm_and_when_not_off(tmp_path, monkeypatch):
    import torch

    from relaytrain.config import load_config
    from relaytrain.parallel.distributed import DistEnv
    from relaytrain.preflight.run import check_in_job

    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo", "n1")
    run = RunDir.of(tmp_path, "debug")
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "RELAYTRAIN_STEP_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    assert (
        check_in_job(load_config(None, [f"--run.dir={tmp_path}"]), env) == 0 and not run.preflights.exists()
    )
    monkeypatch.setenv("SLURM_JOB_ID", "91")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    off = load_config(None, [f"--run.dir={tmp_path}", "--resilience.preflight=off"])
    assert check_in_job(off, env) == 0 and not run.preflights.exists()
    before = torch.random.get_rng_state()
    assert check_in_job(load_config(None, [f"--run.dir={tmp_path}"]), env) == 0
    assert torch.equal(torch.random.get_rng_state(), before)  # the run's random stream is untouched
    record = json.loads(run.preflight("91-r2").read_text())
    assert record["summary"] == "1 node(s) passed" and record["ranks"][0]["node"] == "n1"


def test_the_benchmarks_page_names_the_shipped_compute_threshold():
    """The section is written by bench.preflight from kept results (test_bench_pages rebuilds it): its prose
    names the thresholds relaytrain ships, not those the kept runs were judged with."""
    from conftest import REPO

    text = (REPO / "docs" / "benchmarks.md").read_text()
    section = text[text.index("<!-- bench:preflight -->") : text.index("<!-- /bench:preflight -->")]
    limits = Thresholds()
    assert f"The thresholds: {limits.compute_pct:g} % below the median in compute" in section
    assert f"and {limits.network_pct:g} % below it in network" in section
