"""The batch job's driver: the generated batch script prepares the environment, then ``exec``s
``python -m relaytrain.resilience.batch.driver ... -- COMMAND``, which runs the job:

* one job step after the other (``srun OPTIONS COMMAND``), each announced in the job log by
  ``step_decision.step_marker``, the line the decision after the step finds the step's output by;
* Slurm's pre-timeout signal passed on to the step that runs (``job_step.SignalForwarder``), and a
  heartbeat line every few minutes;
* while a step of relaytrain's trainer runs, the hang monitor (``monitor.HangMonitor``), which
  reads every node's hang watcher, names a hang's culprit and ends the step;
* after each step the end-of-step decision (``step_end.after_step``): finished, requeued, failed, or
  started again in place, on the nodes it names (the step's ``srun`` then gets ``--overlap``, the narrower
  node set, and a fresh rendezvous port);
* with spare nodes (``slurm.spare_nodes``): the step runs on the training nodes alone (``--nodelist``, the
  job's node variables narrowed to them), the idle spares are named to the decision
  (``spares.publish``), and a spare that takes a node's place takes its position: where that
  order is not Slurm's, the step's tasks are placed by a host file (``--distribution=arbitrary``);
* when that decision itself failed, the requeue the run asked for and could not do (``requeue_pending``);
* at the job's end for good (not requeued), the in-memory snapshots freed on every node of the job;
* `job` records in metrics.jsonl: when the job, each step and the job's own work ended and began (a hang's
  detection on the step it ended), what the time ledger (monitor/ledger.py) splits the allocation by.

It exits with the last step's exit status. It lives in resilience/ (not job/, the bottom layer) because
the decision after the step and the run's record are resilience's and read the run's config. Where the
batch shell's python cannot import it (a container job whose host python lacks relaytrain), the script
runs the step once by itself (docs/containers.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
import traceback
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from relaytrain.entry_points import BATCH_DRIVER, SNAPSHOT
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.env import narrow_to_nodes, place_by_hostfile
from relaytrain.job.facts import STEP_RESTARTS_ENV
from relaytrain.job.jsonl import append_job_record
from relaytrain.job.ports import choose_port, has_no_listener
from relaytrain.job.slurm_command import run_slurm_command
from relaytrain.resilience.batch import spares
from relaytrain.resilience.batch.job_setup import prepare, record_environment
from relaytrain.resilience.batch.job_step import Heartbeat, SignalForwarder, job_log_path, log
from relaytrain.resilience.batch.notify import Alerts
from relaytrain.resilience.batch.step_decision import Action, Decision, step_marker
from relaytrain.resilience.batch.step_end import after_step
from relaytrain.resilience.batch.step_restart import StepFacts
from relaytrain.resilience.hangs.detect import HangPolicy
from relaytrain.resilience.hangs.monitor import HangMonitor
from relaytrain.resilience.hangs.record import HangRecordFile
from relaytrain.resilience.requeue import requeue
from relaytrain.resilience.run_state import RunStateFile

HEARTBEAT_S = 300.0
CLEANUP_TIMEOUT_S = 300.0  # removing the snapshots from the nodes' memory: seconds, unless a node is stuck
_PLACEMENT = ("--nodes=", "--nodelist=", "--ntasks=", "--distribution=")  # what `StepLaunch.place` sets


@dataclass
class StepLaunch:
    """The job step's command line: ``srun`` with its options, then the command each task runs."""

    srun_options: list[str]
    command: list[str]
    nodes: list[str]  # the nodes the step runs on
    tasks_per_node: int  # srun tasks per node (1 for torchrun, which starts the workers itself)
    restarts: int = 0  # how often it was started again in place in this allocation
    extra: list[str] = field(default_factory=list)  # options a restart in place added
    spares: list[str] = field(default_factory=list)  # the job's spare nodes not used yet, in order
    hostfile: Path | None = None  # where a placement out of Slurm's node order is written
    order: list[str] = field(default_factory=list)  # the job's nodes in Slurm's order (the script's)

    @property
    def replaced(self) -> list[str]:
        """The job's nodes a restart left out (a failed or slow node a spare took the place of)."""
        return spares.left_out(self.order, self.nodes, self.spares)

    def argv(self) -> list[str]:
        # After the script's own options: a later srun option wins over an earlier one (--nodes).
        return ["srun", *self.srun_options, *self.extra, *self.command]

    def restart(self, nodes: tuple[str, ...], job_id: str, environ: MutableMapping[str, str]) -> None:
        """Start the step again inside this allocation: on ``nodes`` (empty: the same ones), with a
        fresh rendezvous port."""
        self.restarts += 1
        if self.restarts == 1:
            # Slurm holds a step with a lost node "completing" until it gives the node up: the new step
            # shares those CPUs (the old step's processes are gone).
            self.extra.append("--overlap")
        if nodes and list(nodes) != self.nodes:
            self.spares = spares.still_idle(self.spares, nodes)
            self.place(list(nodes), environ)
        # Hashed, not job id + restarts: that is the next job's own first port, and two jobs sharing a first
        # node then joined each other's rendezvous.
        environ["MASTER_PORT"] = str(choose_port(f"{job_id}+{self.restarts}", has_no_listener))

    def place(self, nodes: list[str], environ: MutableMapping[str, str]) -> None:
        """Run the step on ``nodes``, rank blocks in that order, the first node hosting rank 0."""
        order = self.order or self.nodes + self.spares
        self.nodes = nodes
        narrow_to_nodes(environ, self.nodes)
        count, tasks = len(self.nodes), len(self.nodes) * self.tasks_per_node
        # the placement replaces an earlier restart's (srun would take the last, but the log shows them all)
        self.extra = [option for option in self.extra if not option.startswith(_PLACEMENT)]
        self.extra += [f"--nodes={count}", f"--nodelist={','.join(self.nodes)}", f"--ntasks={tasks}"]
        if spares.out_of_order(nodes, order) and self.hostfile is not None:
            # srun orders tasks by Slurm's node order; a spare in a lower node's position needs a host file
            lines = [node for node in nodes for _ in range(self.tasks_per_node)]
            self.hostfile.write_text("\n".join(lines) + "\n", encoding="utf-8")
            place_by_hostfile(environ, str(self.hostfile))
            self.extra.append("--distribution=arbitrary")
        elif place_by_hostfile(environ, None):
            self.extra.append("--distribution=block")
        environ["MASTER_ADDR"] = self.nodes[0]


