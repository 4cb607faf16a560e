"""After a job step ended: one decision about what happens to the job, and why.

The batch job's driver (``driver.py``) calls ``after_step`` once after each job step (it runs
outside the step, so it survives the ranks); ``python -m relaytrain.resilience.batch.step_end --exit-code N
...`` is the same call for batch scripts of earlier versions. ``decide`` reads the facts (the
step's exit code, ``run_state.json`` as the step left it, this job's crashes, the step's hang record,
the job log) and says:

* **fail**, nothing touched: the step was refused because another run holds the run directory
  (``run.lock``; its output says so);
* **fail** at once after a crash that repeats the job's previous crash (the same exception and message
  at the same step, or the same error at start-up: ``repeat.py``), its cause named: a deterministic
  fault of the program, data or config is not restarted nor requeued;
* **restart** the job step in place after a crash of relaytrain's trainer (``crash.classify``) or a
  program's exit 76, when ``step_restart.plan_restart`` allows (the script can, fewer than
  ``resilience.max_step_restarts`` restarts in place, with an idle spare node in the place of a lost or
  excluded one, else on the nodes left where the node range allows; a node implicated in failures of this
  job ``resilience.exclude_node_after`` times is excluded, ``bad_nodes.py``); a crash of a step
  the job's hang monitor found hung (``hangs.record``: ``hang/last.json`` of this step) is recorded as
  the hang, with its culprit rank(s) and node(s);
* **restart** in place after a straggler's stop (``replace_node.py``: a spare in its node's place, or
  without it), not counted as a crash;
* else **requeue** (the next allocation excluding the excluded nodes) or **fail** after such a crash:
  requeued from the last complete checkpoint while the job had fewer than
  ``resilience.max_crash_requeues`` crash requeues, else recorded as ``crash_loop`` (or ``crash`` when
  requeueing is off or outside Slurm);
* **requeue** or **fail** after a ``--command`` program exited 75 without recording its stop through
  ``relaytrain.program``: its request to continue (``program_exit``), capped by ``resilience.max_requeues``;
* **requeue** when ``run_state.json`` says ``requeue_pending``: the run asked for a requeue it could not do
  (no ``scontrol`` inside a container, or it failed);
* else **finished** (the step exited 0, or the run's own stop decided and did its requeue) or **fail**
  (the run failed and is not retried: NaN, a damaged checkpoint, a config error, a program's exit code).

``perform`` carries it out: ``crashes.jsonl``, ``run_state.json``, a ``step_restart`` event in
``metrics.jsonl``, the restart file (where to start the step again; only batch scripts written by
earlier versions ask for it: the driver takes the decision's nodes directly), and
``requeue.requeue``, the one function that requeues a job (the run's own stop path calls it too).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from relaytrain.config.schema import ResilienceConfig
from relaytrain.entry_points import STEP_END
from relaytrain.job import JobFacts, RunDir, jsonl
from relaytrain.job.jsonl import append_event
from relaytrain.job.slurmctld import usable_job_nodes
from relaytrain.resilience.batch import spares
from relaytrain.resilience.batch.crash import CrashLog
from relaytrain.resilience.batch.step_decision import (  # noqa: F401  (the decision's names, for callers)
    Action,
    Decision,
    Restartable,
    RunFacts,
    decide,
    step_marker,
)
from relaytrain.resilience.batch.step_restart import StepFacts
from relaytrain.resilience.requeue import requeue
from relaytrain.resilience.run_state import RunState, RunStateFile

log = logging.getLogger(__name__)


def perform(decision: Decision, job: JobFacts, run: RunDir, restart_file: str = "") -> bool:
    """Carry the decision out: the crash record, run_state.json, the restart file, the requeue.
    Returns whether it requeued."""
    if decision.crash is not None:
        CrashLog(run).append({**decision.crash, "time": round(time.time(), 3)})
    for line in decision.say:
        print(f"relaytrain: {line}", flush=True)
    requeued = False
    run_state = RunStateFile(run)
    if decision.record is not None:
        if decision.action is Action.REQUEUE:
            requeued = requeue(job, run_state, decision.record, decision.requeue_why, decision.exclude)
        else:
            run_state.write(decision.record)  # a new record: no requeue asked for
    if decision.program_stop and decision.record is not None:
        _note_program_stop(run, decision.record, decision.action is Action.REQUEUE)
    if decision.restart is not None and decision.record is not None:
        _note_event(run, "step_restart", decision.record.step, _restart_event(decision))
        if restart_file:
            # the batch script reads it: one line, the nodes to start the step on ("" for the same)
            Path(restart_file).write_text(",".join(decision.restart.nodes) + "\n", encoding="utf-8")
    return requeued


def _restart_event(decision: Decision) -> dict[str, Any]:
    assert decision.record is not None and decision.restart is not None and decision.crash is not None
    facts, plan, hang = decision.record.facts, decision.restart, decision.crash.get("hang")
    return {
        "step_restart": facts["step_restart"],
        # why the step restarts: "crash", or a stop that was no crash ("preflight", "straggler")
        "reason": decision.record.reason,
        "exit_code": facts["exit_code"],
        "signal": decision.crash.get("signal", ""),
        "nodes_lost": list(plan.lost),
        "nodes": list(plan.nodes),
        # the nodes left out (a hang's culprit twice), or why they were kept: `left out: n2, named as ...`
        "nodes_left_out": list(plan.left_out),
        **({"nodes_replaced": [list(pair) for pair in plan.replaced]} if plan.replaced else {}),
        **({"nodes_note": plan.exclusion()} if plan.exclusion() else {}),
        **({"hang_culprits": hang["culprits"]} if isinstance(hang, dict) else {}),
    }


def _note_program_stop(run: RunDir, record: RunState, requested: bool) -> None:
    """The `stop` event relaytrain.program writes for a stop it records, so that `relaytrain status` and
    `report` tell this stop like the others."""
    fields = {"saved": record.fact("saved"), "requeue_requested": requested}
    _note_event(
        run, "stop", record.step, {"reason": record.reason, **fields, "exit_code": record.fact("exit_code")}
    )


def _note_event(run: RunDir, event: str, step: int, fields: dict[str, Any]) -> None:
    """One `event` line in metrics.jsonl (`relaytrain.job.jsonl`, as the metrics logger writes it)."""
    try:
        append_event(run, event, step, **fields)
    except OSError as error:
        log.warning("could not record the %s event in %s: %s", event, run.metrics, error)


def end_step(
    run: RunDir,
    exit_code: int,
    resilience: ResilienceConfig,
    *,
    program: bool = False,
    job_log_tail: str = "",
    env: Mapping[str, str] | None = None,
    step: StepFacts | None = None,
    min_nodes: int = 1,
    restart_file: str = "",
) -> Decision:
    """Decide and perform what follows the step that ended with ``exit_code``; returns the decision."""
    job = JobFacts.from_env(env)
    facts = RunFacts.read(run, job, job_log_tail)
    step = replace(step or StepFacts(), started=facts.state is not None and facts.state.written_by(job))
    usable = None
    if exit_code != 0 and step.can_restart and job.in_slurm and (len(step.nodes) > 1 or job.spare_nodes):
        # a node that failed under `--no-kill`: Slurm drops it from the job and shows it down
        usable = usable_job_nodes(job.job_id)
    restartable = Restartable(step, min_nodes, usable, spares.usable(job.spare_nodes, usable))
    decision = decide(exit_code, facts, resilience, job, program=program, restartable=restartable)
    perform(decision, job, run, restart_file)
    return decision


def main(argv: list[str] | None = None, prog: str = f"python -m {STEP_END}") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--exit-code", type=int, required=True, help="the job step's exit code")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--config", default="", help="the run's resolved config (TOML)")
    parser.add_argument("--job-log", default="", help="the job's output file (srun names the dead tasks)")
    parser.add_argument("--program", action="store_true", help="the step ran a --command program")
    parser.add_argument(
        "--restart-file",
        default="",
        help="the batch script can start the step again: on a restart in place the nodes go here",
    )
    parser.add_argument("--step-seconds", type=float, default=None, help="how long the step ran")
    parser.add_argument("--step-nodes", default="", help="the nodes the step ran on, comma-separated")
    args = parser.parse_args(argv)
    step = StepFacts(
        can_restart=bool(args.restart_file),
        seconds=args.step_seconds,
        nodes=tuple(n for n in args.step_nodes.split(",") if n),
    )
    return run(
        RunDir(Path(args.run_dir)),
        args.exit_code,
        args.config,
        program=args.program,
        job_log=args.job_log,
        step=step,
        restart_file=args.restart_file,
    )


def run(run: RunDir, exit_code: int, config: str = "", **facts: Any) -> int:
    """The command line's work: ``after_step`` (``facts``: its keyword arguments), and always exit 0, the
    decision is in the job log and run_state.json."""
    # Its own `scontrol requeue` ends this batch job, and Slurm's SIGTERM reaches this process too (a
    # child of the batch shell), at any moment after that call: the record must still be written and
    # the exit be 0, or the script logs the check as failed.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="relaytrain: %(message)s", stream=sys.stdout)
    after_step(run, exit_code, config, **facts)
    return 0


def after_step(
    run: RunDir,
    exit_code: int,
    config: str = "",
    *,
    program: bool = False,
    job_log: str = "",
    step: StepFacts | None = None,
    restart_file: str = "",
) -> Decision:
    """``end_step`` with the resilience settings of the run's resolved config (the defaults without
    one) and the tail of the job's output file: the command line's call and the batch driver's."""
    min_nodes = 1
    if config:
        from relaytrain.config import load_config

        cfg = load_config(config)
        resilience, min_nodes = cfg.resilience, cfg.slurm.min_nodes or cfg.slurm.nodes
    else:
        resilience = ResilienceConfig()
    tail = jsonl.tail_text(Path(job_log)) if job_log else ""
    return end_step(
        run,
        exit_code,
        resilience,
        program=program,
        job_log_tail=tail,
        step=step,
        min_nodes=min_nodes,
        restart_file=restart_file,
    )


if __name__ == "__main__":
    sys.exit(main())
