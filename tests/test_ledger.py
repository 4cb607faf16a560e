"""The time ledger built from synthetic records (monitor/ledger_spans.py): each way a run spends its time
lands in its bucket, what no record covers stays `unaccounted`, and the buckets always add up to the
allocated time."""

from __future__ import annotations

import random
from typing import Any

import pytest

from relaytrain.monitor.ledger import BUCKETS, Allocation, Ledger
from relaytrain.monitor.ledger_spans import build_ledger

Record = dict[str, Any]
T0 = 1_800_000_000.0  # the tests' times are seconds after T0: records carry unix times


def ident(job_id: str | None = "7", restart: int = 0, step_restart: int = 0) -> Record:
    """A record's job identity, as `job_identity()` writes it."""
    return {"job_id": job_id, "restart": restart, **({"step_restart": step_restart} if step_restart else {})}


def driver(event: str, t: float, who: Record, **fields: Any) -> Record:
    """The batch job's driver: job_start, step_start, step_end, job_end."""
    if "hang" in fields:
        fields["hang"] = {**fields["hang"], "detected_at": T0 + fields["hang"]["detected_at"]}
    return {"kind": "job", "step": 0, "time": T0 + t, **who, "event": event, **fields}


def begin(t: float, step: int, process_start: float, restore_start: float, tier: str, who: Record) -> Record:
    """The trainer's start/resume event with its start-up fields; its own time ends restoring."""
    return {"kind": "event", "event": "resume" if tier else "start", "step": step, "time": T0 + t, **who,
            "process_start": T0 + process_start, "restore_start": T0 + restore_start,
            "restored_from": tier}  # fmt: skip


def window(first: int, last: int, since: float, t: float, who: Record, **seconds: float) -> Record:
    parts = {name: seconds.get(name, 0.0) for name in ("checkpoint", "snapshot", "snapshot_slowdown", "eval")}
    return {"kind": "ledger", "step": last, "time": T0 + t, **who, "goodput": 0.0,
            "window": {"from_step": first, "since": T0 + since}, "seconds": parts}  # fmt: skip


def end(event: str, step: int, t: float, who: Record) -> Record:
    return {"kind": "event", "event": event, "step": step, "time": T0 + t, **who, "reason": event}


def sacct(job_id: str, start: float, stop: float, restart: int = 0) -> Allocation:
    return Allocation(job_id, restart, T0 + start, T0 + stop, "sacct")


def buckets_of(ledger: Ledger) -> dict[str, float]:
    """The buckets with time, after checking the ledger's invariants: spans in order, inside their
    allocation, without overlap, covering it exactly."""
    for job in ledger.jobs:
        at = job.allocation.start
        for span in job.spans:
            assert span.start == pytest.approx(at, abs=1e-9) and span.end > span.start, (job.label, span)
            at = span.end
        assert at == pytest.approx(job.allocation.end, abs=1e-9), job.label
    total = sum(ledger.buckets.values())
    assert total == pytest.approx(ledger.allocated_s, rel=1e-9)
    return {name: round(s, 6) for name, s in ledger.buckets.items() if s > 1e-9}


def test_steps_run_again_after_a_resume_from_an_older_step_are_replayed():
    """Outside Slurm: a process trains steps 1-20 and dies; the next resumes from step 10's checkpoint."""
    local = ident(None)
    first = [
        begin(0.0, 0, -5.0, 0.0, "", local),
        window(1, 10, 0.0, 10.0, local),
        window(11, 20, 10.0, 20.0, local),
    ]
    second = [begin(30.0, 10, 25.0, 28.0, "checkpoint", local), window(11, 20, 30.0, 40.0, local)]
    second += [window(21, 30, 40.0, 50.0, local), end("finished", 30, 51.0, local)]
    ledger = build_ledger(first + second)
    assert buckets_of(ledger) == {
        "productive": 30.0,
        "startup": 8.0,
        "restore": 2.0,
        "replayed": 10.0,
        "stop": 1.0,
    }
    assert [job.label for job in ledger.jobs] == ["process", "process 1"]
    assert ledger.queue_s == pytest.approx(5.0) and ledger.allocated_s == pytest.approx(51.0)
    replayed = [s for s in ledger.jobs[1].spans if s.bucket == "replayed"]
    assert [(s.start - T0, s.end - T0, s.detail) for s in replayed] == [(30.0, 40.0, "steps 11-20")]
    assert ledger.goodput == pytest.approx(30.0 / 51.0)


