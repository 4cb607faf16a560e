"""The chaos benchmark's random trials: the reference run, one interrupted run, and the checks that the
interrupted run, finished, lost no work (bench/cluster/chaos.py draws and runs them)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaytrain.config import load_config

import faults
from bench.cluster.harness import (
    RunFiles,
    launch,
    preempt,
    rank_pids,
    scontrol_job,
    wait,
    wait_job_end,
    write_config,
)
from bench.cluster.ledger_figures import ledger_figures, time_adds_up

STEPS = 40
INTERVAL = 10
EVAL_EVERY = 10
STEP_DELAY_S = 0.3  # first run only: a 40-step tiny run lasts ~15 s, long enough to hit a phase
PHASES = ("mid_step", "mid_eval", "async_save", "startup", "resume_load", "emergency_save")
EVENTS = ("usr2", "preempt", "sigkill_rank", "kill_node")
# Files a finished run may hold: everything else is a leftover. compile/rank_<r>.bin: a rank's compiled
# code, kept on purpose with parallel.compile (RunDir.compile_cache).
ALLOWED = re.compile(
    r"^(config\.toml|run_kind\.json|metrics\.jsonl|run_state\.json|crashes\.jsonl|slurm/.*|logs/.*|"
    r"tensorboard/.*|hang/.*|samples/.*|preflight/.*|compile/rank_\d+\.bin|"
    r"checkpoints/latest|checkpoints/step_\d+/.*)$"
)


@dataclass
class Trial:
    index: int
    phase: str
    event: str
    job: str = ""
    fired_at_step: int = -1
    resubmits: int = 0
    restarts: int = 0
    bit_exact: bool = False
    steps_replayed: int = 0
    latest_complete: bool = False
    leftovers: list[str] = field(default_factory=list)
    final_status: str = ""
    seconds: float = 0.0
    error: str = ""
    hit: list[str] = field(default_factory=list)  # what each fire() reached: the pids it signalled, ...
    evidence: list[str] = field(default_factory=list)  # what shows that the fault landed (fault_evidence)
    verify_exit: int | None = None  # `relaytrain verify RUN`'s (None: results kept before it was run)
    verify: list[str] = field(default_factory=list)  # its output when it did not exit 0
    ledger: dict = field(default_factory=dict)  # the run's time ledger (ledger_figures)

    @property
    def ok(self) -> bool:
        """No work lost, and proof that the fault landed: without it the trial proves nothing."""
        return (
            bool(self.evidence)
            and self.bit_exact
            and self.latest_complete
            and not self.leftovers
            and self.final_status == "finished"
            and time_adds_up(self) is not False
        )


def fault_evidence(trial, run: RunFiles) -> list[str]:
    """What shows that a trial's fault reached the run: its crashes.jsonl lines, the stop and resume
    events it logged, Slurm's requeues, the benchmark's resubmissions, the killed processes gone. An
    uninterrupted run has none of them."""
    found = [h for h in trial.hit if h.endswith(GONE)]
    crashes = [str(c.get("action", "?")) for c in run.crashes()]
    if crashes:
        found.append(f"crashes.jsonl: {len(crashes)} ({', '.join(crashes)})")
    events = run.records("event")
    stops = [str(e.get("reason", "?")) for e in events if e.get("event") == "stop"]
    if stops:
        found.append(f"stop events: {', '.join(stops)}")
    resumes = sum(e.get("event") == "resume" for e in events)
    if resumes:
        found.append(f"resume events: {resumes}")
    if trial.restarts:
        found.append(f"requeued {trial.restarts}x (Slurm's Restarts)")
    if trial.resubmits:
        found.append(f"resubmitted {trial.resubmits}x (not finished when its job ended)")
    return found


GONE = "gone"


def kill_ranks(job: str, rank: int | None, sig: int = signal.SIGKILL) -> list[str]:
    """Signal the job's rank processes (`rank`: one rank's, None: all); see kill_pids."""
    return kill_pids(job, rank_pids(job, rank=rank), rank, sig)


def kill_pids(
    job: str,
    pids: list[int],
    rank: int | None,
    sig: int = signal.SIGKILL,
    then: Callable[[], Any] | None = None,
) -> list[str]:
    """Signal the processes `pids` of `job`, run `then` (what must be seen right after the signals), and
    say what was hit, one line each (`SIGKILL pid 123 (rank 1): gone` once a killed process no longer
    runs). RuntimeError when none was there to signal."""
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        signalled.append(pid)
    if then is not None:
        then()
    if not signalled:
        raise RuntimeError(f"no rank {rank} process of job {job} to signal: the fault did not land")
    hit = []
    for pid in signalled:
        name = f"{signal.Signals(sig).name} pid {pid} (rank {'any' if rank is None else rank})"
        if sig == signal.SIGKILL:
            name += f": {GONE}" if wait_gone(pid) else ": still running 10 s later"
        hit.append(name)
    return hit


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """True once `pid` has exited (a zombie waiting for its parent counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def draw(trials: int, seed: int) -> list[Trial]:
    rng = random.Random(seed)
    out = []
    for i in range(trials):
        phase = rng.choice(PHASES)
        event = rng.choice(("sigkill_rank",) if phase == "resume_load" else EVENTS)
        out.append(Trial(i, phase, event))
    return out


class Bench:
    def __init__(self, base: Path, cluster):
        self.base, self.cluster = base, cluster
        self.runs = base / "runs"
        self.config = write_config(base / "chaos.toml", "reference", self.runs, STEPS, EVAL_EVERY, INTERVAL)
        self.reference: dict[int, float] = {}
        self.reference_val: dict[int, float] = {}

    def run_files(self, name: str) -> RunFiles:
        return RunFiles(self.runs / name)

    def run_reference(self, config: Path | None = None) -> tuple[dict[int, float], dict[int, float]]:
        """The uninterrupted run of `config` (default: the benchmark's own, whose losses `check` compares
        with unless given others): torchrun on this machine, world size 2; its losses and val_losses."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "relaytrain.cli", "train", str(config or self.config)]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the reference run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        cfg = load_config(config or self.config)
        run = RunFiles(Path(cfg.run.dir) / cfg.run.name)
        losses = {r["step"]: r["loss"] for r in run.records("train")}
        vals = {r["step"]: r["val_loss"] for r in run.records("eval") if "val_loss" in r}
        if config is None:
            self.reference, self.reference_val = losses, vals
        return losses, vals

    # -- one trial ---------------------------------------------------------------------------------

    def launch(
        self, name: str, *overrides: str, setup: str | None = None, nodes: int = 1, config: Path | None = None
    ) -> str:
        """Submit the run (2 ranks on 1 node, or 1 on each of 2 `nodes`; of `config`, default the
        benchmark's); `setup` replaces the default (slow steps in the first run only)."""
        delay = faults.setup_line(step_delay_s=STEP_DELAY_S)
        slow = setup or f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then {delay}; fi'
        return launch(config or self.config, name, slow, *overrides, nodes=nodes)

    def wait_phase(self, trial: Trial, run: RunFiles, rng: random.Random) -> None:
        def last() -> int:
            return max((r["step"] for r in run.records("train") if r.get("restart", 0) == 0), default=0)

        def running() -> bool:
            return bool(rank_pids(trial.job))

        if trial.phase == "startup":
            wait(running, 120, "the ranks to start")
            time.sleep(rng.uniform(0.0, 4.0))  # before or after `import torch` (about 3 s here)
        elif trial.phase == "mid_eval":
            target = rng.choice([EVAL_EVERY * k for k in range(1, STEPS // EVAL_EVERY)])
            wait(lambda: last() >= target - 1, 180, f"step {target - 1}")
        elif trial.phase == "async_save":
            target = rng.choice([INTERVAL * k for k in range(1, STEPS // INTERVAL)])
            wait(lambda: last() >= target, 180, f"step {target}")
        else:  # mid_step, emergency_save, resume_load (the first event)
            target = rng.randint(3, STEPS - 8)
            wait(lambda: last() >= target, 180, f"step {target}")
        trial.fired_at_step = last()

    def fire(self, trial: Trial, event: str) -> None:
        """Fire `event` at the trial's job and record in `trial.hit` what it reached; RuntimeError when
        it reached nothing (no rank to kill, scancel or sbatch refused, no node to kill)."""
        if event == "usr2":
            done = subprocess.run(["scancel", "--signal=USR2", trial.job], capture_output=True, text=True,
                                  timeout=30)  # fmt: skip
            if done.returncode != 0:
                failed = f"scancel --signal=USR2 {trial.job} exited {done.returncode}"
                raise RuntimeError(f"{failed}: {done.stderr.strip()}")
            trial.hit.append(f"scancel --signal=USR2 {trial.job}: exit 0")
        elif event == "sigkill_rank":
            trial.hit += kill_ranks(trial.job, rank=1)
        elif event == "preempt":
            node = preempt(trial.job, self.cluster.cpus_per_node, hold_s=2, check=True)
            trial.hit.append(f"high-priority job on {node}")
        elif event == "kill_node":
            from relaytrain.localcluster import cluster as local_cluster

            node = scontrol_job(trial.job).get("BatchHost", "")
            if not node:
                raise RuntimeError(f"job {trial.job} has no node to kill")
            local_cluster.kill_node(node, self.cluster.base_dir)
            trial.hit.append(f"killed node {node}")
            trial.error = f"killed {node}"
            self._dead_node = node
        else:
            raise ValueError(event)

    def run_trial(self, trial: Trial, rng: random.Random) -> None:
        start = time.monotonic()
        run = self.run_files(f"chaos-{trial.index}")
        self._dead_node = ""
        try:
            trial.job = self.launch(run.name)
            self.wait_phase(trial, run, rng)
            self.fire(trial, trial.event)
            if trial.phase == "emergency_save":
                time.sleep(rng.uniform(0.1, 1.0))  # a second signal while the first one's save runs
                self.fire(trial, "usr2" if trial.event != "kill_node" else "kill_node")
            if trial.phase == "resume_load":
                # the crash restarts the step in place (a crashes.jsonl line) or requeues the job
                wait(lambda: run.crashes() or int(scontrol_job(trial.job).get("Restarts", "0")) >= 1
                     or scontrol_job(trial.job).get("JobState") not in ("RUNNING", "PENDING"),
                     120, "a restart in place or a requeue")  # fmt: skip
                if run.crashes() or int(scontrol_job(trial.job).get("Restarts", "0")) >= 1:
                    wait(lambda: rank_pids(trial.job), 120, "the resumed ranks to start")
                    time.sleep(rng.uniform(1.0, 5.0))  # torch import, then the checkpoint load
                    self.fire(trial, "sigkill_rank")
            if self._dead_node:
                from relaytrain.localcluster import cluster as local_cluster

                wait(
                    lambda: int(scontrol_job(trial.job).get("Restarts", "0")) >= 1,
                    120,
                    "node-failure requeue",
                )
                local_cluster.restart_node(self._dead_node, self.cluster.base_dir)
                trial.error = ""
            self.finish(trial, run)
            self.check(trial, run)
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as err:
            trial.error = str(err)[:300]
            subprocess.run(["scancel", trial.job], capture_output=True, timeout=30)
        trial.seconds = round(time.monotonic() - start, 1)

    def finish(
        self,
        trial,
        run: RunFiles,
        overrides: tuple[str, ...] = (),
        setup: str | None = None,
        nodes: int = 1,
        config: Path | None = None,
    ) -> None:
        """Wait for the job; resubmit while the run is not finished (the policy did not requeue)."""
        job = trial.job
        for _ in range(4):
            fields = wait_job_end(job, 420)
            trial.restarts += int(fields.get("Restarts", "0"))
            state = run.state()
            trial.final_status = state.get("status", "")
            if hasattr(trial, "states"):
                trial.states.append({k: state.get(k) for k in ("status", "reason", "step", "message")})
            if trial.final_status == "finished":
                return
            trial.resubmits += 1
            job = self.launch(run.name, *overrides, setup=setup, nodes=nodes, config=config)
        raise RuntimeError(f"run {run.name} did not finish after {trial.resubmits} resubmissions")

    def check(self, trial, run: RunFiles, reference: tuple[dict, dict] | None = None) -> None:
        """The trial's checks against the uninterrupted run (`reference`: another config's losses and
        val_losses, `run_reference`'s; default the benchmark's own)."""
        losses, val_losses = reference or (self.reference, self.reference_val)
        rows = run.records("train")
        steps = [r["step"] for r in rows]
        trial.steps_replayed = len(steps) - len(set(steps))
        vals = {r["step"]: r["val_loss"] for r in run.records("eval") if "val_loss" in r}
        trial.bit_exact = (
            set(steps) == set(losses)
            and all(r["loss"] == losses[r["step"]] for r in rows)
            and all(v == val_losses.get(s) for s, v in vals.items())
            and set(vals) == set(val_losses)
        )
        trial.latest_complete = run.latest_complete()
        trial.leftovers = run.leftovers(ALLOWED)
        trial.evidence = fault_evidence(trial, run)
        code, lines = run.verify()
        trial.verify_exit, trial.verify = code, lines[-12:] if code else []
        trial.ledger = ledger_figures(run.time_ledger())
