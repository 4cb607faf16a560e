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
  a requeue (capped, then ``crash_loop``) may land elsewhere. Except a step the job's hang monitor found
  hung and ended (``hung``: its hang record for this step): that is no crash loop (it waited the
  monitor's limit, and the rank that held it is named and killed), so it restarts in place like a hang
  later in a step; the cap above, the culprit's node left out when named twice (``bad_nodes.py``) and
  the crash requeues' cap still bound a hang that comes back;
* nodes the step ran on that Slurm no longer gives the job (``sbatch --no-kill`` keeps the job when a
  node fails; ``sinfo`` shows it down) are left out: the step restarts on the nodes left when the run's
  node range allows (``slurm.min_nodes``; the elastic path of docs/elastic.md re-plans the layout at
  start), else the job is requeued;
* nodes the decision asks to leave out (``excluded``: a node implicated in failures of this job too
  often, ``bad_nodes.py``, or a straggler) are left out the same way when the node range allows; when it
  does not, the plan keeps them and says why (the caller decides whether that is good enough);
* with spare nodes (``slurm.spare_nodes``: the idle, usable ones in ``spares``), a lost or left-out node's
  place goes to a spare first, in the node's position: the same node count, world size and layout (no
  resize); only the nodes no spare is left for take the node-range way above.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts
from relaytrain.resilience.batch.spares import swap_in

# A restarted step that fails again sooner than this after its launch is failing at start-up.
RESTART_TOO_SOON_S = 20.0


@dataclass(frozen=True)
class StepFacts:
    """What the batch shell knows about the job step that ended."""

    can_restart: bool = False  # the script starts the step again when the decision says so
    seconds: float | None = None  # how long the step ran, launch to end
    nodes: tuple[str, ...] = ()  # the nodes it ran on
    started: bool = True  # it got through its start-up (wrote run_state.json)
    hung: bool = False  # the job's hang monitor found it hung and ended it (its hang record for this step)


@dataclass(frozen=True)
class RestartPlan:
    """Where the step starts again, which of its nodes were lost, and which were left out (or kept)."""

    nodes: tuple[str, ...]  # () when the same nodes (Slurm could not be asked about them)
    lost: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()  # usable nodes the decision asked to leave out, left out
    left_out_why: str = ""  # why they were asked to be left out ("named as a hang's culprit twice")
    kept: str = ""  # the nodes asked to be left out but kept, and why (the node range does not allow it)
    replaced: tuple[tuple[str, str], ...] = ()  # (node, the spare in its place), in the step's order

    def exclusion(self) -> str:
        """`left out: n2, named as ...` or the kept sentence; "" when no node was asked to be left out."""
        if self.left_out:
            why = f", {self.left_out_why}" if self.left_out_why else ""
            return f"left out: {','.join(self.left_out)}{why}"
        return self.kept

    def placed(self) -> dict:
        """The plan's nodes for a crash entry: those left out and why, those kept, the spares' swaps."""
        return {
            "nodes_left_out": list(self.left_out),
            **({"nodes_left_out_why": self.left_out_why} if self.left_out else {}),
            **({"nodes_kept": self.kept} if self.kept else {}),
            **({"nodes_replaced": [list(pair) for pair in self.replaced]} if self.replaced else {}),
        }

    def describe(self) -> str:
        where = f"on the {len(self.nodes)} node(s) left ({','.join(self.nodes)})" if self.nodes else ""
        if self.replaced:
            swaps = ", ".join(f"spare {spare} in place of {node}" for node, spare in self.replaced)
            where = f"on {len(self.nodes)} node(s) ({','.join(self.nodes)}): {swaps}"
        parts = [where or "on the same nodes"]
        if self.lost:
            parts.append(f"lost: {','.join(self.lost)}")
        if self.exclusion():
            parts.append(self.exclusion())
        return "; ".join(parts)


def plan_restart(
    step: StepFacts,
    restarts_so_far: int,
    resilience: ResilienceConfig,
    job: JobFacts,
    *,
    min_nodes: int,
    usable_nodes: list[str] | None,
    excluded: Collection[str] = (),
    excluded_why: str = "",
    spares: Sequence[str] = (),
) -> tuple[RestartPlan | None, str]:
    """(where to restart the step, or None; why not). ``restarts_so_far``: this job's restarts in
    place; ``min_nodes``: the fewest nodes the run may continue on (its node range, else all of them);
    ``usable_nodes``: the nodes the job holds that can run a step now (None: Slurm could not say);
    ``excluded``: nodes to leave out, for ``excluded_why``; ``spares``: idle usable spare nodes, in the
    order they are to be used."""
    cap = resilience.max_step_restarts
    if not step.can_restart or not job.in_slurm:
        return None, "this job's batch script cannot start a step again"
    if cap == 0:
        return None, "restarts in place are off (resilience.max_step_restarts=0)"
    if restarts_so_far >= cap:
        return None, f"resilience.max_step_restarts={cap} reached"
    too_soon = step.seconds is not None and step.seconds < RESTART_TOO_SOON_S
    if job.step_restarts and not step.hung and (too_soon or not step.started):
        when = f"{step.seconds:.0f} s after its launch" if too_soon else "before it wrote run_state.json"
        return None, f"the restarted step failed again at start-up ({when}): not restarted in place again"
    if not step.nodes:
        return RestartPlan(()), ""
    usable = step.nodes if usable_nodes is None else usable_nodes  # unknown: the same nodes as far as known
    lost = tuple(node for node in step.nodes if node not in usable)
    asked = tuple(node for node in step.nodes if node in usable and node in excluded)
    # A spare takes each lost or left-out node's position, as far as there are spares.
    replaced = swap_in(step.nodes, {*lost, *asked}, spares, excluded)
    swap = dict(replaced)
    current = tuple(swap.get(node, node) for node in step.nodes)
    left = tuple(node for node in current if node not in lost)
    need = max(min_nodes, 1)
    needed = f"slurm.min_nodes={min_nodes}" if min_nodes < len(step.nodes) else "every node of the job"
    unreplaced = [node for node in lost if node not in swap]
    if unreplaced and len(left) < need:
        few = f"{len(left)} left, fewer than the run needs ({needed})"
        spare = ", no idle spare left" if spares or job.spare_nodes else ""
        return None, f"node(s) {','.join(unreplaced)} lost{spare} and {few}"
    out = tuple(node for node in asked if node not in swap)
    kept = ""
    if out and len(left) - len(out) < need:
        why = f", {excluded_why}" if excluded_why else ""
        kept = (
            f"kept: {','.join(out)}{why}: without {'it' if len(out) == 1 else 'them'} "
            f"{len(left) - len(out)} node(s) would be left, fewer than the run needs ({needed})"
        )
        out = ()
    left_out = tuple(node for node in asked if node in swap or node in out)
    if not lost and not left_out:
        return RestartPlan((), kept=kept), ""
    rest = tuple(node for node in left if node not in out)
    return RestartPlan(rest, lost, left_out, excluded_why if left_out else "", kept, replaced), ""