def test_a_process_that_died_after_its_last_window_loses_the_steps_it_recorded_since():
    """Outside Slurm a killed process's last records can follow its last window (a step's line, a
    snapshot's event): its allocation ends there, and that time is lost work, not unaccounted."""
    local = ident(None)
    killed = [begin(0.0, 0, -1.0, 0.0, "", local), window(1, 1, 0.0, 1.0, local)]
    killed.append({"kind": "train", "step": 2, "time": T0 + 1.3, **local})
    resumed = [begin(4.0, 1, 3.0, 3.5, "snapshot", local), window(2, 8, 4.0, 5.0, local)]
    resumed.append(end("finished", 8, 5.0, local))
    ledger = build_ledger(killed + resumed)
    assert buckets_of(ledger) == {"productive": 2.0, "startup": 1.5, "restore": 0.5, "lost": 0.3}
    still_running = build_ledger(killed)  # the newest process: it may be running, its step in progress
    assert buckets_of(still_running) == {"productive": 1.0, "startup": 1.0, "unaccounted": 0.3}


def _crashed_step(who: Record, **step_end: Any) -> list[Record]:
    """A job's first job step: started at 1, its trainer restored nothing by 3 and ran steps 1-20 until
    23, and the step ended at 30 (exit 1) without a word from the trainer."""
    return [
        driver("job_start", 0.0, who),
        driver("step_start", 1.0, who),
        begin(3.0, 0, 1.5, 3.0, "", who),
        window(1, 10, 3.0, 13.0, who),
        window(11, 20, 13.0, 23.0, who),
        driver("step_end", 30.0, who, exit_code=1, **step_end),
    ]


def test_a_crash_loses_the_time_after_the_last_record():
    job = ident("7")
    records = [*_crashed_step(job), driver("job_end", 31.0, job, exit_code=1)]
    ledger = build_ledger(records, [sacct("7", -2.0, 40.0)])
    # 23..30: steps past the last record (not kept) and the crash's detection; then the job ends to be
    # requeued: restart overhead up to the end Slurm measured.
    assert buckets_of(ledger) == {"productive": 20.0, "startup": 5.0, "lost": 7.0, "restart": 10.0}
    assert ledger.jobs[0].allocation.source == "sacct"


def test_a_hang_splits_its_tail_into_lost_hang_and_restart():
    job = ident("7")
    records = _crashed_step(job, hang={"detected_at": 40.0, "idle_s": 12.0})  # no progress since 28
    records[-1]["time"] = 45.0  # the hung step ended 5 s after its detection
    ledger = build_ledger(records, [sacct("7", 0.0, 45.0)])
    assert buckets_of(ledger) == {
        "productive": 20.0,
        "startup": 3.0,
        "lost": 5.0,
        "hang": 12.0,
        "restart": 5.0,
    }
    hang = [s for s in ledger.jobs[0].spans if s.bucket == "hang"]
    assert [(s.start - T0, s.end - T0) for s in hang] == [(28.0, 40.0)]


def test_a_restart_in_place_is_restart_overhead():
    job, again = ident("7"), ident("7", step_restart=1)
    records = _crashed_step(job)
    records += [driver("step_start", 32.0, again), begin(37.0, 20, 33.0, 35.0, "node memory", again)]
    records += [window(21, 30, 37.0, 47.0, again), end("finished", 30, 48.0, again)]
    records += [driver("step_end", 49.0, again, exit_code=0), driver("job_end", 50.0, again, exit_code=0)]
    ledger = build_ledger(records, [sacct("7", -2.0, 51.0)])
    # restart: 30..32 between the job steps, 32..35 the new step's start-up; stop: 47..51 (the trainer's
    # finish, the step's exit, the driver's end, Slurm's end of the job)
    expected = {"productive": 30.0, "startup": 5.0, "restore": 2.0, "lost": 7.0, "restart": 5.0, "stop": 4.0}
    assert buckets_of(ledger) == expected
    restore = [s for s in ledger.jobs[0].spans if s.bucket == "restore"]
    assert [s.detail for s in restore] == ["node memory"]


