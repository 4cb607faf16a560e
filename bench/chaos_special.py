"""The chaos benchmark's targeted trials (bench/chaos.py runs them after the random ones).

* ``kill_save_async`` / ``kill_save_sync``: SIGKILL one rank while a checkpoint is being written (the step
  directory exists, its COMPLETE marker does not). Crash recovery requeues the job; it must resume from
  the previous complete checkpoint (or start fresh before the first one) and lose nothing beyond it.
* ``time_limit_cap``: ``--time=1`` with the pre-timeout signal 30 s ahead, every run slowed so that none
  can finish inside its limit, ``resilience.max_requeues=1``: the first limit requeues the job, the
  second stops at the cap with the reason in the job log; the benchmark then resubmits to the end.
* ``hang``: SIGSTOP one rank mid-step with ``resilience.hang_timeout_s=15``: the other rank's watchdog
  dumps its stacks (``logs/hang_rank0.txt``) and ends the job; crash recovery requeues it and it resumes.
* ``disk_full``: the run dir on a tmpfs with room for one checkpoint, not two: one clear error, the
  previous checkpoint intact, no automatic retry; the benchmark frees space (remount larger) and
  resubmits, and the run finishes bit-exact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from relaytrain.checkpoint import files as L

SPECIAL_KINDS = ("time_limit_cap", "hang", "disk_full")
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

    @property
    def ok(self) -> bool:
        return (
            self.bit_exact
            and self.latest_complete
            and not self.leftovers
            and self.final_status == "finished"
            and all(self.checks.values())
        )


def job_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm").glob("*.out")))


def start_step(run_dir: Path, records) -> int:
    """The step the first resumed run started from (0: started fresh)."""
    events = [r for r in records(run_dir, "event") if r.get("event") in ("start", "resume")]
    return int(events[1]["step"]) if len(events) > 1 else -1


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class SpecialTrials:
    """Runs one targeted trial on a chaos.Bench (its reference, launch, finish and check)."""

    def __init__(self, bench, records, rank_pids, wait):
        self.bench, self.records, self.rank_pids, self.wait = bench, records, rank_pids, wait

    def run(self, trial: SpecialTrial, rng) -> None:
        start = time.monotonic()
        try:
            getattr(self, trial.kind.removesuffix("_async").removesuffix("_sync"))(trial, rng)
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, KeyError) as err:
            trial.error = str(err)[:300]
            subprocess.run(["scancel", trial.job], capture_output=True, timeout=30)
        trial.seconds = round(time.monotonic() - start, 1)

    def kill_save(self, trial: SpecialTrial, rng) -> None:
        from bench.chaos import INTERVAL, STEPS

        mode = trial.kind.removeprefix("kill_save_")
        overrides = (f"--checkpoint.mode={mode}",)
        name = f"special-{trial.index}-{trial.kind}"
        run_dir = self.bench.runs / name
        target = rng.choice([INTERVAL * k for k in range(1, STEPS // INTERVAL)])
        rank = trial.index % 2
        trial.job = self.bench.launch(name, *overrides)
        pids = self.wait(lambda: self.rank_pids(trial.job, rank=rank), 120, f"rank {rank} to start")
        step_dir = run_dir / "checkpoints" / L.step_dir_name(target)
        self.wait(step_dir.exists, 240, f"{step_dir.name} to appear", interval=0.002)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        in_flight = not (step_dir / L.COMPLETE).exists()
        self.bench.finish(trial, run_dir, overrides)
        self.bench.check(trial, run_dir)
        resumed = start_step(run_dir, self.records)
        trial.detail = f"killed rank {rank} in the {mode} save of step {target}; resumed from step {resumed}"
        trial.checks["save in flight when killed"] = in_flight
        expected = {target - INTERVAL} if in_flight else {target - INTERVAL, target}
        trial.checks["resumed from the previous complete checkpoint"] = resumed in expected

    def time_limit_cap(self, trial: SpecialTrial, rng) -> None:
        name = f"special-{trial.index}-time-limit"
        run_dir = self.bench.runs / name
        capped = ("--slurm.time=00:01:00", "--resilience.signal_lead_s=30", "--resilience.hard_deadline_s=20",
                  "--resilience.max_requeues=1")  # fmt: skip
        trial.job = self.bench.launch(name, *capped, setup="export RELAYTRAIN_STEP_DELAY_S=3")
        self.bench.finish(trial, run_dir, (), setup=NO_DELAY)
        self.bench.check(trial, run_dir)
        first = trial.states[0] if trial.states else {}
        log = job_log(run_dir)
        trial.detail = (
            f"first job: {trial.restarts} requeue(s), then {first.get('status')} "
            f"({first.get('reason')}) at step {first.get('step')}"
        )
        trial.checks["time limit requeued once"] = trial.restarts >= 1 and "time_limit" in log
        trial.checks["stopped at max_requeues, reason logged"] = (
            first.get("status") == "stopped" and "reached resilience.max_requeues=1" in log
        )

    def hang(self, trial: SpecialTrial, rng) -> None:
        from bench.chaos import STEPS

        name = f"special-{trial.index}-hang"
        run_dir = self.bench.runs / name
        overrides = ("--resilience.hang_timeout_s=15",)
        trial.job = self.bench.launch(name, *overrides)
        target = rng.randint(5, STEPS - 15)

        def last() -> int:
            return max((r["step"] for r in self.records(run_dir, "train")), default=0)

        self.wait(lambda: last() >= target, 240, f"step {target}")
        for pid in self.rank_pids(trial.job, rank=1):
            os.kill(pid, signal.SIGSTOP)
        self.bench.finish(trial, run_dir, overrides)
        self.bench.check(trial, run_dir)
        stacks = run_dir / "logs" / "hang_rank0.txt"
        crash_log = run_dir / "crashes.jsonl"
        lines = crash_log.read_text().splitlines() if crash_log.exists() else []
        crashes = [json.loads(line) for line in lines if line.strip()]
        trial.detail = f"SIGSTOP rank 1 after step {target}; crashes recorded: {len(crashes)}"
        trial.checks["watchdog dumped stacks"] = stacks.exists() and "Thread" in stacks.read_text()
        trial.checks["requeued by crash recovery"] = trial.restarts >= 1 and trial.resubmits == 0
        trial.checks["cause recorded as hang"] = any("hang" in json.dumps(c) for c in crashes)

    def disk_full(self, trial: SpecialTrial, rng) -> None:
        mount = self.bench.base / "small-fs"
        mount.mkdir(exist_ok=True)
        ref = self.bench.runs / "reference" / "checkpoints"  # retention kept its last checkpoints only
        ckpt = max(tree_bytes(p) for p in ref.glob("step_*"))
        size = tree_bytes(self.bench.runs / ".cache") + int(ckpt * 1.6) + 768 * 1024
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
        try:
            name = f"special-{trial.index}-disk-full"
            run_dir = mount / name
            overrides = (f"--run.dir={mount}",)
            trial.job = self.bench.launch(name, *overrides, setup=NO_DELAY)
            self.wait(
                lambda: (s := _state(run_dir)) and s.get("status") == "failed", 300, "the disk-full failure"
            )
            self.wait(lambda: not self.rank_pids(trial.job), 120, "the ranks to exit")
            time.sleep(5)  # the batch shell's crash check runs after the step
            latest = L.read_latest(run_dir / "checkpoints")
            intact = latest is not None and (latest / L.COMPLETE).is_file()
            errors = [line for line in job_log(run_dir).splitlines() if "checkpoint save of step" in line]
            subprocess.run(["mount", "-o", "remount,size=512m", str(mount)], check=True)  # space freed
            self.bench.finish(trial, run_dir, overrides, setup=NO_DELAY)
            self.bench.check(trial, run_dir)
            trial.detail = (
                f"tmpfs {size / 2**20:.1f} MiB; latest after the failure: {latest.name if latest else None}; "
                f"error lines in the job log: {len(errors)}"
            )
            # torchrun prints its own ChildFailedError traceback for any failed worker; none may come from us
            ours = re.search(r'File "[^"]*/relaytrain/', job_log(run_dir))
            one_line = 0 < len(errors) <= 2 and ours is None
            trial.checks["one clear error (a line a rank, no relaytrain traceback)"] = one_line
            trial.checks["previous checkpoint intact"] = intact
            trial.checks["not retried while the disk is full"] = trial.restarts == 0
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def _state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run_state.json").read_text())
    except (OSError, ValueError):
        return {}
