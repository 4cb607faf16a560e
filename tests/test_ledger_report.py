"""The time ledger where a user reads it: `relaytrain report` (its table and ledger.png) and `relaytrain
status RUN` (the goodput row; `--json`'s `ledger` object), on a tiny real run and on a synthetic Slurm run
whose allocations come from (a stand-in for) sacct."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import relaytrain.monitor.run_ledger as run_ledger
import test_monitor_report
from relaytrain.cli import main
from relaytrain.inspection.report import make_report
from relaytrain.job import RunDir
from relaytrain.job.allocations import JobRun, SlurmRuns
from relaytrain.monitor.ledger import BUCKET_MEANING, BUCKETS
from relaytrain.monitor.ledger_plot import BUCKET_COLORS
from test_ledger import T0, _crashed_step, _trained, begin, driver, end, ident, window


@pytest.fixture
def tiny_run(stopped_and_resumed_run, tmp_path) -> Path:
    """A copy of a tiny run stopped at step 3 and resumed to step 6 (two processes outside Slurm)."""
    run = tmp_path / "runs" / "r"
    shutil.copytree(stopped_and_resumed_run, run, symlinks=True)
    return run


def test_status_and_report_show_a_runs_ledger(tiny_run, capsys):
    assert main(["status", str(tiny_run), "--json"]) == 0
    ledger = json.loads(capsys.readouterr().out)["ledger"]
    assert set(ledger) >= {"allocated_s", "queue_s", "goodput", "buckets", "jobs"}
    assert list(ledger["buckets"]) == list(BUCKETS) and "unaccounted" in ledger["buckets"]
    # each figure is rounded to the millisecond: their sum within half a millisecond each of the total
    assert sum(ledger["buckets"].values()) == pytest.approx(ledger["allocated_s"], abs=0.0005 * 13)
    assert ledger["goodput"] == pytest.approx(
        ledger["buckets"]["productive"] / ledger["allocated_s"], abs=1e-4
    )
    assert 0 < ledger["goodput"] < 1 and ledger["queue_s"] > 0  # two processes, the second after the first
    assert [job["label"] for job in ledger["jobs"]] == ["process", "process 1"]
    exact = run_ledger.run_ledger(RunDir(tiny_run))  # the computation the JSON rounds
    assert sum(exact.buckets.values()) == pytest.approx(exact.allocated_s, rel=1e-6)

    assert main(["status", str(tiny_run)]) == 0
    shown = capsys.readouterr().out
    assert "goodput" in shown and f"{exact.goodput:.1%} of" in shown and "largest losses:" in shown

    assert main(["report", str(tiny_run)]) == 0
    assert "ledger.png" in capsys.readouterr().out
    width, height = test_monitor_report._png_size(tiny_run / "report" / "ledger.png")
    assert width >= 800 and height >= 400
    md = (tiny_run / "report" / "report.md").read_text()
    assert "## Time ledger" in md and "![ledger](ledger.png)" in md
    productive = exact.buckets["productive"]
    assert f"| productive | {productive:.1f} | {productive / exact.allocated_s:.1%} |" in md
    assert "| unaccounted | 0.0 | 0.0% |" in md
    assert f"| allocated | {exact.allocated_s:.1f} | 100.0% |" in md
    assert f"| queue | {exact.queue_s:.1f} | |" in md
    assert "| process | 0.0s | the run's records |" in md and "| process 1 |" in md


def write_slurm_run(run: Path) -> None:
    """Job 7 crashes in its first job step, restarts in place, trains on and is preempted (sacct's End 10 s
    after its records); job 8, queued 60 s, resumes from step 30 and finishes, its trainer's records cut
    short (crashed: no driver) well before Slurm's End."""
    job, again, requeued = ident("7"), ident("7", step_restart=1), ident("8")
    records = _crashed_step(job)
    records += [driver("step_start", 32.0, again), begin(37.0, 20, 33.0, 35.0, "node memory", again)]
    records += [window(21, 30, 37.0, 47.0, again, checkpoint=1.5), end("stop", 30, 48.0, again)]
    records += [driver("step_end", 49.0, again, exit_code=0), driver("job_end", 50.0, again, exit_code=0)]
    records += _trained(requeued, 120.0, 170.0, first=31)[:2]
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_report_table_has_a_row_per_bucket_and_per_allocation(tmp_path, monkeypatch):
    run = tmp_path / "slurm-run"
    write_slurm_run(run)
    sacct = [JobRun("7", 0, T0 - 2.0, T0 + 60.0, False), JobRun("8", 0, T0 + 120.0, T0 + 200.0, False)]
    answer = lambda jobs: SlurmRuns([r for r in sacct if r.job_id in jobs])  # noqa: E731
    monkeypatch.setattr(run_ledger, "slurm_runs", answer)
    md = make_report(RunDir(run)).read_text()
    # job 7: 62 s, 28.5 productive, 13 stop (10 of them after the driver's end, up to Slurm's End); job 8:
    # 80 s, 1 startup, 48 productive (steps 31-40), then 31 s no record covers
    assert "Goodput 53.9%: productive steps' share of 2m22s allocated in 2 allocations" in md
    assert "| productive | 76.5 | 53.9% | training steps, each step counted once |" in md
    assert "| unaccounted | 31.0 | 21.8% | time no record covers |" in md
    assert "| lost | 7.0 | 4.9% |" in md and "| restart | 5.0 | 3.5% |" in md
    assert "| checkpoint | 1.5 | 1.1% |" in md and "| stop | 13.0 | 9.2% |" in md
    assert "| allocated | 142.0 | 100.0% |" in md and "| queue | 60.0 | |" in md
    assert "| job 7 | 0.0s | Slurm accounting | 62.0 | 46.0% | stop 13.0s |" in md
    assert "| job 8 | 2m02s | Slurm accounting | 80.0 | 60.0% | unaccounted 31.0s |" in md
    assert (run / "report" / "ledger.png").stat().st_size > 10_000


def test_a_run_without_ledger_records_says_so_and_draws_no_timeline(tmp_path):
    run = tmp_path / "old"
    test_monitor_report.write_synthetic_run(run)  # the records of a relaytrain from before the ledger
    md = make_report(RunDir(run)).read_text()
    assert "The run recorded no time ledger" in md and "| productive |" not in md
    assert not (run / "report" / "ledger.png").exists() and (run / "report" / "loss.png").exists()


def test_every_bucket_has_its_colour():
    assert set(BUCKET_COLORS) == set(BUCKETS)


def test_the_docs_name_every_bucket_with_its_meaning():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "monitoring.md").read_text()
    for name, meaning in BUCKET_MEANING.items():
        assert f"| `{name}` | {meaning} |" in doc, name
