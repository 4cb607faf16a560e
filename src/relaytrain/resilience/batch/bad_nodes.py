"""Bad nodes: which nodes a job's failures implicate, and which are kept out of the rest of the job.

The one owner of "implicated" and "excluded". Each failure the end-of-step decision records in
``crashes.jsonl`` names the nodes it implicates in ``nodes_implicated`` (``implicated_nodes``):

* a hang: its culprit nodes (the hang monitor's verdict);
* else the nodes Slurm took from the job (``--no-kill``: a node that failed);
* else the node whose task ``srun`` reported dead first (`srun: error: n2: task 1: Killed`): the others
  were killed after it (``--kill-on-bad-exit``);
* a straggler stop: the straggler's node.

A node implicated ``resilience.exclude_node_after`` times (default 2; 0: never) in one Slurm job is
excluded for the rest of it: a restart in place puts a spare in its place, or leaves it out where the
node range allows, else the job is requeued and the next allocation excludes it (``scontrol update
ExcNodeList``, ``requeue.scontrol_requeue``). A requeue keeps the job id, so the count carries over.
``relaytrain status RUN`` lists the excluded nodes and why (``excluded_in_run``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IMPLICATED = "nodes_implicated"  # the crashes.jsonl field: the nodes one failure implicates
EXCLUDED = "nodes_excluded"  # the crashes.jsonl field: {node: why} excluded from the job after it


def implicated_nodes(cause: Mapping[str, Any], lost: Sequence[str] = ()) -> tuple[str, ...]:
    """The nodes one failure implicates, from its cause (``crash.cause_of``) and the nodes it lost."""
    hang = cause.get("hang")
    if isinstance(hang, dict):
        culprits = [c.get("node") for c in hang.get("culprits") or () if isinstance(c, dict)]
        named = tuple(dict.fromkeys(n for n in culprits if isinstance(n, str) and n))
        if named:
            return named
    if lost:
        return tuple(dict.fromkeys(lost))
    if cause.get("step_cancelled"):  # Slurm killed every task: the first srun names is no culprit
        return ()
    for task in cause.get("failed_tasks") or ():
        if isinstance(task, dict) and isinstance(task.get("node"), str) and task["node"]:
            return (task["node"],)
    return ()


def implicated_by(entry: Mapping[str, Any]) -> tuple[str, ...]:
    """The nodes a crashes.jsonl line implicates: its ``nodes_implicated``, or for a line written before
    that field, its hang's culprits. Anything else in the field is skipped (hostile input)."""
    named = entry.get(IMPLICATED)
    if isinstance(named, list):
        return tuple(dict.fromkeys(n for n in named if isinstance(n, str) and n))
    hang = entry.get("hang")
    return implicated_nodes({"hang": hang}) if isinstance(hang, dict) else ()


@dataclass(frozen=True)
class Exclusion:
    node: str
    count: int  # failures of the job that implicated it
    after: int  # resilience.exclude_node_after

    @property
    def why(self) -> str:
        return f"implicated in {self.count} failures of this job (resilience.exclude_node_after={self.after})"


def exclusions(implicated: Iterable[str], after: int) -> dict[str, Exclusion]:
    """The excluded nodes, each once per failure in ``implicated``; none when ``after`` is 0."""
    if after <= 0:
        return {}
    counts = Counter(implicated)
    return {node: Exclusion(node, n, after) for node, n in counts.items() if n >= after}


def job_implicated(entries: Iterable[Mapping[str, Any]], job_id: str) -> tuple[str, ...]:
    """Every node this job's failures implicated, once per failure."""
    out: list[str] = []
    for entry in entries:
        if str(entry.get("job_id")) == job_id:
            out += implicated_by(entry)
    return tuple(out)


def excluded_in_run(entries: list[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(job id, node, why) for each node excluded from a job of the run (the ``nodes_excluded`` the
    decision recorded with each failure; the newest says why), for `relaytrain status`."""
    found: dict[tuple[str, str], str] = {}
    for entry in entries:
        excluded = entry.get(EXCLUDED)
        if isinstance(excluded, dict):
            for node, why in excluded.items():
                found[(str(entry.get("job_id", "")), str(node))] = str(why)
    return [(job, node, why) for (job, node), why in found.items()]


def recorded(excluded: Mapping[str, Exclusion]) -> dict[str, Any]:
    """The crashes.jsonl field for the nodes excluded after a failure ({} when none)."""
    return {EXCLUDED: {node: e.why for node, e in excluded.items()}} if excluded else {}


def why_of(excluded: Mapping[str, Exclusion]) -> str:
    """`excluded: implicated in 2 failures of this job (...)` for the restart plan's sentence."""
    counts = sorted({e.count for e in excluded.values()})
    after = next(iter(excluded.values())).after if excluded else 0
    times = "/".join(map(str, counts))
    return f"implicated in {times} failures of this job (resilience.exclude_node_after={after})"
