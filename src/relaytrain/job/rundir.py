"""The run directory `<run.dir>/<run.name>/`: the one place that names its files and folders.

Every job of a run, the login-node commands (`status`, `logs`, `report`, `launch`) and other programs
(`relaytrain.program`) meet in this directory, so its layout is a contract: a `RunDir` holds its root
and answers every path in it. Nothing else in relaytrain spells one of these names
(tests/test_rundir.py). What is inside a checkpoint belongs to `relaytrain.checkpoint`; this module
names only the folder that holds them.

It also builds the metrics event record, the line the trainer's metrics logger and
`relaytrain.program` append to `metrics.jsonl`, so both carry the same job identity.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaytrain.job.facts import JobFacts


@dataclass(frozen=True)
class RunDir:
    """One run directory; each property is one of its files or folders (nothing is created)."""

    root: Path

    @classmethod
    def of(cls, run_dir: str | Path, run_name: str) -> RunDir:
        """The run directory of `run.dir` and `run.name`, as a config names it."""
        return cls(Path(run_dir) / run_name)

    @classmethod
    def holding_job_log(cls, job_log: Path) -> RunDir | None:
        """The run directory whose slurm/ folder holds this batch job output, if it is one."""
        run = cls(job_log.parent.parent)
        return run if job_log.parent == run.slurm else None

    def holds_run(self) -> bool:
        """Is this a run directory (one of the files only a run directory holds exists)?"""
        return self.root.is_dir() and any(marker.exists() for marker in self.markers)

    def absolute(self) -> RunDir:
        return RunDir(self.root.absolute())

    @property
    def markers(self) -> tuple[Path, ...]:
        """Files only a run directory holds: train writes the first three, launch writes slurm/."""
        return (self.run_state, self.metrics, self.config, self.slurm)

    # -- the run's own files -----------------------------------------------------------------------
    @property
    def config(self) -> Path:
        """The resolved config the run trained from (written by the trainer's rank 0)."""
        return self.root / "config.toml"

    @property
    def metrics(self) -> Path:
        """One JSON record per logged step, evaluation and event (see `metrics_record`)."""
        return self.root / "metrics.jsonl"

    @property
    def run_state(self) -> Path:
        """How the last job of the run stopped and whether it asked for a requeue."""
        return self.root / "run_state.json"

    @property
    def kind(self) -> Path:
        """Which kind of run the directory holds, the trainer's or a program's (resilience/run_kind.py)."""
        return self.root / "run_kind.json"

    @property
    def crashes(self) -> Path:
        """One line per failed job step: its cause and whether it was requeued."""
        return self.root / "crashes.jsonl"

    @property
    def lock(self) -> Path:
        """The one writer's claim on this directory."""
        return self.root / "run.lock"

    @property
    def lock_takeover(self) -> Path:
        """Held while a writer replaces the claim of a holder that is gone."""
        return self.root / "run.lock.takeover"

    @property
    def wandb_id(self) -> Path:
        """The Weights & Biases run id, so a requeued job resumes the same W&B run."""
        return self.root / "wandb_id"

    # -- folders -------------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        """The default checkpoint folder (`checkpoint.dir` replaces it)."""
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files (metrics.tensorboard)."""
        return self.root / "tensorboard"

    @property
    def profile(self) -> Path:
        """torch.profiler traces and CUDA memory snapshots."""
        return self.root / "profile"

    @property
    def report(self) -> Path:
        """The default output of `relaytrain report`."""
        return self.root / "report"

    @property
    def gpu(self) -> Path:
        """GPU samples, one CSV per node (named by relaytrain.monitor.gpu_monitor)."""
        return self.root / "gpu"

    @property
    def preflights(self) -> Path:
        """`relaytrain preflight`'s results, one JSON file per job (relaytrain.preflight)."""
        return self.root / "preflight"

    def preflight(self, job: str) -> Path:
        """One job's preflight results: every node's figures, the needs, the verdict."""
        return self.preflights / f"{job}.json"

    @property
    def logs(self) -> Path:
        """Per-rank log files and the stacks a hang or the hard deadline dumps."""
        return self.root / "logs"

    def rank_log(self, rank: int) -> Path:
        """One rank's log (metrics.rank_logs); `relaytrain logs RUN` prints rank 0's without Slurm."""
        return self.logs / f"rank_{rank}.log"

    def flight_recorder(self, job_id: str) -> Path:
        """The prefix of a job's Flight Recorder dumps (torch appends the rank) after a collective timeout."""
        return self.logs / f"flight_recorder_job{job_id}_rank"

    def hang_dump(self, rank: int) -> Path:
        """A rank's stacks when its watchdog fired (no finished step for resilience.hang_timeout_s)."""
        return self.logs / f"hang_rank{rank}.txt"

    def deadline_dump(self, rank: int) -> Path:
        """A rank's stacks when the hard deadline after a stop request passed (resilience.hard_deadline_s)."""
        return self.logs / f"deadline_rank{rank}.txt"

    def hang_report(self, step: int) -> Path:
        """The report of a hang the job's hang monitor detected at this step (docs/resilience.md)."""
        return self.logs / f"hang-step{step}.md"

    def stack_dump(self, rank: int) -> Path:
        """Where a rank writes its Python stacks when the node's hang watcher asks (a signal)."""
        return self.logs / f"stacks_rank{rank}.txt"

    # -- what each rank's train loader consumed (relaytrain.data.consumption, `relaytrain verify`) ------
    @property
    def sample_records(self) -> Path:
        """What each rank's train loader consumed, read by `relaytrain verify`."""
        return self.root / "samples"

    def sample_record(self, rank: int) -> Path:
        """One line per step (and per start) of what this rank's train loader consumed."""
        return self.sample_records / f"rank_{rank}.jsonl"

    def record_rank(self, path: Path) -> int:
        """The rank whose sample record `path` is; -1 when it is none."""
        stem = path.name.removeprefix("rank_").removesuffix(".jsonl")
        ok = path.parent == self.sample_records and path.name == f"rank_{stem}.jsonl" and stem.isdigit()
        return int(stem) if ok else -1

    # -- hang detection: the node watchers and the job's hang monitor meet here ------------------------
    @property
    def hang(self) -> Path:
        """Where the node hang watchers and the job's hang monitor meet."""
        return self.root / "hang"

    def hang_node(self, node: str) -> Path:
        """A node watcher's view of its ranks, rewritten every second while the job step runs."""
        return self.hang / "nodes" / f"{node}.json"

    @property
    def hang_request(self) -> Path:
        """The monitor's request to every node watcher: dump the stacks, then end the ranks."""
        return self.hang / "request.json"

    def hang_stacks(self, node: str) -> Path:
        """A node watcher's answer to a request: the stacks and process states of its ranks."""
        return self.hang / "stacks" / f"{node}.md"

    @property
    def hang_record(self) -> Path:
        """The last hang detected (job, step, culprits): the end-of-step decision reads it."""
        return self.hang / "last.json"

    # -- compiled code ---------------------------------------------------------------------------------
    def compile_cache(self, rank: int) -> Path:
        """A rank's compiled code (parallel.compile): what a restarted process loads before it compiles."""
        return self.root / "compile" / f"rank_{rank}.bin"

    # -- the Slurm job files ---------------------------------------------------------------------------
    @property
    def slurm(self) -> Path:
        """The generated scripts, their config, the job logs and the record of submitted jobs."""
        return self.root / "slurm"

    @property
    def slurm_config(self) -> Path:
        """The resolved config the batch job trains from."""
        return self.slurm / "config.toml"

    @property
    def job_script(self) -> Path:
        """The generated sbatch script of the newest launch."""
        return self.slurm / "job.sh"

    @property
    def attach_script(self) -> Path:
        """The script `relaytrain launch --jobid` runs inside an existing allocation."""
        return self.slurm / "attach.sh"

    @property
    def jobs(self) -> Path:
        """One line per submitted job (`relaytrain launch`, `sweep`, `chain`)."""
        return self.slurm / "jobs.jsonl"

    def job_log(self, job: str) -> Path:
        """A batch job's output: `job` is its id, or sbatch's `%j` / `%A_%a` pattern."""
        return self.slurm / f"{job}.out"

    def attach_log(self, job_id: str) -> Path:
        """The output of an attached run (`launch --jobid`), which sbatch does not capture."""
        return self.slurm / f"attach-{job_id}.out"

    def pip_freeze(self, job_id: str) -> Path:
        """The Python packages the job ran with."""
        return self.slurm / f"pip-freeze-{job_id}.txt"

    # -- a sweep's own run directory ------------------------------------------------------------------
    @property
    def sweep_table(self) -> Path:
        """One row per point of a sweep: index, run name, values (and command)."""
        return self.root / "sweep.tsv"

    @property
    def sweep_points(self) -> Path:
        """A sweep's points as JSON, one per array task."""
        return self.root / "sweep.json"

    def relative(self, path: Path) -> str:
        """`path` inside this run directory, as a batch script joins it to a run dir chosen at run time."""
        return str(path.relative_to(self.root))


def job_identity() -> dict[str, Any]:
    """The SLURM job this process belongs to; a requeue keeps the id and bumps the count."""
    job = JobFacts.from_env()
    identity: dict[str, Any] = {"job_id": job.job_id or None, "restart": job.restart_count}
    if job.step_restarts:  # a step started again inside the allocation after a crash
        identity["step_restart"] = job.step_restarts
    return identity


def metrics_record(kind: str, step: int, fields: dict[str, Any]) -> dict[str, Any]:
    """One `metrics.jsonl` line: kind, step, time, the job's identity, then `fields` (JSON-ready)."""
    return {"kind": kind, "step": int(step), "time": time.time(), **job_identity(), **fields}
