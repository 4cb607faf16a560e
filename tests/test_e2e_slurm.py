"""End to end on a real local Slurm cluster (`relaytrain cluster up`): launch, signals, requeue, resume.

Two waves of jobs, each submitted at once and then polled (``scontrol show job``):

1. a 2-node x 2-task job; a `--time 3` job that gets Slurm's pre-timeout signal; a job whose time
   budget fires first (fake end time); a job stopped with `relaytrain cancel --signal USR2`; a sweep
   (job array) and a chain; plus, outside Slurm, the uninterrupted reference run;
2. once those left the queue (each needs a node to itself): a job preempted by a `high` partition
   job, and a job whose node is killed.

Every interrupted job must finish with exactly the reference run's loss at every logged step.
Timings go to stdout (run with -s) for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from e2e_slurm_jobs import (
    FIRST_RUN_ONLY,
    RESILIENCE_STEPS,
    SLOW_FIRST_RUN,
    assert_losses_match,
    cli,
    complete_checkpoints,
    events,
    job_log,
    job_output,
    last_step,
    launch,
    marker,
    records,
    save_seconds,
    setup_override,
    slurm_time,
    start_reference,
    submitted_id,
    wait_step,
    write_config,
)
from relaytrain.job.env import expand_nodelist
from relaytrain.localcluster import cluster as local_cluster

from slurm_fixtures import job_fields, sbatch, slurm, wait_for, wait_job_finished

pytestmark = pytest.mark.slurm

TIMINGS: dict[str, float] = {}


def timing(name: str, seconds: float) -> None:
    TIMINGS[name] = round(seconds, 2)
    print(f"\ne2e timing: {name} = {seconds:.2f} s")


def finished(job_id: str, timeout: float = 300) -> dict[str, str]:
    return wait_job_finished(int(job_id), timeout=timeout)


def cancel_leftovers(job_ids) -> None:
    """After a failed test its jobs may still be queued; they must not disturb later tests."""
    subprocess.run(["scancel", *job_ids], capture_output=True, timeout=30)


def status_row(table: str, job: str) -> list[str]:
    """The cells of `relaytrain status`'s row for a job (job, name, state, restarts, ...)."""
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│┃").split("│")]
        if cells and cells[0] == job:
            return cells
    raise AssertionError(f"no row for job {job} in:\n{table}")


def resume_timings(label: str, run_dir: Path, fields: dict[str, str], save_log: str) -> None:
    """Emergency save, then stop -> job running again (Slurm) -> first resumed step (relaytrain)."""
    stop = [e for e in events(run_dir) if e["event"] == "stop" and e["restart"] == 0][0]
    timing(f"{label}: emergency save", save_seconds(save_log, stop["step"]))
    first = min(r["time"] for r in records(run_dir, "train") if r["restart"] == 1)
    timing(f"{label}: stop (saved, requeued) to first resumed step", first - stop["time"])
    if fields["Restarts"] == "1":  # StartTime is the last run's
        rerun = slurm_time(fields["StartTime"])
        timing(f"{label}: stop to job running again", rerun - stop["time"])
        timing(f"{label}: job running again to first resumed step", first - rerun)