def test_a_lost_rank_replaced_inside_the_job_step_is_lost_then_restart_then_replayed():
    """resilience.survivors: the step goes on after a rank is lost; the ranks resume inside it (a second
    `resume`) and log a `recovery` event once the interrupted step is redone."""
    job = ident("7")
    records = [driver("job_start", 0.0, job), driver("step_start", 1.0, job)]
    records += [begin(5.0, 0, 1.0, 4.0, "", job), window(1, 10, 5.0, 15.0, job)]
    # killed at 17 (steps 11-12 not kept); the new group at 19.5, restored from node memory by 20
    records += [begin(20.0, 10, 2.0, 19.5, "node memory", job), window(11, 11, 20.0, 21.0, job)]
    records += [{"kind": "event", "event": "recovery", "step": 11, "time": T0 + 21.0, **job,
                 "fault_to_step_s": 4.0, "lost_step": 11, "generation": 1}]  # fmt: skip
    records += [window(12, 20, 21.0, 30.0, job), end("finished", 20, 31.0, job)]
    records += [driver("step_end", 32.0, job, exit_code=0), driver("job_end", 33.0, job, exit_code=0)]
    ledger = build_ledger(records, [sacct("7", 0.0, 33.0)])
    # lost: 15..17 (the last window to the fault); restart: 17..19.5; restore 19.5..20
    expected = {"startup": 5.0, "productive": 20.0, "lost": 2.0, "restart": 2.5, "restore": 0.5, "stop": 3.0}
    assert buckets_of(ledger) == expected
    # Without its recovery event (the run ended before the redone step) the wait is restart by rule.
    spans = build_ledger(records[:6] + records[7:], [sacct("7", 0.0, 33.0)]).jobs[0].spans
    (rule,) = [s for s in spans if s.bucket == "restart"]
    assert (rule.start - T0, rule.end - T0) == (15.0, 19.5) and rule.inferred, rule


def _trained(who: Record, since: float, until: float, first: int = 1) -> list[Record]:
    """A trainer's whole life in one allocation: start 1 s after `since`, steps `first`..`first` + 9,
    finished at `until`."""
    return [
        begin(since + 1.0, first - 1, since, since + 1.0, "checkpoint" if first > 1 else "", who),
        window(first, first + 9, since + 1.0, until - 1.0, who),
        end("finished", first + 9, until, who),
    ]


def test_time_between_two_allocations_is_queue_time_not_allocated():
    records = _trained(ident("7"), 10.0, 90.0) + _trained(ident("8"), 160.0, 190.0, first=11)
    ledger = build_ledger(records, [sacct("7", 0.0, 100.0), sacct("8", 150.0, 200.0)])
    assert ledger.queue_s == pytest.approx(50.0)
    assert ledger.allocated_s == pytest.approx(150.0)
    assert buckets_of(ledger)["productive"] == pytest.approx(78.0 + 28.0)
    assert "queued between them" in ledger.summary()[0]


def test_sacct_time_after_the_last_record_is_the_jobs_end_or_unaccounted():
    """The job's driver recorded its end: the rest is the stop (the job ended well) or restart overhead (a
    failed step). Without the driver's records nothing says what that time was."""
    job = ident("7")
    well = [driver("job_start", 0.0, job), driver("step_start", 0.0, job), *_trained(job, 0.0, 80.0)]
    well += [driver("step_end", 81.0, job, exit_code=0), driver("job_end", 90.0, job, exit_code=0)]
    ledger = build_ledger(well, [sacct("7", 0.0, 100.0)])
    assert buckets_of(ledger) == {"productive": 78.0, "startup": 1.0, "stop": 21.0}

    failed = [*_crashed_step(job), driver("job_end", 31.0, job, exit_code=1)]
    assert buckets_of(build_ledger(failed, [sacct("7", 0.0, 100.0)]))["restart"] == pytest.approx(70.0)

    trainer_only = [begin(5.0, 0, 2.0, 5.0, "", job), window(1, 10, 5.0, 50.0, job)]  # crashed, no driver
    ledger = build_ledger(trainer_only, [sacct("7", 0.0, 100.0)])
    assert buckets_of(ledger) == {"productive": 45.0, "startup": 5.0, "unaccounted": 50.0}
    assert ledger.goodput == pytest.approx(0.45)


def test_a_window_splits_into_its_parts():
    local = ident(None)
    records = [begin(0.0, 0, 0.0, 0.0, "", local)]
    records += [
        window(1, 10, 0.0, 20.0, local, checkpoint=2.0, snapshot=1.0, snapshot_slowdown=3.0, eval=4.0)
    ]
    assert buckets_of(build_ledger(records)) == {"productive": 10.0, "checkpoint": 2.0, "snapshot": 4.0,
                                                 "eval": 4.0}  # fmt: skip