class RequeueState(NamedTuple):
    pending: bool  # the run asked for a requeue it could not do (no scontrol in a container, or it failed)
    asked: bool  # the job was requeued, or the run asked for a requeue


def requeue_state(run: RunDir, job: JobFacts | None = None) -> RequeueState:
    """What run_state.json says about a requeue: the driver's one read of the run's record (a missing or
    damaged record: none asked). With ``job``, a requeue that happened after all is not pending."""
    record = RunStateFile(run).read()
    if record is None:
        return RequeueState(False, False)
    pending = record.requeue_pending if job is None else record.pending_for(job)
    return RequeueState(pending, record.requeued or record.requeue_requested)


def requeue_if_pending(run: RunDir, job: JobFacts) -> None:
    """The decision could not run: do the requeue the run asked for and could not do itself (through
    `requeue()`, the one requeue path, which records it and warns when it fails)."""
    run_state = RunStateFile(run)
    record = run_state.read()
    if record is None or not record.pending_for(job):
        return
    print(
        f"relaytrain: the run asked for a requeue it could not do: scontrol requeue {job.requeue_id}",
        flush=True,
    )
    if not requeue(job, run_state, record, "the run's pending requeue"):
        print(f"relaytrain: scontrol requeue {job.requeue_id} failed", file=sys.stderr, flush=True)


def free_snapshots(python: list[str], config: str, nodes: list[str], what: str = "the nodes'") -> None:
    """The job ends for good: free the in-memory snapshots on `nodes` (docs/checkpointing.md); one task
    per node runs the cleanup."""
    count = str(len(nodes))
    argv = [
        "srun",
        "--overlap",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        *python,
        "-m",
        SNAPSHOT,
        "cleanup",
        "--config",
        config,
    ]
    if not run_slurm_command(argv, CLEANUP_TIMEOUT_S, capture=False).ok:
        log(f"could not remove the job's snapshots from {what} memory ({','.join(nodes)})")


