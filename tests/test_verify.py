"""`relaytrain verify RUN`: every sample of a run consumed exactly once in order, its checkpoints intact,
its time ledger adding up.

One real run (stopped at step 3, resumed to step 6) is verified as it is and after tampering with a copy:
a skipped sample, a repeated sample, a damaged checkpoint file, a ledger window deleted or moved back
over the one before it. The ledger against Slurm's elapsed time is checked on records written here
(the Slurm runs: tests/test_bench_chaos.py). The lineage rule (which of several
attempts' records of a replayed step count) is tested on records written by `SampleRecorder` directly.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.data.consumption import CHAIN_START, Consumed, SampleRecorder, chain_next, range_digest
from relaytrain.data.sample_check import check_samples
from relaytrain.job import RunDir
from relaytrain.job.allocations import JobRun
from relaytrain.monitor.ledger_check import check_ledger
from relaytrain.monitor.ledger_spans import build_ledger


@pytest.fixture
def stopped_and_resumed(stopped_and_resumed_run) -> Path:
    return stopped_and_resumed_run


def verify(run: Path) -> tuple[int, list[str], str]:
    """`relaytrain verify RUN` in this process (no second torch import): exit code, stdout lines, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(run)])
    return code, out.getvalue().splitlines(), err.getvalue()


def copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / run.name, symlinks=True))


def edit_records(run: Path, step: int, **changes: int) -> None:
    """Rewrite rank 0's record of `step` (in every attempt that recorded it) as if the loader had read
    another range: `first` and `count` changed, the digest that of the new range (a consistent record)."""
    path = run / "samples" / "rank_0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        if r.get("step") == step:
            r.update(changes)
            r["digest"] = range_digest(r["first"], r["count"])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_stopped_and_resumed_run_verifies(stopped_and_resumed):
    code, out, err = verify(stopped_and_resumed)
    assert code == 0, out + [err]
    assert out[0].startswith("samples: steps 1-6: global samples [0, 48) each consumed once, in the order")
    assert "(2 segment(s) in the lineage" in out[0]
    assert out[1].startswith("data: the tokens of 6 step record(s) match the prepared data read again")
    assert out[2].startswith("checkpoints: ") and "latest -> step_6" in out[2]
    assert out[3].startswith("ledger: ") and "in 2 allocations, the buckets add up, unaccounted" in out[3]
    assert out[-1].endswith(": OK")


def test_a_skipped_sample_fails(stopped_and_resumed, tmp_path):
    run = copy(stopped_and_resumed, tmp_path)
    edit_records(run, 5, count=3)  # rank 0 read [32, 35) of [32, 36): sample 35 skipped
    code, out, _ = verify(run)
    assert code == 1
    assert out == [
        "samples: step 5, dp rank 0/1: read global samples [32, 35), an uninterrupted run reads [32, 40)",
        "samples: global samples [35, 40) were never consumed (skipped after step 5, dp rank 0/1)",
    ]


def test_a_repeated_sample_fails(stopped_and_resumed, tmp_path):
    run = copy(stopped_and_resumed, tmp_path)
    edit_records(run, 2, first=7)  # step 2 starts at sample 7, which step 1 read
    code, out, _ = verify(run)
    assert code == 1
    assert (
        "samples: global samples [7, 8) were consumed twice (step 1, dp rank 0/1, then step 2, "
        "dp rank 0/1)" in out
    )
    assert "samples: global samples [15, 16) were never consumed" in out[-1]


def test_a_damaged_checkpoint_file_fails(stopped_and_resumed, tmp_path):
    run = copy(stopped_and_resumed, tmp_path)
    shard = sorted((run / "checkpoints" / "step_4").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, _ = verify(run)
    assert code == 1
    changed = "does not match its checksum (its content changed after the save)"
    assert out == [f"checkpoints: checkpoint step_4: {shard.name} {changed}"]


def test_latest_naming_an_uncommitted_checkpoint_fails(stopped_and_resumed, tmp_path):
    run = copy(stopped_and_resumed, tmp_path)
    (run / "checkpoints" / "step_6" / "COMPLETE").unlink()
    code, out, _ = verify(run)
    assert code == 1
    assert out == ["checkpoints: latest points to step_6, which is not a committed checkpoint"]


def edit_metrics(run: Path, change) -> None:
    """metrics.jsonl with each record passed through `change` (None drops it)."""
    path = run / "metrics.jsonl"
    records = [change(json.loads(line)) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in records if r is not None))


