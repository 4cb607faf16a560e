"""The fault matrix's trials on the local Slurm cluster (bench/fault_matrix.py runs them; the judge is
bench/cluster/fault_matrix_judge.py): one 2-node job (1 rank a node) of the tiny config with snapshots on
each, the fault fired from outside the training loop (faults/ or the benchmark's own action), then the job
followed to its end and its records judged.

Each trial keeps what shows that its fault landed: the fault's landed line (with its time) in the job log,
or the time the benchmark acted (a SIGKILL, a node killed, a disk filled, a SIGTERM). The kinds that take
a node down or fill a node's memory (``EXCLUSIVE``) run alone; the others may share the 3 nodes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import faults
from bench.cluster import fault_matrix_judge as judge
from bench.cluster.chaos_run import kill_ranks
from bench.cluster.harness import (
    RunFiles,
    launch,
    node_of,
    rank_pids,
    relaytrain,
    scontrol_job,
    wait,
    wait_job_end,
    write_config,
)

STEPS, EVAL_EVERY, INTERVAL = 30, 10, 10
STEP_DELAY_S = 0.3  # 30 steps last ~10 s: long enough to hit mid-run
FAULT_STEP = 6  # the user faults' step; the machines' faults fire after step FIRE_AFTER
FIRE_AFTER = 8
SNAPSHOTS = "--checkpoint.snapshot_every=1"
EXCLUSIVE = ("node_lost", "slurmd_killed", "disk_full")
BROKEN_MODULE = "relaytrain_user_plugin"
FILL = "relaytrain-fault-fill"
FILL_S = 8  # how long the filler keeps rank 1's snapshot directory full
SMALL_FS, SMALL_FS_SIZE = "relaytrain-fault-snapshots", "8m"  # a snapshot of the tiny model: ~1 MB a rank
JOB_TIMEOUT_S = 600


def landed_from_log(run: RunFiles) -> tuple[str, float | None]:
    """The fault's first landed line in the run's job log and its time ("", None: none); the step delay
    that slows every trial is no fault."""
    found = [(what, at) for what, at in faults.landed_at(run.job_log()) if "step delay" not in what]
    return found[0] if found else ("", None)


def stop_agreed_at(run: RunFiles) -> float | None:
    """When rank 0 logged its first `stop agreed` line (its log's local time), None when it did not."""
    for line in run.rank_log(0).splitlines():
        if "stop agreed by all ranks" in line:
            return datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").timestamp()  # to the second
    return None


class FaultMatrix:
    def __init__(self, base: Path, cluster):
        self.base, self.cluster = base, cluster
        self.runs = base / "runs"
        self.config = write_config(base / "matrix.toml", "matrix", self.runs, STEPS, EVAL_EVERY, INTERVAL)

    def run(self, kind: str) -> judge.MatrixTrial:
        trial = judge.MatrixTrial(kind)
        run = RunFiles(self.runs / kind.replace("_", "-"))
        started = time.monotonic()
        slurm_requeues = 0
        try:
            slurm_requeues = getattr(self, kind)(trial, run)
        except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, KeyError, ValueError) as err:
            trial.error = str(err)[:300]
            if trial.job:
                subprocess.run(["scancel", trial.job], capture_output=True, timeout=30)
        trial.seconds = round(time.monotonic() - started, 1)
        steps = [int(r["step"]) for r in run.records("train")]
        judge.judge(trial, run.crashes(), run.records("event"), steps, run.state(), slurm_requeues)
        return trial

    # -- launching and following a job ----------------------------------------------------------------

    def start(self, trial, run: RunFiles, *overrides: str, setup: str = "", **fault_vars) -> str:
        line = faults.setup_line(step_delay_s=STEP_DELAY_S, **fault_vars)
        trial.job = launch(self.config, run.name, f"{setup}{line}", SNAPSHOTS, *overrides, nodes=2)
        return trial.job

    def end(self, trial) -> int:
        """Wait for the job's end; the requeues Slurm counted."""
        return int(wait_job_end(trial.job, JOB_TIMEOUT_S).get("Restarts", "0") or 0)

    def after_step(self, run: RunFiles, step: int) -> None:
        last = lambda: max((r["step"] for r in run.records("train")), default=0)  # noqa: E731
        wait(lambda: last() >= step, 240, f"step {step} of {run.name}")

    def acted(self, trial, what: str) -> None:
        trial.landed, trial.landed_at = what, time.time()

    # -- faults of the machines -----------------------------------------------------------------------

    def rank_killed(self, trial, run: RunFiles) -> int:
        self.start(trial, run)
        self.after_step(run, FIRE_AFTER)
        at = time.time()
        hit = kill_ranks(trial.job, rank=1)
        trial.landed, trial.landed_at = "; ".join(hit), at
        return self.end(trial)

    def node_lost(self, trial, run: RunFiles) -> int:
        from relaytrain.localcluster import cluster as local_cluster

        self.start(trial, run)
        self.after_step(run, FIRE_AFTER)
        node = self._rank1_node(trial)
        self.acted(trial, f"node {node} killed (slurmd and every process on it)")
        local_cluster.kill_node(node, self.cluster.base_dir)
        try:
            # down until the decision is recorded (a rank's own `failed` record comes before it)
            ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PENDING")
            over = lambda: scontrol_job(trial.job).get("JobState") in ended  # noqa: E731
            wait(lambda: run.crashes() or over(), 300, "the decision after the lost node")
        finally:
            local_cluster.restart_node(node, self.cluster.base_dir)
        return self.end(trial)

    def slurmd_killed(self, trial, run: RunFiles) -> int:
        from relaytrain.localcluster import cluster as local_cluster

        self.start(trial, run)
        self.after_step(run, FIRE_AFTER)
        node = self._rank1_node(trial)
        # the local cluster's pid file of the node's slurmd (relaytrain.localcluster.cluster writes it)
        pid = int((Path(self.cluster.base_dir) / "run" / f"slurmd-{node}.pid").read_text().split()[0])
        self.acted(trial, f"slurmd of {node} (pid {pid}) SIGKILLed")
        os.kill(pid, signal.SIGKILL)
        time.sleep(20)  # past SlurmdTimeout (10 s): Slurm may take the node down meanwhile
        local_cluster.restart_node(node, self.cluster.base_dir)
        return self.end(trial)

    def hang(self, trial, run: RunFiles) -> int:
        self.start(trial, run, "--resilience.hang_timeout_s=15", stall_at_step=FIRE_AFTER)
        requeues = self.end(trial)
        trial.landed, trial.landed_at = landed_from_log(run)
        return requeues

    def disk_full(self, trial, run: RunFiles) -> int:
        """The snapshots go to a small tmpfs of its own in each node's memory (mounted inside the node,
        where its processes see it); rank 1's node's is filled from outside mid-run."""
        small = f"/dev/shm/{SMALL_FS}"
        mount = f"mkdir -p {small} && mount -t tmpfs -o size={SMALL_FS_SIZE} {SMALL_FS} {small}"
        for node in self.cluster.nodes:
            self._on_node(node, mount)
        try:
            self.start(trial, run, f"--checkpoint.snapshot_dir={small}")
            self.after_step(run, FIRE_AFTER - 3)
            node = self._rank1_node(trial)
            self.acted(trial, f"{small} of {node} filled")
            # Each snapshot first deletes the one before last: a single fill would leave room for the next.
            # The filler takes whatever space comes free, for FILL_S seconds (a log writer gone wild).
            filler = (f"end=$(($(date +%s) + {FILL_S})); i=0; while [ $(date +%s) -lt $end ]; do "
                      f"dd if=/dev/zero of={small}/{FILL}.$i bs=64k 2>/dev/null; i=$((i + 1)); sleep 0.02; "
                      f"done; df {small} | tail -1; rm -f {small}/{FILL}.*")  # fmt: skip
            full = self._on_node(node, filler)
            trial.landed += f" for {FILL_S} s ({' '.join(full.split()[-5:])} at its end)"
            requeues = self.end(trial)
        finally:
            for node in self.cluster.nodes:
                self._on_node(node, f"umount -l {small}; rmdir {small}", check=False)
        if "No space left on device" not in run.rank_log(1):
            trial.error = "no snapshot failed with ENOSPC on rank 1: the fault did not reach the run"
        return requeues

    def _on_node(self, node: str, command: str, check: bool = True) -> str:
        from relaytrain.localcluster import cluster as local_cluster

        done = local_cluster.on_node(node, ["sh", "-c", command], self.cluster.base_dir)
        if check and done.returncode != 0:
            raise RuntimeError(f"on {node}: {command} exited {done.returncode}: {done.stderr[-300:]}")
        return done.stdout

    def preemption(self, trial, run: RunFiles) -> int:
        self.start(trial, run)
        self.after_step(run, FIRE_AFTER)
        self.acted(trial, "SIGTERM to the job's steps (relaytrain cancel --signal TERM)")
        relaytrain("cancel", trial.job, "--signal", "TERM")
        return self.end(trial)

    def time_limit(self, trial, run: RunFiles) -> int:
        limited = ("--slurm.time=00:01:00", "--resilience.signal_lead_s=30",
                   "--resilience.hard_deadline_s=20", "--resilience.time_budget_margin_s=0")  # fmt: skip
        slow = faults.setup_line(step_delay_s=3)  # the first run cannot finish in its minute
        setup = f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then {slow}; fi'
        trial.job = launch(self.config, run.name, setup, SNAPSHOTS, *limited, nodes=2)
        requeues = self.end(trial)
        at = stop_agreed_at(run)
        trial.landed, trial.landed_at = "the time limit's signal seen (rank 0's `stop agreed` line)", at
        return requeues

    def _rank1_node(self, trial) -> str:
        pids = wait(lambda: rank_pids(trial.job, rank=1), 60, "rank 1's process")
        node = node_of(pids[0])
        if node == scontrol_job(trial.job).get("BatchHost"):
            raise RuntimeError(f"rank 1 runs on the batch host {node}: its loss would end the job itself")
        return node

    # -- faults of the user ---------------------------------------------------------------------------

    def import_error(self, trial, run: RunFiles) -> int:
        folder = self.base / "broken-pythonpath"
        folder.mkdir(exist_ok=True)
        # a plugin that imports a helper module nobody installed
        (folder / f"{BROKEN_MODULE}.py").write_text("from relaytrain_user_helpers import setup_hooks\n")
        path = f"export PYTHONPATH={folder}${{PYTHONPATH:+:$PYTHONPATH}}; "
        self.start(trial, run, setup=path, import_module=BROKEN_MODULE)
        requeues = self.end(trial)
        trial.landed, trial.landed_at = landed_from_log(run)
        return requeues

    def shape_error(self, trial, run: RunFiles) -> int:
        self.start(trial, run, shape_error_at_step=FAULT_STEP)
        requeues = self.end(trial)
        trial.landed, trial.landed_at = landed_from_log(run)
        return requeues

    def nan(self, trial, run: RunFiles) -> int:
        self.start(trial, run, "--resilience.nan_policy=stop", nan_at_steps=(FAULT_STEP,))
        requeues = self.end(trial)
        trial.landed, trial.landed_at = landed_from_log(run)
        return requeues

    def damaged_checkpoint(self, trial, run: RunFiles) -> int:
        self.start(trial, run, f"--train.stop_at_step={INTERVAL}")
        self.end(trial)
        shard = run.step_dir(INTERVAL) / "__0_0.distcp"
        if not run.committed(run.step_dir(INTERVAL)) or not shard.is_file():
            raise RuntimeError(f"no complete checkpoint of step {INTERVAL} with {shard.name} to damage")
        shard.unlink()
        self.acted(trial, f"{run.step_dir(INTERVAL).name}/{shard.name} deleted; the run submitted again")
        self.start(trial, run)
        return self.end(trial)

    def impossible_config(self, trial, run: RunFiles) -> int:
        self.acted(trial, "submitted with --parallel.tp=4 on 2 ranks")
        try:
            self.start(trial, run, "--parallel.tp=4")
        except RuntimeError as err:  # refused before it was submitted: the stop at the earliest moment
            trial.final_status, trial.message = judge.REFUSED, str(err)[-400:]
            trial.seconds_to_decision = round(time.time() - (trial.landed_at or 0.0), 1)
            return 0
        return self.end(trial)
