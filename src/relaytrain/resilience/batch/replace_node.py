"""The end-of-step decision after a straggler's stop: the trainer named a rank's node too slow to keep
(``resilience.straggler_action``), every rank stopped after a snapshot, and the node is to be replaced by
an idle spare or dropped. ``step_decision.decide`` asks here first; this module builds its Decision."""

from __future__ import annotations

from typing import Any

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts
from relaytrain.resilience.batch.bad_nodes import IMPLICATED, exclusions, recorded
from relaytrain.resilience.batch.crash import RESTARTED, STRAGGLER
from relaytrain.resilience.batch.decision_facts import Action, Decision, Restartable, RunFacts
from relaytrain.resilience.batch.step_restart import plan_restart
from relaytrain.resilience.codes import StopReason
from relaytrain.resilience.run_state import RunState, RunStatus


def straggler_of(state: RunState | None, job: JobFacts) -> dict[str, Any] | None:
    """The trainer's straggler verdict when this step stopped for one (run_state.json: status stopped,
    reason ``straggler``, ``straggler`` = {rank, node, phase, slower, since_step, action}); torchrun
    rewrites the exit code (EXIT_STRAGGLER), so the record decides."""
    if state is None or not state.written_by(job) or state.status is not RunStatus.STOPPED:
        return None
    verdict = state.fact("straggler")
    if state.reason != StopReason.STRAGGLER.label or not isinstance(verdict, dict):
        return None
    node, action = verdict.get("node"), verdict.get("action")
    return verdict if isinstance(node, str) and node and action in ("replace", "drop") else None


def after_straggler(
    exit_code: int,
    verdict: dict[str, Any],
    run: RunFacts,
    r: ResilienceConfig,
    job: JobFacts,
    restartable: Restartable,
) -> Decision:
    """The run stopped after a snapshot to lose a straggler: restart in place with a spare in its node's
    place (``replace``) or without it where the node range allows (``drop``). Not a crash: it counts as a
    restart in place, never as a crash requeue. Without a spare or range the step restarts on the same
    nodes once; a second verdict on the node excludes it (bad_nodes.py), and then the job is requeued
    with the node excluded from its next allocation rather than loop."""
    node, action, step = verdict["node"], verdict["action"], run.state.step if run.state else 0
    slow = f"rank {verdict.get('rank', '?')} on {node} {verdict.get('slower', '?')}x slower"
    why = f"a straggler ({slow} in {verdict.get('phase', '?')})"
    bad = exclusions((*run.earlier_implicated, node), r.exclude_node_after)
    s = restartable.step
    plan, not_in_place = plan_restart(
        s,
        run.earlier_restarts,
        r,
        job,
        min_nodes=restartable.min_nodes if action == "drop" else len(s.nodes),
        usable_nodes=restartable.usable_nodes,
        excluded={node, *bad},
        excluded_why=why,
        spares=restartable.spares if action == "replace" else (),
    )
    if plan is not None and plan.kept and node in bad:
        plan, not_in_place = None, f"{node} is excluded ({bad[node].why}) and no spare or range is left"
    facts = {**job.identity(), "saved": True, "exit_code": exit_code, "straggler": verdict}
    entry = {
        **job.identity(),
        "step": step,
        "kind": STRAGGLER,
        "straggler": verdict,
        "why": why,
        IMPLICATED: [node],
        **recorded(bad),
    }
    if plan is None:
        allowed = r.requeue and job.in_slurm
        message = f"{why}: no restart in place ({not_in_place}); " + (
            "requeuing from the snapshot or checkpoint" if allowed else "not requeued: resubmit the job"
        )
        return Decision(
            Action.REQUEUE if allowed else Action.FAIL,
            message,
            (message,),
            RunState.of(RunStatus.STOPPED, STRAGGLER, step, message=message[:500], **facts),
            crash={**entry, "action": "requeue" if allowed else "fail"},
            requeue_why="after the straggler's stop",
            exclude=tuple(bad),
        )
    number, cap = run.earlier_restarts + 1, r.max_step_restarts
    same = f"; no idle spare to replace {node}: {plan.kept}" if plan.kept else ""
    message = (
        f"{why}: restarting the job step in place {plan.describe()}{same}, from its snapshot "
        f"(restart in place {number} of resilience.max_step_restarts={cap})"
    )
    placed = {"nodes_lost": list(plan.lost), **plan.placed()}
    record = RunState.of(
        RunStatus.STOPPED,
        STRAGGLER,
        step,
        message=message[:500],
        **facts,
        step_restart=number,
        max_step_restarts=cap,
    )
    crash = {**entry, "action": RESTARTED, "step_restart": number, **placed}
    return Decision(Action.RESTART, message, (message,), record, crash=crash, restart=plan)
