"""The chaos benchmark's targeted trials (bench/cluster/chaos.py runs them after the random ones).

* ``kill_save_async`` / ``kill_save_sync``: SIGKILL one rank while a checkpoint is being written (the step
  directory exists, its COMPLETE marker does not). Crash recovery requeues the job; it must resume from
  the previous complete checkpoint (or start fresh before the first one) and lose nothing beyond it.
* ``time_limit_cap``: ``--time=1`` with the pre-timeout signal 30 s ahead, every run slowed so that none
  can finish inside its limit, ``resilience.max_requeues=1``: the first limit requeues the job, the
  second stops at the cap with the reason in the job log; the benchmark then resubmits to the end.
  ``resilience.time_budget_margin_s=0``, so Slurm's signal comes before the trainer's own time budget.
* ``time_limit_cap_budget``: the same with ``time_budget_margin_s=40``: the trainer stops itself on its
  time budget (time left < save estimate + margin) before the signal, the other way a time limit ends a job.
* ``hang``: SIGSTOP one rank mid-step with ``resilience.hang_timeout_s=15``: the other rank's watchdog
  dumps its stacks (``logs/hang_rank0.txt``), or the job's hang monitor, at the same cap, names the
  stopped rank (``logs/hang-step<N>.md``), and the step ends; crash recovery restarts it in place and it
  resumes.
* ``kill_in_place_then_requeue``: ``resilience.max_step_restarts=1``, one rank SIGKILLed at a random
  step, then again at a random step of the restarted step: the first crash restarts the step in place
  (same job, no requeue), the second requeues the job; the run finishes bit-exact.
* ``kill_with_snapshots``: ``checkpoint.snapshot_every=1``, one rank SIGKILLed at a random step between
  two interval checkpoints: the step restarts in place from the in-memory snapshot (not the older
  checkpoint) and replays at most one step, bit-exact.
* ``wipe_node_with_snapshots``, ``wipe_both_copies_with_snapshots``: the same on 2 nodes, with rank 1's node
  memory wiped too (restored from the peer's replica), or rank 1's files gone from both nodes (falls
  back to the checkpoint and says so): bench/cluster/chaos_snapshots.py.
* ``straggler_replace``: rank 1 throttled from outside until the trainer names it and the driver puts
  the spare node in its node's place, in the same job: bench/cluster/chaos_straggler.py.
* ``disk_full``: the run dir on a tmpfs with room for one checkpoint, not two: one clear error, the
  previous checkpoint intact, no automatic retry; the benchmark frees space (remount larger) and
  resubmits, and the run finishes bit-exact.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field

import faults
from bench.cluster.chaos_run import INTERVAL, STEPS, Bench, kill_pids, kill_ranks
from bench.cluster.chaos_snapshots import SnapshotTrials
from bench.cluster.chaos_straggler import StragglerTrials
from bench.cluster.harness import RunFiles, rank_pids, tree_bytes, wait
from bench.cluster.ledger_figures import time_adds_up

SPECIAL_KINDS = (
    "time_limit_cap",
    "time_limit_cap_budget",
    "hang",
    "disk_full",
    "kill_in_place_then_requeue",
    "kill_with_snapshots",
    "wipe_node_with_snapshots",
    "wipe_both_copies_with_snapshots",
    "straggler_replace",
)
# The stop reasons (StopReason labels in run_state.json and metrics.jsonl) a time limit may end a job
# with, and what each means.
TIME_LIMIT_STOPS = {"time_limit_signal": "Slurm's --signal", "time_budget": "the trainer's time budget"}
# kind -> (the stop it should exercise, resilience.time_budget_margin_s that makes that one come first)
TIME_LIMIT_VARIANTS = {
    "time_limit_cap": ("time_limit_signal", 0),
    "time_limit_cap_budget": ("time_budget", 40),
}
NO_DELAY = "true"  # a setup line that changes nothing: the resubmitted run goes at full speed


@dataclass
class SpecialTrial:
    index: int
    kind: str
    job: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    detail: str = ""
    restarts: int = 0
    resubmits: int = 0
    bit_exact: bool = False
    steps_replayed: int = 0
    latest_complete: bool = False
    leftovers: list[str] = field(default_factory=list)
    final_status: str = ""
    states: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""
    seed: str = ""  # the run it came from, set when several runs' results are merged for the page
    hit: list[str] = field(default_factory=list)  # what the trial's fault reached (chaos_run.kill_pids)
    evidence: list[str] = field(default_factory=list)  # what shows that it landed (chaos_run.fault_evidence)
    verify_exit: int | None = None  # as chaos_run.Trial's
    verify: list[str] = field(default_factory=list)
    ledger: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            bool(self.evidence)
            and self.bit_exact
            and self.latest_complete
            and not self.leftovers
            and self.final_status == "finished"
            and all(self.checks.values())
            and time_adds_up(self) is not False
        )


def start_step(run: RunFiles) -> int:
    """The step the first resumed run started from (0: started fresh)."""
    events = [r for r in run.records("event") if r.get("event") in ("start", "resume")]
    return int(events[1]["step"]) if len(events) > 1 else -1


def method_of(kind: str) -> str:
    """The SpecialTrials method that runs a kind (its variants share one)."""
    for family in ("kill_save", "time_limit_cap"):
        if kind.startswith(family):
            return family
    return kind


def first_job_stops(events: list[dict], job: str) -> list[tuple[int, str]]:
    """(step, reason) of each stop of the first job, in order (its requeued runs included)."""
    return [(int(e["step"]), str(e.get("reason"))) for e in events
            if e.get("event") == "stop" and str(e.get("job_id")) == job]  # fmt: skip


def time_limit_checks(
    stops: list[tuple[int, str]], expected: str, restarts: int, first_state: dict, log: str
) -> dict[str, bool]:
    """A time-limit stop is Slurm's signal or the trainer's own time budget; either requeues once."""
    first = stops[0][1] if stops else ""
    return {
        "time limit requeued once": restarts >= 1 and first in TIME_LIMIT_STOPS,
        f"first stop by {TIME_LIMIT_STOPS[expected]}": first == expected,
        "stopped at max_requeues, reason logged": (
            first_state.get("status") == "stopped" and "reached resilience.max_requeues=1" in log
        ),
    }


def describe_stops(stops: list[tuple[int, str]], restarts: int) -> str:
    said = [
        f"{reason} ({TIME_LIMIT_STOPS.get(reason, 'not a time limit')}) at step {step}"
        for step, reason in stops
    ]
    return f"first job, {restarts} requeue(s): stops " + (", then ".join(said) or "none recorded")


class SpecialTrials(SnapshotTrials, StragglerTrials):
    """Runs one targeted trial on a chaos_run.Bench (its reference, launch, finish and check)."""

    def __init__(self, bench: Bench):
        self.bench = bench

    def run(self, trial: SpecialTrial, rng) -> None:
        start = time.monotonic()
        try:
            getattr(self, method_of(trial.kind))(trial, rng)
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, KeyError) as err:
            trial.error = str(err)[:300]
            subprocess.run(["scancel", trial.job], capture_output=True, timeout=30)
        trial.seconds = round(time.monotonic() - start, 1)

    def kill_save(self, trial: SpecialTrial, rng) -> None:
        mode = trial.kind.removeprefix("kill_save_")
        overrides = (f"--checkpoint.mode={mode}",)
        run = self.bench.run_files(f"special-{trial.index}-{trial.kind}")
        target = rng.choice([INTERVAL * k for k in range(1, STEPS // INTERVAL)])
        rank = trial.index % 2
        trial.job = self.bench.launch(run.name, *overrides)
        pids = wait(lambda: rank_pids(trial.job, rank=rank), 120, f"rank {rank} to start")
        step_dir = run.step_dir(target)
        wait(step_dir.exists, 240, f"{step_dir.name} to appear", interval=0.002)
        seen: dict[str, bool] = {}  # whether the save was still in flight the moment the signal went

        def look() -> None:
            seen["in flight"] = not run.committed(step_dir)

        trial.hit += kill_pids(trial.job, pids, rank, then=look)
        in_flight = seen["in flight"]
        self.bench.finish(trial, run, overrides)
        self.bench.check(trial, run)
        resumed = start_step(run)
        trial.detail = f"killed rank {rank} in the {mode} save of step {target}; resumed from step {resumed}"
        trial.checks["save in flight when killed"] = in_flight
        expected = {target - INTERVAL} if in_flight else {target - INTERVAL, target}
        trial.checks["resumed from the previous complete checkpoint"] = resumed in expected

    def time_limit_cap(self, trial: SpecialTrial, rng) -> None:
        expected, margin = TIME_LIMIT_VARIANTS[trial.kind]
        run = self.bench.run_files(f"special-{trial.index}-{trial.kind.replace('_', '-')}")
        capped = ("--slurm.time=00:01:00", "--resilience.signal_lead_s=30", "--resilience.hard_deadline_s=20",
                  "--resilience.max_requeues=1", f"--resilience.time_budget_margin_s={margin}")  # fmt: skip
        trial.job = self.bench.launch(run.name, *capped, setup=faults.setup_line(step_delay_s=3))
        self.bench.finish(trial, run, (), setup=NO_DELAY)
        self.bench.check(trial, run)
        stops = first_job_stops(run.records("event"), trial.job)
        first_state = trial.states[0] if trial.states else {}
        trial.detail = describe_stops(stops, trial.restarts) + f"; then {first_state.get('status')}"
        trial.checks.update(time_limit_checks(stops, expected, trial.restarts, first_state, run.job_log()))

    def hang(self, trial: SpecialTrial, rng) -> None:
        run = self.bench.run_files(f"special-{trial.index}-hang")
        overrides = ("--resilience.hang_timeout_s=15",)
        trial.job = self.bench.launch(run.name, *overrides)
        target = rng.randint(5, STEPS - 15)

        def last() -> int:
            return max((r["step"] for r in run.records("train")), default=0)

        wait(lambda: last() >= target, 240, f"step {target}")
        trial.hit += kill_ranks(trial.job, rank=1, sig=signal.SIGSTOP)
        self.bench.finish(trial, run, overrides)
        self.bench.check(trial, run)
        crashes = run.crashes()
        trial.detail = f"SIGSTOP rank 1 after step {target}; crashes recorded: {len(crashes)}"
        # Whichever acts first at the 15 s cap: rank 0's watchdog (its stacks) or the job's hang monitor
        # (its report, with every rank's stacks)
        reports = [p.read_text(errors="replace") for p in run.dir.logs.glob("hang-step*.md")]
        trial.checks["stacks dumped"] = "Thread" in run.hang_stacks(0) or any("Stacks" in r for r in reports)
        in_place = [c for c in crashes if c.get("action") == "restart"]
        trial.checks["restarted in place by crash recovery"] = bool(in_place) and trial.resubmits == 0
        trial.checks["cause recorded as hang"] = any("hang" in json.dumps(c) for c in crashes)

    def kill_in_place_then_requeue(self, trial: SpecialTrial, rng) -> None:
        run = self.bench.run_files(f"special-{trial.index}-kill-in-place")
        overrides = ("--resilience.max_step_restarts=1",)
        trial.job = self.bench.launch(run.name, *overrides)
        targets = []
        for in_place in (0, 1):

            def last(in_place=in_place) -> int:
                rows = run.records("train")
                return max((r["step"] for r in rows if r.get("step_restart", 0) == in_place
                            and r.get("restart", 0) == 0), default=0)  # fmt: skip

            targets.append(rng.randint(3, 12) + (max(targets) if targets else 0))
            wait(lambda: last() >= targets[-1], 240, f"step {targets[-1]} of step restart {in_place}")
            trial.hit += kill_ranks(trial.job, rank=1)
        self.bench.finish(trial, run, overrides)
        self.bench.check(trial, run)
        actions = [c.get("action") for c in run.crashes()]
        trial.detail = f"SIGKILL rank 1 at steps {targets[0]} and {targets[1]}; crash actions: {actions}"
        trial.checks["first crash restarted in place, second requeued"] = actions == ["restart", "requeue"]
        trial.checks["one requeue, no resubmission"] = trial.restarts == 1 and trial.resubmits == 0

    def kill_with_snapshots(self, trial: SpecialTrial, rng) -> None:
        run = self.bench.run_files(f"special-{trial.index}-kill-with-snapshots")
        overrides = ("--checkpoint.snapshot_every=1",)
        trial.job = self.bench.launch(run.name, *overrides)
        target = rng.choice([s for s in range(4, STEPS - 8) if s % INTERVAL not in (0, 1)])

        def last() -> int:
            return max((r["step"] for r in run.records("train") if not r.get("step_restart")), default=0)

        wait(lambda: last() >= target, 240, f"step {target}")
        killed_at = last()
        trial.hit += kill_ranks(trial.job, rank=1)
        self.bench.finish(trial, run, overrides)
        self.bench.check(trial, run)
        resumes = [r for r in run.records("event") if r.get("event") == "resume"]
        resumed = int(resumes[0]["step"]) if resumes else -1
        trial.detail = f"SIGKILL rank 1 after step {killed_at}; resumed from step {resumed}"
        trial.checks["restarted in place"] = bool(resumes) and resumes[0].get("step_restart") == 1
        # the last interval checkpoint is at least 2 steps behind the kill: only a snapshot resumes here
        trial.checks["at most one step replayed (the snapshot)"] = killed_at - 1 <= resumed <= killed_at + 1

    def disk_full(self, trial: SpecialTrial, rng) -> None:
        mount = self.bench.base / "small-fs"
        mount.mkdir(exist_ok=True)
        ckpt = self.bench.run_files("reference").largest_checkpoint_bytes()  # retention kept its last ones
        size = tree_bytes(self.bench.runs / ".cache") + int(ckpt * 1.6) + 768 * 1024
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
        try:
            run = RunFiles(mount / f"special-{trial.index}-disk-full")
            overrides = (f"--run.dir={mount}",)
            trial.job = self.bench.launch(run.name, *overrides, setup=NO_DELAY)
            wait(lambda: run.state().get("status") == "failed", 300, "the disk-full failure")
            wait(lambda: not rank_pids(trial.job), 120, "the ranks to exit")
            time.sleep(5)  # the batch shell's crash check runs after the step
            latest = run.latest()
            intact = run.latest_complete()
            errors = [line for line in run.job_log().splitlines() if "checkpoint save of step" in line]
            subprocess.run(["mount", "-o", "remount,size=512m", str(mount)], check=True)  # space freed
            self.bench.finish(trial, run, overrides, setup=NO_DELAY)
            self.bench.check(trial, run)
            trial.detail = (
                f"tmpfs {size / 2**20:.1f} MiB; latest after the failure: {latest.name if latest else None}; "
                f"error lines in the job log: {len(errors)}"
            )
            # torchrun prints its own ChildFailedError traceback for any failed worker; none may come from us
            ours = re.search(r'File "[^"]*/relaytrain/', run.job_log())
            one_line = 0 < len(errors) <= 2 and ours is None
            trial.checks["one clear error (a line a rank, no relaytrain traceback)"] = one_line
            trial.checks["previous checkpoint intact"] = intact
            trial.checks["not retried while the disk is full"] = trial.restarts == 0
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)