@pytest.fixture(scope="module")
def e2e(slurm_cluster, tmp_path_factory, request):
    if len(slurm_cluster.nodes) < 2:
        pytest.fail(f"these tests need 2 nodes; the running cluster has {len(slurm_cluster.nodes)}")
    selected = " ".join(
        item.name for item in request.session.items if getattr(item, "module", None) is request.module
    )

    def wanted(*tests: str) -> bool:  # submit only what the selected tests (pytest -k ...) look at
        return any(name in selected for name in tests)

    base = tmp_path_factory.mktemp("e2e_slurm")
    runs = base / "runs"
    res = write_config(base / "res.toml", runs, "res", RESILIENCE_STEPS, resilience=True)
    jobs: dict[str, str] = {}
    two_nodes = ("--nodes", "2", "--tasks-per-node", "1")
    one_node = ("--nodes", "1", "--tasks-per-node", "1")
    # Longest first: the signal arrives 60-90 s after the start whatever else runs.
    if wanted("time_limit_signal", "status_and_logs"):
        jobs["signal"] = launch(str(res), *two_nodes, "--time", "3", "--run.name=signal",
                                setup_override(SLOW_FIRST_RUN))  # fmt: skip
    if wanted("time_budget"):
        fake_end = FIRST_RUN_ONLY.format("export RELAYTRAIN_FAKE_JOB_END_TIME=$(( $(date +%s) + 50 ))")
        jobs["budget"] = launch(
            str(res), *two_nodes, "--run.name=budget", setup_override(SLOW_FIRST_RUN, fake_end)
        )
    submit_2x2 = time.time()
    if wanted("two_nodes_by_two_tasks", "status_and_logs"):
        tiny = write_config(base / "tiny.toml", runs, "tiny", 20)
        done = subprocess.run(["relaytrain", "launch", str(tiny), "--nodes", "2", "--tasks-per-node", "2"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        jobs["2x2"] = submitted_id(done.stdout)
    if wanted("cancel"):
        jobs["cancel"] = launch(str(res), "--nodes", "1", "--tasks-per-node", "2", "--run.name=cancel",
                                setup_override(SLOW_FIRST_RUN))  # fmt: skip
    if wanted("sweep"):
        small = write_config(base / "small.toml", runs, "small", 6)
        code, out = cli("sweep", str(small), "--grid", "optim.lr=1e-3,2e-3", *one_node)
        assert code == 0, out
        jobs["sweep"] = submitted_id(out)
    stage_b_queued: dict[str, str] = {}
    if wanted("chain"):
        stages = [str(write_config(base / f"{name}.toml", runs, name, 6)) for name in ("stage_a", "stage_b")]
        code, out = cli("chain", *stages, *one_node)
        assert code == 0, out
        jobs["stage_a"], jobs["stage_b"] = re.findall(r"submitted job (\d+)", out)
        stage_b_queued = job_fields(int(jobs["stage_b"]))  # Slurm clears Dependency once it is met
    reference = None
    if wanted("identical", "resumes_from", "preemption"):
        reference = start_reference(runs / "reference", res)
    try:
        yield SimpleNamespace(base=base, runs=runs, res=res, jobs=jobs, submit_2x2=submit_2x2,
                              reference=reference, cluster=slurm_cluster,
                              stage_b_queued=stage_b_queued)  # fmt: skip
    finally:
        cancel_leftovers(jobs.values())
        if reference is not None and reference.poll() is None:
            reference.kill()
            reference.communicate()
        if TIMINGS:
            print("\ne2e timings:", json.dumps(TIMINGS, indent=1))


@pytest.fixture(scope="module")
def reference_losses(e2e) -> dict[int, float]:
    assert e2e.reference is not None, "the uninterrupted reference run was not started"
    out, _ = e2e.reference.communicate(timeout=300)
    assert e2e.reference.returncode == 0, out[-3000:]
    losses = {r["step"]: r["loss"] for r in records(e2e.runs / "reference", "train")}
    assert sorted(losses) == list(range(1, RESILIENCE_STEPS + 1))
    return losses


def test_two_nodes_by_two_tasks_trains_to_the_end(e2e):
    job = e2e.jobs["2x2"]
    fields = finished(job)
    run_dir = e2e.runs / "tiny"
    assert fields["JobState"] == "COMPLETED", job_log(run_dir, job)
    timing("2x2 job: submit (relaytrain launch) to COMPLETED seen", time.time() - e2e.submit_2x2)
    slurm_s = slurm_time(fields["EndTime"]) - slurm_time(fields["SubmitTime"])
    timing("2x2 job: Slurm SubmitTime to EndTime", slurm_s)
    log = job_output(run_dir, job)
    starts = re.findall(r"start: rank (\d)/4 local_rank (\d) node (\S+)", log)
    assert sorted(int(rank) for rank, _, _ in starts) == [0, 1, 2, 3], log[-6000:]
    by_node: dict[str, set[str]] = {}
    for _, local, node in starts:
        by_node.setdefault(node, set()).add(local)
    # the job's own 2 nodes (which of its lane's nodes Slurm picks depends on what else runs there)
    allocated = expand_nodelist(fields["NodeList"])
    assert len(allocated) == 2 and set(allocated) <= set(e2e.cluster.nodes), fields["NodeList"]
    assert sorted(by_node) == sorted(allocated) and all(v == {"0", "1"} for v in by_node.values()), starts
    assert "health check passed: world size 4 on 2 node(s)" in log
    assert last_step(run_dir) == 20 and marker(run_dir)["status"] == "finished"
    start = [e for e in events(run_dir) if e["event"] == "start"]
    assert start and start[0]["world_size"] == 4 and start[0]["nodes"] == 2


def test_cancel_with_usr2_stops_cleanly_with_a_checkpoint(e2e):
    """The cancel line of docs/howto/preemption-and-time-limits.md, as the page writes it, JOBID the job's."""
    from test_howto_slurm import howto_line

    job, run_dir = e2e.jobs["cancel"], e2e.runs / "cancel"
    wait_step(run_dir, job, 5)
    line = howto_line("preemption-and-time-limits.md", "relaytrain cancel ")
    words = [job if word == "JOBID" else word for word in shlex.split(line)]
    assert words[:3] == ["relaytrain", "cancel", job], line
    code, out = cli(*words[1:])
    assert code == 0 and f"job {job}" in out, out
    fields = finished(job)
    state = marker(run_dir)
    assert (state["status"], state["reason"], state["saved"]) == ("stopped", "cancelled", True), state
    assert state["requeued"] is False and fields["Restarts"] == "0", job_log(run_dir, job)
    step = state["step"]
    assert 5 <= step < RESILIENCE_STEPS and step in complete_checkpoints(run_dir)
    assert (run_dir / "checkpoints" / f"step_{step}" / "COMPLETE").is_file()
    assert [e["event"] for e in events(run_dir)] == ["start", "stop"]


def test_time_budget_fires_first_then_requeue_and_identical_resume(e2e, reference_losses):
    job, run_dir = e2e.jobs["budget"], e2e.runs / "budget"
    fields = finished(job)
    assert fields["JobState"] == "COMPLETED", job_log(run_dir, job)
    assert int(fields["Restarts"]) >= 1
    stops = [e for e in events(run_dir) if e["event"] == "stop"]
    assert stops[0]["reason"] == "time_budget" and stops[0]["restart"] == 0
    resumes = [e for e in events(run_dir) if e["event"] == "resume"]
    assert resumes[0]["step"] == stops[0]["step"] and resumes[0]["restart"] == 1
    assert "received SIGUSR2" not in job_output(run_dir, job)  # the budget came before any signal
    assert marker(run_dir)["status"] == "finished"
    assert_losses_match(run_dir, reference_losses)
    resume_timings("time-budget stop", run_dir, fields, job_output(run_dir, job))


def test_sweep_is_a_job_array_with_one_run_dir_per_point(e2e):
    job = e2e.jobs["sweep"]
    for index in (0, 1):
        fields = wait_job_finished(f"{job}_{index}", timeout=300)  # type: ignore[arg-type]
        assert fields["JobState"] == "COMPLETED", fields
        assert fields["ArrayJobId"] == job and fields["ArrayTaskId"] == str(index)
    peak_lr = {}
    for index in (0, 1):
        run_dir = e2e.runs / f"small-{index}"
        assert marker(run_dir)["status"] == "finished" and last_step(run_dir) == 6
        peak_lr[index] = max(r["lr"] for r in records(run_dir, "train"))
    assert peak_lr == pytest.approx({0: 1e-3, 1: 2e-3})
    table = (e2e.runs / "small-sweep" / "sweep.tsv").read_text()
    assert "small-0\t--optim.lr=1e-3" in table and "small-1\t--optim.lr=2e-3" in table


def test_chain_runs_stages_in_dependency_order(e2e):
    first, second = e2e.jobs["stage_a"], e2e.jobs["stage_b"]
    a = finished(first)
    b = finished(second)
    assert a["JobState"] == b["JobState"] == "COMPLETED"
    assert slurm_time(b["StartTime"]) >= slurm_time(a["EndTime"])
    assert e2e.stage_b_queued["Dependency"].startswith(f"afterok:{first}"), e2e.stage_b_queued
    recorded = json.loads((e2e.runs / "stage_b" / "slurm" / "jobs.jsonl").read_text().splitlines()[-1])
    assert recorded["job_id"] == second and recorded["after"] == first
    for name in ("stage_a", "stage_b"):
        assert marker(e2e.runs / name)["status"] == "finished"


def test_time_limit_signal_saves_requeues_and_resumes_identically(e2e, reference_losses):
    job, run_dir = e2e.jobs["signal"], e2e.runs / "signal"
    fields = finished(job, timeout=420)
    log = job_output(run_dir, job)
    assert fields["JobState"] == "COMPLETED", log[-6000:]
    assert int(fields["Restarts"]) >= 1 and fields["TimeLimit"] == "00:03:00"
    assert "received SIGUSR2: forwarding it to the job step" in log
    stops = [e for e in events(run_dir) if e["event"] == "stop"]
    assert stops[0]["reason"] == "time_limit_signal" and stops[0]["restart"] == 0
    resumes = [e for e in events(run_dir) if e["event"] == "resume"]
    assert resumes[0]["step"] == stops[0]["step"] and resumes[0]["restart"] == 1
    assert marker(run_dir)["status"] == "finished" and last_step(run_dir) == RESILIENCE_STEPS
    assert_losses_match(run_dir, reference_losses)
    resume_timings("time-limit signal", run_dir, fields, log)


def test_status_and_logs_show_jobs_with_restarts(e2e):
    job = e2e.jobs["signal"]
    fields = finished(job, timeout=420)
    code, out = cli("status", job, "--runs", str(e2e.runs))
    assert code == 0, out
    _, _, state_col, restarts_col = status_row(out, job)[:4]
    # Slurm's count: 1, or 2 on a loaded machine, where the requeued run's start-up outlasts the time
    # until its own signal, which Slurm sends up to 60 s early
    assert (state_col, restarts_col) == ("COMPLETED", fields["Restarts"]) and int(restarts_col) >= 1, out
    code, out = cli("status", "signal", "--runs", str(e2e.runs))
    assert code == 0 and job in out and "COMPLETED" in out, out
    code, out = cli("logs", e2e.jobs["2x2"], "--runs", str(e2e.runs))
    assert code == 0 and out.count("start: rank ") == 4 and "job step finished with exit code 0" in out, out
    code, out = cli("logs", job, "--runs", str(e2e.runs))
    assert code == 0 and "restart count 0" in out and "restart count 1" in out, out


@pytest.fixture(scope="module")
def second_wave(e2e, reference_losses):
    """A job whose node gets killed, and a job preempted on the other node, side by side."""
    first_wave = set(e2e.jobs.values())

    def first_wave_gone() -> bool:
        queued = {line.split("_")[0] for line in slurm("squeue", "-h", "-o", "%i").split()}
        return not (queued & first_wave)

    wait_for(first_wave_gone, 420, "the first jobs to leave the queue", interval=2.0)
    jobs = {}
    one_node = ("--nodes", "1", "--tasks-per-node", "2", setup_override(SLOW_FIRST_RUN))
    jobs["killed"] = launch(str(e2e.res), "--run.name=killed", *one_node)
    doomed = wait_for(lambda: job_fields(int(jobs["killed"])).get("BatchHost"), 60, "the job to start")
    other = next(node for node in e2e.cluster.nodes if node != doomed)
    # The preempted job and the `high` job stay on the other node, where the killed job is requeued to.
    jobs["preempted"] = launch(str(e2e.res), "--run.name=preempted", *one_node,
                               f"--slurm.extra_sbatch=['--nodelist={other}']")  # fmt: skip
    wait_step(e2e.runs / "preempted", jobs["preempted"], 5)
    high = sbatch(f"--partition={e2e.cluster.preempting_partition}", f"--nodelist={other}", "--nodes=1",
                  "--ntasks=1", f"--cpus-per-task={e2e.cluster.cpus_per_node}",
                  f"--output={e2e.base / 'high.out'}", "--wrap=sleep 2")  # fmt: skip
    high_submitted = time.time()
    wait_job_finished(high, timeout=120)  # before the kill: the requeued job must not meet the high job
    wait_step(e2e.runs / "killed", jobs["killed"], 30)
    killed_at = time.time()
    local_cluster.kill_node(doomed, e2e.cluster.base_dir)
    before_kill = last_step(e2e.runs / "killed")
    checkpoints = complete_checkpoints(e2e.runs / "killed")  # nothing on the dead node writes any more
    try:
        yield SimpleNamespace(jobs=jobs, high=high, high_submitted=high_submitted, doomed=doomed, other=other,
                              killed_at=killed_at, last_step_before_kill=before_kill,
                              checkpoints_at_kill=checkpoints)  # fmt: skip
    finally:
        cancel_leftovers([*jobs.values(), str(high)])
        local_cluster.restart_node(doomed, e2e.cluster.base_dir)


def test_killed_node_requeues_and_resumes_from_the_last_checkpoint(e2e, second_wave, reference_losses):
    job, run_dir = second_wave.jobs["killed"], e2e.runs / "killed"
    wait_for(lambda: int(job_fields(int(job)).get("Restarts", "0")) >= 1, 120,
             f"job {job} to be requeued after its node died")  # fmt: skip
    timing("killed node: kill to job requeued", time.time() - second_wave.killed_at)
    code, out = cli("status", "--runs", str(e2e.runs))
    assert code == 0 and job in out, out
    fields = finished(job)
    assert fields["JobState"] == "COMPLETED", job_log(run_dir, job)
    assert int(fields["Restarts"]) == 1 and fields["BatchHost"] == second_wave.other
    timing("killed node: kill to job COMPLETED on the other node", time.time() - second_wave.killed_at)
    resume = [e for e in events(run_dir) if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["restart"] == 1
    # The node died between checkpoints: the run goes back to the last complete one and replays steps.
    assert second_wave.checkpoints_at_kill, "the node was killed before the first checkpoint"
    assert resume[0]["step"] == max(second_wave.checkpoints_at_kill) < second_wave.last_step_before_kill
    assert not [e for e in events(run_dir) if e["event"] == "stop"]
    assert marker(run_dir)["status"] == "finished"
    assert_losses_match(run_dir, reference_losses)


def test_preemption_saves_requeues_and_resumes(e2e, second_wave, reference_losses):
    job, run_dir = second_wave.jobs["preempted"], e2e.runs / "preempted"
    fields = finished(job)
    assert fields["JobState"] == "COMPLETED", job_log(run_dir, job)
    assert int(fields["Restarts"]) == 1
    assert job_fields(second_wave.high)["JobState"] == "COMPLETED"
    stops = [e for e in events(run_dir) if e["event"] == "stop"]
    assert len(stops) == 1 and stops[0]["reason"] == "preemption" and stops[0]["restart"] == 0
    resumes = [e for e in events(run_dir) if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["restart"] == 1 and resumes[0]["step"] == stops[0]["step"]
    assert "SLURM_RESTART_COUNT=1, resuming at step" in job_output(run_dir, job)
    assert marker(run_dir)["status"] == "finished"
    assert_losses_match(run_dir, reference_losses)
    code, out = cli("status", "preempted", "--runs", str(e2e.runs))
    assert code == 0 and job in out, out
    timing("preemption: high job submitted to victim saved", stops[0]["time"] - second_wave.high_submitted)
    resume_timings("preemption", run_dir, fields, job_output(run_dir, job))