def test_a_deleted_record_leaves_its_time_unaccounted_and_fails(stopped_and_resumed, tmp_path):
    run = copy(stopped_and_resumed, tmp_path)
    # without the resume event, nothing records the second process's start-up and restore (seconds,
    # where the tiny run's steps take milliseconds)
    edit_metrics(run, lambda r: None if r.get("event") == "resume" else r)
    code, out, _ = verify(run)
    assert code == 1
    (line,) = out
    assert line.startswith("ledger: ") and "is unaccounted (no record covers it), more than 1%" in line
    assert "; largest gaps: process at +" in line


def test_a_ledger_window_moved_back_over_the_one_before_fails(stopped_and_resumed, tmp_path):
    run = copy(stopped_and_resumed, tmp_path)

    def earlier(r: dict) -> dict:
        if r["kind"] == "ledger" and r["step"] == 3:
            r["window"]["since"] -= 0.5
        return r

    edit_metrics(run, earlier)
    code, out, _ = verify(run)
    assert code == 1
    (line,) = out
    assert line.startswith("ledger: 0.500 s (") and line.endswith(
        " of the allocated time) is claimed by two ledger windows, more than 1%: the ledger window of "
        "steps 3-3 begins 0.500 s before the window of step 2 ended"
    )


def test_a_run_without_ledger_windows_is_not_checked_and_says_so(stopped_and_resumed, tmp_path):
    run = copy(stopped_and_resumed, tmp_path)
    ledger_fields = ("process_start", "restore_start", "restored_from")

    def before_the_ledger(r: dict) -> dict | None:
        return None if r["kind"] == "ledger" else {k: v for k, v in r.items() if k not in ledger_fields}

    edit_metrics(run, before_the_ledger)  # as written before the ledger
    code, out, _ = verify(run)
    assert code == 0, out
    assert (
        "ledger: no ledger windows in the run's records (written before the time ledger): not checked" in out
    )


def slurm_job(job: str, start: float, steps: int) -> list[dict]:
    """One job run's records as the driver and a trainer write them: a second a step."""
    base = {"job_id": job, "restart": 0, "step_restart": 0}
    rows = [{"kind": "job", "event": "job_start", "step": 0, "time": start + 1},
            {"kind": "job", "event": "step_start", "step": 0, "time": start + 2},
            {"kind": "event", "event": "start", "step": 0, "time": start + 5, "process_start": start + 3,
             "restore_start": start + 5, "restored_from": ""}]  # fmt: skip
    rows += [{"kind": "ledger", "step": s, "time": start + 5 + s, "seconds": {},
              "window": {"from_step": s, "since": start + 4 + s}} for s in range(1, steps + 1)]  # fmt: skip
    end = start + 5 + steps
    rows += [{"kind": "event", "event": "finished", "step": steps, "time": end + 0.5},
             {"kind": "job", "event": "step_end", "step": steps, "time": end + 1, "exit_code": 0},
             {"kind": "job", "event": "job_end", "step": steps, "time": end + 1.5}]  # fmt: skip
    return [{**base, **row} for row in rows]


def test_the_slurm_allocations_must_add_up_to_saccts_elapsed_time():
    records = slurm_job("7", 1000.0, 20)
    run = JobRun("7", 0, 1000.0, 1027.0, running=False)
    report = check_ledger(build_ledger(records, [ledger_run(run)]), records, [run])
    assert report.violations == []
    assert "the Slurm allocations match sacct's elapsed time of 1 job run(s) (27.0s)" in report.summary()
    # a requeue Slurm ran that recorded nothing: the ledger lacks its 40 s
    requeue = JobRun("7", 1, 1040.0, 1080.0, running=False)
    report = check_ledger(build_ledger(records, [ledger_run(run)]), records, [run, requeue])
    assert report.violations == [
        "the ledger's Slurm allocations add up to 27.0 s, sacct's elapsed time of the jobs' 2 run(s) to "
        "67.0 s (59.7% apart, more than 1%); sacct's runs the ledger lacks: job 7 run 1 (40.0 s)"
    ]
    assert "Slurm's accounting did not answer" in check_ledger(build_ledger(records), records, None).summary()


