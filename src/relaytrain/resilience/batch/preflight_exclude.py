"""The end-of-step decision after preflight's stop (``resilience.preflight = "exclude"``): the checks before
the step's first step named nodes below threshold (relaytrain.preflight), every rank stopped before
training, and rank 0 recorded the nodes in run_state.json (status stopped, reason ``preflight``,
``preflight`` = {nodes, lines, results}). ``step_decision.decide`` asks here first; this module builds its
Decision, through the same paths as a crash's excluded nodes:

* an idle spare takes each named node's place (``slurm.spare_nodes``), or the step restarts on the nodes
  left where the node range allows (``slurm.min_nodes``): a restart in place (``step_restart.plan_restart``,
  capped by ``resilience.max_step_restarts``);
* else the job is requeued (``requeue.requeue``, the one requeue path) with the named nodes in its
  ExcNodeList, so that its next allocation avoids them; such a requeue counts as a crash requeue
  (``resilience.max_crash_requeues``), so that a cluster whose every allocation has a slow node does not
  requeue for ever;
* else (requeueing off, outside Slurm, or the cap reached) the job stops, and the message says how to
  leave the node out by hand.

The named nodes are recorded in ``crashes.jsonl`` as implicated and excluded (``relaytrain status`` lists
them), with the kind ``preflight``.
"""

from __future__ import annotations

from typing import Any

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts
from relaytrain.resilience.batch.bad_nodes import EXCLUDED, IMPLICATED, exclusions
from relaytrain.resilience.batch.crash import RESTARTED
from relaytrain.resilience.batch.decision_facts import Action, Decision, Restartable, RunFacts
from relaytrain.resilience.batch.step_restart import plan_restart
from relaytrain.resilience.run_state import RunState, RunStatus

PREFLIGHT = "preflight"  # run_state.json's reason and the crashes.jsonl line's kind
WHY = "named by preflight"  # why the nodes are left out (the restart plan's sentence)


def preflight_of(state: RunState | None, job: JobFacts) -> dict[str, Any] | None:
    """The nodes preflight named in this job step (run_state.json: status stopped, reason ``preflight``,
    ``preflight`` = {nodes: [...], lines: [...]}), or None."""
    if state is None or not state.written_by(job) or state.status is not RunStatus.STOPPED:
        return None
    verdict = state.fact(PREFLIGHT)
    if state.reason != PREFLIGHT or not isinstance(verdict, dict):
        return None
    nodes = verdict.get("nodes")
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) and n for n in nodes):
        return None
    return verdict


def after_preflight(
    exit_code: int,
    verdict: dict[str, Any],
    run: RunFacts,
    r: ResilienceConfig,
    job: JobFacts,
    restartable: Restartable,
) -> Decision:
    """Leave the named nodes out: a spare in their place or fewer nodes (restart in place), else a requeue
    that excludes them, else the job's end with a clear message."""
    nodes = list(dict.fromkeys(verdict["nodes"]))
    step = run.state.step if run.state else 0
    why = f"preflight named {','.join(nodes)} below threshold"
    bad = exclusions((*run.earlier_implicated, *nodes), r.exclude_node_after)
    plan, not_in_place = plan_restart(
        restartable.step,
        run.earlier_restarts,
        r,
        job,
        min_nodes=restartable.min_nodes,
        usable_nodes=restartable.usable_nodes,
        excluded={*nodes, *bad},
        excluded_why=WHY,
        spares=restartable.spares,
    )
    if plan is not None and not set(nodes) <= set(plan.left_out):
        # a spare or the node range could not take every named node's place
        not_in_place = plan.kept or "the job step's nodes are unknown"
        plan = None
    excluded = {node: f"{WHY} ({_line(verdict, node)})" for node in nodes}
    excluded.update({node: e.why for node, e in bad.items() if node not in excluded})
    facts = {**job.identity(), "saved": False, "exit_code": exit_code, PREFLIGHT: verdict}
    entry = {**job.identity(), "step": step, "kind": PREFLIGHT, "why": why, IMPLICATED: nodes}
    entry[EXCLUDED] = excluded
    if plan is not None:
        number, cap = run.earlier_restarts + 1, r.max_step_restarts
        message = (
            f"{why}: restarting the job step in place {plan.describe()}, before its first step "
            f"(restart in place {number} of resilience.max_step_restarts={cap})"
        )
        record = RunState.of(
            RunStatus.STOPPED,
            PREFLIGHT,
            step,
            message=message[:500],
            **facts,
            step_restart=number,
            max_step_restarts=cap,
        )
        placed = {"nodes_lost": list(plan.lost), **plan.placed()}
        crash = {**entry, "action": RESTARTED, "step_restart": number, **placed}
        return Decision(Action.RESTART, message, (message,), record, crash=crash, restart=plan)
    allowed = r.requeue and job.in_slurm and run.earlier_crashes < r.max_crash_requeues
    if allowed:
        message = f"{why}: no restart in place ({not_in_place}); requeuing with {','.join(nodes)} excluded"
    else:
        cap = f"resilience.max_crash_requeues={r.max_crash_requeues} reached"
        stopped = cap if r.requeue and job.in_slurm else "resilience.requeue is off or not in SLURM"
        message = (
            f"{why}: no restart in place ({not_in_place}) and no requeue ({stopped}); the job stops. "
            f"Leave the node(s) out (sbatch --exclude={','.join(nodes)}) and resubmit, or set "
            "resilience.preflight=report"
        )
    status = RunStatus.STOPPED if allowed else RunStatus.FAILED
    record = RunState.of(status, PREFLIGHT, step, message=message[:500], **facts)
    return Decision(
        Action.REQUEUE if allowed else Action.FAIL,
        message,
        (message,),
        record,
        crash={**entry, "action": "requeue" if allowed else "fail"},
        requeue_why="after preflight's stop",
        exclude=tuple(dict.fromkeys([*nodes, *bad])),
    )


def _line(verdict: dict[str, Any], node: str) -> str:
    """The node's preflight line without its `preflight: NODE ` start, or `below threshold`."""
    for line in verdict.get("lines") or ():
        if isinstance(line, str) and line.startswith(f"preflight: {node} "):
            return line.removeprefix(f"preflight: {node} ")[:200]
    return "below threshold"