@dataclass(frozen=True)
class JobPlan:
    """What the batch script hands the driver."""

    run: RunDir
    config: str
    program: bool  # the step runs a --command program (its exit 75/76 mean requeue/restart)
    free_snapshots: bool  # the run keeps in-memory snapshots on the nodes
    python: list[str]  # how a node runs python with relaytrain (uv run ...)
    heartbeat_s: float = HEARTBEAT_S
    hang_policy: HangPolicy | None = None  # None: no hang monitor (a program, or resilience.hang_timeout_s=0)


def hang_policy(config: str, program: bool) -> HangPolicy | None:
    """The hang monitor's limits from the run's config; None when the step is a program (it publishes no
    progress) or hang detection is off."""
    if program or not config:
        return None
    try:
        from relaytrain.config import load_config

        resilience = load_config(config).resilience
    except Exception as error:  # noqa: BLE001  (the job runs on without a monitor, and says so)
        log(f"no hang monitor: cannot read the run's config {config}: {error}")
        return None
    return HangPolicy.from_config(resilience) if resilience.hang_timeout_s > 0 else None


def decide(plan: JobPlan, exit_code: int, launch: StepLaunch, seconds: float) -> Decision | None:
    """The end-of-step decision; None when it failed (the job log then says so)."""
    step = StepFacts(can_restart=True, seconds=seconds, nodes=tuple(launch.nodes))
    try:
        return after_step(
            plan.run, exit_code, plan.config, program=plan.program, job_log=job_log_path(), step=step
        )
    except Exception:  # noqa: BLE001  (any failure: the job must still end with the step's status)
        traceback.print_exc()
        if plan.program:
            print(
                "relaytrain: the end-of-step decision (relaytrain.resilience.batch.step_end) failed: "
                "no requeue",
                file=sys.stderr,
                flush=True,
            )
        else:
            log("the crash check failed; the job is not requeued")
        return None


def note(run: RunDir, event: str, **fields) -> None:
    """A `job` record for the time ledger; a run directory that cannot take it costs the job nothing."""
    try:
        append_job_record(run, event, **fields)
    except OSError as error:
        log(f"could not record {event} in {run.metrics}: {error}")


def hang_of_step(run: RunDir) -> dict[str, float] | None:
    """When the step that just ended was found hung: the detection time and how long no rank had moved."""
    record = HangRecordFile(run).for_step(JobFacts.from_env())
    return None if record is None else {"detected_at": record.detected_at, "idle_s": record.idle_s}


def drive(plan: JobPlan, launch: StepLaunch, forwarder: SignalForwarder) -> int:
    """Run the job's steps until the decision after one says the job is done here; the last step's
    exit status."""
    environ = os.environ  # each step and the decision after it read the job's variables from here
    alerts = Alerts.start(plan.run, plan.config, log) if plan.config else None  # [notify]: its own threads
    note(plan.run, "job_start", nodes=launch.nodes, spares=launch.spares)
    if launch.spares:
        launch.hostfile = plan.run.slurm / f"hosts-{JobFacts.from_env().job_id or 'local'}"
        launch.place(launch.nodes, environ)  # the training nodes alone; the spares wait
    while True:
        spares.publish(environ, launch.spares)
        job = JobFacts.from_env()
        environ[STEP_RESTARTS_ENV] = str(launch.restarts)
        log(f"{step_marker(job.restart_count, launch.restarts)} on {','.join(launch.nodes)}")
        log(f"launching: {' '.join(launch.argv())}")
        started = time.monotonic()
        HangMonitor.forget_last(plan.run)
        note(plan.run, "step_start", nodes=launch.nodes)
        monitor = None
        if plan.hang_policy is not None:
            monitor = HangMonitor(plan.run, plan.hang_policy, JobFacts.from_env(), forwarder.abort, log)
            monitor.start()
        exit_code = forwarder.run(launch.argv())
        if monitor is not None:
            monitor.stop()  # before the decision: a hang it found is recorded by now
        log(f"job step finished with exit code {exit_code}")
        hang = hang_of_step(plan.run) if monitor is not None else None
        note(plan.run, "step_end", exit_code=exit_code, **({"hang": hang} if hang else {}))
        decision = decide(plan, exit_code, launch, time.monotonic() - started)
        if decision is None:
            requeue_if_pending(plan.run, JobFacts.from_env())
        if decision is None or decision.action is not Action.RESTART or decision.restart is None:
            break
        launch.restart(decision.restart.nodes, job.job_id, environ)
        log(
            f"restarting the job step in place ({launch.restarts}): master "
            f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"
        )
    if plan.free_snapshots and not requeue_state(plan.run).asked:
        free_snapshots(plan.python, plan.config, launch.nodes)
        if launch.replaced:  # alone: a node that failed may be gone, and must not fail the others' cleanup
            free_snapshots(plan.python, plan.config, launch.replaced, "the replaced nodes'")
    if alerts is not None:
        alerts.close(JobFacts.from_env())
    note(plan.run, "job_end", exit_code=exit_code)
    return exit_code