def test_a_resized_job_is_one_run_and_overlapping_runs_are_left_to_the_records():
    """sacct's lines of a job that lost a node and went on (RESIZING ends the first piece of the run), then
    was requeued twice, as Slurm's job completion file writes them: every record after the resize starts
    at the resize."""
    from relaytrain.job.allocations import parse_runs

    day = "9|2026-11-27T"
    dbd = f"{day}16:11:05|2026-11-27T16:11:42|RESIZING\n{day}16:11:42|2026-11-27T16:11:48|REQUEUED\n"
    dbd += f"{day}16:12:00|2026-11-27T16:12:32|REQUEUED\n"
    runs = parse_runs("9", dbd, now=0.0)
    assert [(r.restart, r.end - r.start, r.trusted) for r in runs] == [(0, 43.0, True), (1, 32.0, True)]
    filetxt = f"{day}16:11:42|2026-11-27T16:11:42|RESIZING\n{day}16:11:42|2026-11-27T16:11:48|PENDING\n"
    filetxt += f"{day}16:11:42|2026-11-27T16:12:32|PENDING\n{day}16:11:42|2026-11-27T16:13:23|COMPLETED\n"
    runs = parse_runs("9", filetxt, now=0.0)
    assert len(runs) == 3 and not any(r.trusted for r in runs)  # the later runs overlap the first
    # a job that gave back its spare node: one run, its start in the file the resize's (a minute late)
    spares = f"{day}16:11:42|2026-11-27T16:11:42|RESIZING\n{day}16:11:42|2026-11-27T16:12:38|COMPLETED\n"
    assert [r.trusted for r in parse_runs("9", spares, now=0.0)] == [False]
    records = slurm_job("9", 1000.0, 20)
    note = check_ledger(build_ledger(records), records, runs)
    assert note.violations == [] and "job(s) 9 not checked: Slurm's job completion file" in note.summary()


def test_a_running_allocations_tail_past_its_last_record_is_not_unaccounted_yet():
    # the trainer's records alone (the driver's would put a job's tail in a bucket), still training
    records = [r for r in slurm_job("8", 1000.0, 20) if r["kind"] != "job"][:-1]
    running = JobRun("8", 0, 1000.0, 1100.0, running=True)  # sacct: not ended, `end` is now
    assert check_ledger(build_ledger(records, [ledger_run(running)]), records, [running]).violations == []
    ended = running._replace(running=False)
    (line,) = check_ledger(build_ledger(records, [ledger_run(ended)]), records, [ended]).violations
    assert "is unaccounted (no record covers it)" in line and "job 8 at +25.0 s for 75.0 s" in line


def test_a_stop_tail_longer_than_the_sources_agree_on_is_not_confirmed():
    """The trainer's finished event and the driver's job end come 1.5 s before the job's last record
    ends: a tail to Slurm's End within 1 % of the allocation and sacct's second is the batch script's
    exit; a longer one is time no record holds, put in `stop` by rule, and verify names it."""
    records = slurm_job("7", 1000.0, 20)
    run = JobRun("7", 0, 1000.0, 1027.0, running=False)
    assert check_ledger(build_ledger(records, [ledger_run(run)]), records, [run]).violations == []
    late = run._replace(end=1060.0)  # Slurm's End 33.5 s after the job's last record
    (line,) = check_ledger(build_ledger(records, [ledger_run(late)]), records, [late]).violations
    assert line.startswith("33.5s of 1m00s allocated (55.8%) is inferred by rule with no other source to ")
    assert line.endswith(": stop 33.5s (job 7: the last record to Slurm's End: job end)")


def requeued(job: str, start: float, restart: int) -> list[dict]:
    return [{**r, "restart": restart} for r in slurm_job(job, start, 20)]


def test_the_queue_before_a_requeue_is_checked_against_saccts_submit():
    """Job 7 ran 1000-1027, was requeued at its end and ran again 1040-1067 (13 s queued)."""
    records = requeued("7", 1000.0, 0) + requeued("7", 1040.0, 1)
    runs = [JobRun("7", 0, 1000.0, 1027.0, False, submit=990.0), JobRun("7", 1, 1040.0, 1067.0, False)]
    runs[1] = runs[1]._replace(submit=1027.0)
    report = check_ledger(build_ledger(records, map(ledger_run, runs)), records, runs)
    assert report.violations == [] and "queue: 1 requeue(s) checked against Slurm's Submit to Start (0 s" in (
        report.summary()
    )
    # Slurm requeued it 10 s after its End (its nodes completing): in the ledger's queue, said
    late = [runs[0], runs[1]._replace(submit=1037.0)]
    report = check_ledger(build_ledger(records, map(ledger_run, late)), records, late)
    assert report.violations == [] and "(10 s of the queue Slurm's completing before a requeue)" in (
        report.summary()
    )
    # sacct says the second run waited 20 s: the ledger's 13 s of queue miss 7 s Slurm says it waited
    early = [runs[0], runs[1]._replace(submit=1020.0)]
    (line,) = check_ledger(build_ledger(records, map(ledger_run, early)), records, early).violations
    assert line == (
        "queue: the ledger's queue before job 7 (requeue 1) is 13.0 s (the previous run's End to its "
        "Start), shorter than Slurm's Submit to Start of that run, 20.0 s, by more than 1% of its allocation "
        "and sacct's second"
    )
    # no Submit from sacct: said, not checked
    bare = [r._replace(submit=None) for r in runs]
    report = check_ledger(build_ledger(records, map(ledger_run, bare)), records, bare)
    assert "queue: 0 requeue(s) checked against Slurm's Submit to Start, 1 NOT checked: Slurm gave no " in (
        report.summary()
    )


