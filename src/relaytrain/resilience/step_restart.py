"""Restart in place: after a crash, start the job step again inside the same allocation.

A requeue gives the allocation back and waits in the queue again (on a busy partition, hours); a step
started again by the batch shell keeps the nodes and costs only the start-up and the checkpoint load.
The end-of-step decision (``step_end.py``) asks ``plan_restart`` first when a step crashed; it says
where to start the step again, or why not, and the crash then goes the requeue way as before:

* the batch script must be able to start a step again (relaytrain's scripts say so with
  ``--restart-file``; scripts written by earlier versions cannot);
* at most ``resilience.max_step_restarts`` restarts in place per Slurm job (``crashes.jsonl`` counts
  them apart from the crash requeues, which ``max_crash_requeues`` caps);
* a step that was itself a restart and failed again at start-up (before it wrote ``run_state.json``,
  or within ``RESTART_TOO_SOON_S`` of its launch) is not started again on the same nodes: a failure
  that repeats at start-up points at the nodes or the inputs (a config or data error on one node), and
  a requeue (capped, then ``crash_loop``) may land elsewhere;
* nodes the step ran on that Slurm no longer gives the job (``sbatch --no-kill`` keeps the job when a
  node fails; ``sinfo`` shows it down) are left out: the step restarts on the nodes left when the run's
  node range allows (``slurm.min_nodes``; the elastic path of docs/elastic.md re-plans the layout at
  start), else the job is requeued.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts

# A restarted step that fails again sooner than this after its launch is failing at start-up.
RESTART_TOO_SOON_S = 20.0


@dataclass(frozen=True)
class StepFacts:
    """What the batch shell knows about the job step that ended."""

    can_restart: bool = False  # the script starts the step again when the decision says so
    seconds: float | None = None  # how long the step ran, launch to end
    nodes: tuple[str, ...] = ()  # the nodes it ran on
    started: bool = True  # it got through its start-up (wrote run_state.json)


@dataclass(frozen=True)
class RestartPlan:
    """Where the step starts again, and which of its nodes were lost."""

    nodes: tuple[str, ...]  # () when the same nodes (Slurm could not be asked about them)
    lost: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.lost:
            return "on the same nodes"
        return f"on the {len(self.nodes)} node(s) left ({','.join(self.nodes)}); lost: {','.join(self.lost)}"


def plan_restart(
    step: StepFacts,
    restarts_so_far: int,
    resilience: ResilienceConfig,
    job: JobFacts,
    *,
    min_nodes: int,
    usable_nodes: list[str] | None,
) -> tuple[RestartPlan | None, str]:
    """(where to restart the step, or None; why not). ``restarts_so_far``: this job's restarts in
    place; ``min_nodes``: the fewest nodes the run may continue on (its node range, else all of them);
    ``usable_nodes``: the nodes the job holds that can run a step now (None: Slurm could not say)."""
    cap = resilience.max_step_restarts
    if not step.can_restart or not job.in_slurm:
        return None, "this job's batch script cannot start a step again"
    if cap == 0:
        return None, "restarts in place are off (resilience.max_step_restarts=0)"
    if restarts_so_far >= cap:
        return None, f"resilience.max_step_restarts={cap} reached"
    too_soon = step.seconds is not None and step.seconds < RESTART_TOO_SOON_S
    if job.step_restarts and (too_soon or not step.started):
        when = f"{step.seconds:.0f} s after its launch" if too_soon else "before it wrote run_state.json"
        return None, f"the restarted step failed again at start-up ({when}): not restarted in place again"
    if usable_nodes is None or not step.nodes:
        return RestartPlan(()), ""
    left = tuple(node for node in step.nodes if node in usable_nodes)
    lost = tuple(node for node in step.nodes if node not in usable_nodes)
    if not lost:
        return RestartPlan(()), ""
    if len(left) < max(min_nodes, 1):
        need = f"slurm.min_nodes={min_nodes}" if min_nodes < len(step.nodes) else "every node of the job"
        return None, f"node(s) {','.join(lost)} lost and {len(left)} left, fewer than the run needs ({need})"
    return RestartPlan(left, lost), ""