def _random_records(rng: random.Random) -> tuple[list[Record], list[Allocation]]:
    """Jobs and local processes whose records may disagree with each other and with Slurm: windows that
    overlap or run past the allocation, parts longer than their window, steps out of order."""
    records: list[Record] = []
    measured: list[Allocation] = []
    t = rng.uniform(0, 100)
    for index in range(rng.randint(1, 4)):
        slurm = rng.random() < 0.7
        who = ident(str(100 + index) if slurm else None, restart=rng.randint(0, 1) if slurm else 0)
        job_start = t
        if slurm and rng.random() < 0.7:
            records.append(driver("job_start", t, who))
        for k in range(rng.randint(1, 3) if slurm else 1):
            step_who = {**who, **({"step_restart": k} if k else {})}
            if slurm:
                records.append(driver("step_start", t + rng.uniform(-1, 2), step_who))
            t += rng.uniform(0, 5)
            records.append(begin(t, rng.randint(0, 30), t - rng.uniform(0, 8), t - rng.uniform(0, 3),
                                 rng.choice(["", "checkpoint", "peer"]), step_who))  # fmt: skip
            step = rng.randint(0, 30)
            for _ in range(rng.randint(0, 6)):
                since, t = t - rng.uniform(-2, 2), t + rng.uniform(0, 20)
                first, step = step + 1, step + rng.randint(0, 10)
                parts = {
                    name: rng.choice([0.0, rng.uniform(0, 30)]) for name in ("checkpoint", "snapshot", "eval")
                }
                records.append(window(first, step, since, t, step_who, **parts))
            if rng.random() < 0.5:
                records.append(end(rng.choice(["stop", "finished"]), step, t + rng.uniform(-3, 3), step_who))
            if slurm:
                hang = {"hang": {"detected_at": t + rng.uniform(-5, 10), "idle_s": rng.uniform(0, 40)}}
                hung = hang if rng.random() < 0.3 else {}
                ended = t + rng.uniform(0, 5)
                records.append(driver("step_end", ended, step_who, exit_code=rng.choice([0, 1]), **hung))
        if slurm and rng.random() < 0.6:
            records.append(driver("job_end", t + rng.uniform(0, 3), who))
        if slurm and rng.random() < 0.8:  # Slurm's Start..End: around the records, or cutting them short
            start = job_start - rng.uniform(-5, 10)
            measured.append(sacct(str(who["job_id"]), start, max(start + 1, t + rng.uniform(-20, 30)),
                                  int(who["restart"])))  # fmt: skip
        t += rng.uniform(0, 100)
    return records, measured


@pytest.mark.parametrize("seed", range(300))
def test_the_buckets_always_add_up_to_the_allocated_time(seed):
    records, measured = _random_records(random.Random(seed))
    ledger = build_ledger(records, measured)
    assert set(ledger.buckets) == set(BUCKETS)
    buckets_of(ledger)  # every allocation covered by its spans exactly, so the sum is the allocated time
    assert ledger.queue_s >= 0


def test_a_job_that_ended_inside_a_step_loses_the_steps_since_its_last_record():
    """The driver was killed with its node (or the job cancelled): no step_end, no job_end. The time from
    the last window to Slurm's End is the step's unkept work, not restart overhead; while the job still
    runs, that time stays open (unaccounted), not guessed."""
    job = ident("7")
    records = _crashed_step(job)[:-1]  # no step_end: the step never ended as the driver saw it
    ended = build_ledger(records, [sacct("7", 0.0, 40.0)])
    assert buckets_of(ended) == {"productive": 20.0, "startup": 3.0, "lost": 17.0}
    running = build_ledger(records, [Allocation("7", 0, T0, T0 + 40.0, "sacct", running=True)])
    assert buckets_of(running) == {"productive": 20.0, "startup": 3.0, "unaccounted": 17.0}


def test_a_window_ends_when_it_was_closed_not_when_its_record_was_written():
    """`until` is the window's end; the record's own time comes a little later (the write)."""
    local = ident(None)
    late = window(1, 10, 0.0, 10.5, local)
    late["window"]["until"] = T0 + 10.0
    records = [begin(0.0, 0, 0.0, 0.0, "", local), late, window(11, 20, 10.0, 20.0, local)]
    ledger = build_ledger(records)
    first = [s for s in ledger.jobs[0].spans if s.detail == "steps 1-10"]
    assert [(s.start - T0, s.end - T0) for s in first] == [(0.0, 10.0)]
    assert buckets_of(ledger) == {"productive": 20.0}