def test_a_crash_record_confirms_a_tail_of_its_own_job_run_only():
    """A requeued run whose step ended (exit 0) without the trainer's stop: 1 s from its last window to
    the step's end is `lost`, 0.5 s from the job's end to Slurm's End `restart`, both by rule. The
    crash line the end-of-step decision wrote then (`restart_count` 1, at the step's end) confirms them;
    one of the job's first run does not."""
    records = [r for r in requeued("7", 1000.0, 1) if r.get("event") != "finished"]
    run = JobRun("7", 1, 1000.0, 1027.0, running=False)
    ledger = build_ledger(records, [ledger_run(run)])
    assert ledger.inferred == {"lost": 1.0, "restart": 0.5}
    crash = {"job_id": "7", "restart_count": 1, "time": 1026.01, "action": "requeue"}
    assert check_ledger(ledger, records, [run], [crash]).violations == []
    (line,) = check_ledger(ledger, records, [run], [{**crash, "restart_count": 0}]).violations
    assert "is inferred by rule with no other source to confirm it" in line and ": lost 1.0s (" in line
    # written 15 s before the failed step's end: not that failure's (the tail to Slurm's End it still
    # confirms: the job's last record came after it)
    (line,) = check_ledger(ledger, records, [run], [{**crash, "time": 1011.0}]).violations
    assert line.endswith(": lost 1.0s (job 7 (requeue 1): a failed step's last record to its end)")


def test_records_older_than_saccts_start_fail():
    """The driver's job_start 1 s after Slurm's Start is the batch script; a Start 4 s after it would put
    recorded time in the queue (the ledger clips it away)."""
    records = slurm_job("7", 1000.0, 20)
    late = JobRun("7", 0, 1005.0, 1027.0, running=False)
    violations = check_ledger(build_ledger(records, [ledger_run(late)]), records, [late]).violations
    assert violations[-1] == (
        "queue: job 7's first record is 4.0 s older than sacct's Start of that run: the ledger counts time "
        "the run's records show running as queue"
    )


def test_saccts_submit_is_read_per_run():
    from relaytrain.job.allocations import parse_runs

    day = "2026-11-27T16:"
    text = f"5|{day}11:05|{day}11:42|REQUEUED|{day}11:00\n5|{day}12:00|{day}12:32|COMPLETED|{day}11:42\n"
    runs = parse_runs("5", text, now=0.0)
    assert [r.start - r.submit for r in runs] == [5.0, 18.0]
    assert parse_runs("5", f"5|{day}11:05|{day}11:42|COMPLETED", now=0.0)[0].submit is None


def test_a_job_that_ended_inside_a_step_is_confirmed_lost_by_slurms_state():
    """The driver died with its node 3 s after the last window: no step_end, no job_end. The tail to
    Slurm's End is `lost`, confirmed by Slurm's State of that run (it ended the run from outside); a run
    Slurm saw complete by itself would have ended its step, so there the tail is not confirmed."""
    records = [r for r in slurm_job("7", 1000.0, 20) if r["kind"] != "job" or r["event"] == "job_start"]
    records = [r for r in records if r.get("event") != "finished"]
    failed = JobRun("7", 0, 1000.0, 1028.0, running=False, state="NODE_FAIL")
    ledger = build_ledger(records, [ledger_run(failed)])
    assert ledger.inferred == {"lost": 3.0}
    assert check_ledger(ledger, records, [failed]).violations == []
    completed = failed._replace(state="COMPLETED")
    (line,) = check_ledger(ledger, records, [completed]).violations
    assert line.endswith(
        "more than 1%: lost 3.0s (job 7: the last record to Slurm's End: the job ended inside a step: its "
        "work since the last record)"
    )


def ledger_run(run: JobRun):
    from relaytrain.monitor.ledger import Allocation

    return Allocation(run.job_id, run.restart, run.start, run.end, "sacct")