def parse(argv: list[str] | None = None) -> tuple[JobPlan, StepLaunch, SignalForwarder]:
    parser = argparse.ArgumentParser(prog=f"python -m {BATCH_DRIVER}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--config", required=True, help="the run's resolved config (TOML)")
    parser.add_argument("--program", action="store_true", help="the step runs a --command program")
    parser.add_argument("--free-snapshots", action="store_true", help="free the nodes' snapshots at the end")
    parser.add_argument("--python", default="python", help="how a node runs python (shell words)")
    parser.add_argument("--nodes", default="", help="the nodes the step runs on, comma-separated")
    parser.add_argument("--spare-nodes", default="", help="the job's spare nodes, comma-separated")
    parser.add_argument(
        "--training-nodes",
        type=int,
        default=-1,
        help="without --nodes: the job's first N nodes train, the others are spares (0: all)",
    )
    parser.add_argument("--processes-per-node", type=int, default=1, help="the job log's node shape")
    parser.add_argument(
        "--gpu-tool", default="", help="nvidia-smi or rocm-smi: its output goes to the job log"
    )
    parser.add_argument("--pip-freeze", default="", help="keep `pip freeze` here and show the main packages")
    parser.add_argument("--tasks-per-node", type=int, default=1, help="srun tasks per node")
    parser.add_argument("--srun-option", action="append", default=[], help="an option of the step's srun")
    parser.add_argument("--signal", default="", help="Slurm's pre-timeout signal to forward (USR2)")
    parser.add_argument("--pending-signal", default="", help="a signal the batch shell got before this")
    parser.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command each task runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("the command each task runs is missing (after --)")
    run = RunDir(Path(args.run_dir))
    if not args.nodes and args.training_nodes >= 0:
        log(f"run directory: {run.root} (job files in {run.slurm})")
        job_nodes = prepare(os.environ, args.training_nodes, args.processes_per_node)
        args.nodes, args.spare_nodes = ",".join(job_nodes.training), ",".join(job_nodes.spares)
        freeze = Path(args.pip_freeze) if args.pip_freeze else None
        record_environment(os.environ, args.gpu_tool or "nvidia-smi", freeze)
    plan = JobPlan(
        run,
        args.config,
        args.program,
        args.free_snapshots,
        shlex.split(args.python),
        args.heartbeat_s,
        hang_policy(args.config, args.program),
    )
    nodes = [n for n in args.nodes.split(",") if n]
    launch = StepLaunch(list(args.srun_option), command, nodes, args.tasks_per_node)
    launch.spares = [n for n in args.spare_nodes.split(",") if n and n not in nodes]
    launch.order = nodes + launch.spares
    return plan, launch, SignalForwarder(args.signal, args.pending_signal)


def main(argv: list[str] | None = None) -> int:
    plan, launch, forwarder = parse(argv)
    forwarder.install()
    # The decision's own lines (step_end, requeue) go to the job log as the command line's do.
    logging.basicConfig(level=logging.INFO, format="relaytrain: %(message)s", stream=sys.stdout)
    with Heartbeat(plan.heartbeat_s):
        return drive(plan, launch, forwarder)


if __name__ == "__main__":
    sys.exit(main())