def test_a_missing_run_or_damaged_records_are_one_line_and_exit_2(stopped_and_resumed, tmp_path):
    code, out, err = verify(tmp_path / "nothing")
    assert (code, out) == (2, [])
    assert err.strip() == f"relaytrain: error: no run '{tmp_path / 'nothing'}' under runs/ or at that path"
    run = copy(stopped_and_resumed, tmp_path)
    path = run / "samples" / "rank_0.jsonl"
    path.write_text(path.read_text().replace('"count": 8', '"count": "8"', 1))
    code, out, err = verify(run)
    assert (code, out) == (2, [])
    assert err.strip() == (
        "relaytrain: error: the sample record of rank 0 is damaged: 'count' missing or not int"
    )


# -- the lineage rule, on records written directly ------------------------------------------------------
G = 4  # the global batch of the records below


class Attempt:
    """The records a run's attempt writes on `dp` ranks: it starts at `begin` with that step's chain."""

    def __init__(self, run: RunDir, name: str, dp: int, begin: int, chain: str | None = None):
        self.recorders = [SampleRecorder(run, rank, name, rank, dp) for rank in range(dp)]
        self.dp, self.position, self.chain = dp, begin * G, chain or expected_chain(begin)

    def train(self, steps: range, shift: dict[int, int] | None = None) -> None:
        for step in steps:
            share = G // self.dp
            after = chain_next(self.chain, self.position, G)
            for rank, recorder in enumerate(self.recorders):
                first = self.position + rank * share + (shift or {}).get(step, 0)
                recorder.record(step, Consumed(first, share, range_digest(first, share), self.chain, after))
            self.position, self.chain = self.position + G, after


def expected_chain(steps: int) -> str:
    chain = CHAIN_START
    for step in range(steps):
        chain = chain_next(chain, step * G, G)
    return chain


def test_the_lineage_takes_each_replayed_step_from_the_attempt_that_survived(tmp_path):
    run = RunDir(tmp_path)
    Attempt(run, "a", 2, 0).train(range(1, 8), shift={6: 1})  # checkpoints at 4 and 6; step 7 lost
    Attempt(run, "b", 1, 4).train(range(5, 7))  # step 6's checkpoint was damaged: one rank, from step 4
    Attempt(run, "c", 2, 6).train(range(7, 11))  # from b's checkpoint at step 6, to the end
    report = check_samples(run, G)
    assert report.violations == []  # a's wrong step 6 did not survive: b trained step 6 again
    assert (report.steps, report.samples, report.segments, report.replayed) == (10, 40, 3, 3)


def test_a_wrong_step_in_the_surviving_attempt_fails(tmp_path):
    run = RunDir(tmp_path)
    Attempt(run, "a", 2, 0).train(range(1, 8))
    Attempt(run, "b", 1, 4).train(range(5, 9), shift={6: 1})
    assert check_samples(run, G).violations == [
        "step 6, dp rank 0/1: read global samples [21, 25), an uninterrupted run reads [20, 24)",
        "global samples [20, 21) were never consumed (skipped after step 5, dp rank 0/1)",
        "global samples [24, 25) were consumed twice (step 6, dp rank 0/1, then step 7, dp rank 0/1)",
    ]


def test_a_resume_from_a_position_no_step_produced_fails(tmp_path):
    run = RunDir(tmp_path)
    Attempt(run, "a", 1, 0).train(range(1, 5))
    Attempt(run, "b", 1, 4, chain=expected_chain(3)).train(range(5, 7))  # step 3's position, called step 4
    (line,) = check_samples(run, G).violations
    assert line.startswith("attempt b resumed at step 4 from a data position no recorded step produced")


def test_a_rollback_inside_an_attempt_starts_a_new_segment(tmp_path):
    run = RunDir(tmp_path)
    attempt = Attempt(run, "a", 1, 0)
    attempt.train(range(1, 6))  # a NaN at step 5: back to step 2's checkpoint
    attempt.position, attempt.chain = 2 * G, expected_chain(2)
    attempt.train(range(3, 9))
    report = check_samples(run, G)
    assert report.violations == []
    assert (report.steps, report.segments, report.replayed) == (8, 2, 3)


def test_the_lineage_ends_at_the_step_the_run_reached(tmp_path):
    run = RunDir(tmp_path)
    attempt = Attempt(run, "a", 2, 0)
    attempt.train(range(1, 5))
    attempt.recorders = attempt.recorders[:1]  # a crash: rank 1 died before it read step 5
    attempt.train(range(5, 6))
    assert check_samples(run, G, reached=4).violations == []
    assert check_samples(run, G).violations == [
        "step 5, dp rank 1/2: no record",
        "global samples [18, 20) were never consumed (skipped after step 5, dp rank 0/2)",
    ]
    assert check_samples(run, G, reached=7).violations[0] == (
        "the run reached step 7 but its sample records end at step 5"
    )
