"""Spare nodes (``slurm.spare_nodes``): the batch program's one owner of them.

A job with spares holds K idle nodes beside its N training nodes. This module says which of the job's
nodes wait as spares (``split_nodes``), which of them are idle and usable now (``usable``, ``still_idle``;
``publish`` names them to the step's ranks in ``RELAYTRAIN_SPARE_NODES``, read back by
``JobFacts.spare_nodes``), which spare takes a lost or left-out node's place (``swap_in``), which of the
job's nodes a restart left out (``left_out``), and whether a spare standing in a lower node's position
needs a host file (``out_of_order``). The driver (``driver.py``), the end-of-step decision
(``step_end.py``) and its restart plan (``step_restart.py``) ask here; what spares cost is
``plan/spares.py``, and the rank's straggler policy reads the published list
(``rank/straggler.py`` ``choose_action``).
"""

from __future__ import annotations

from collections.abc import Collection, MutableMapping, Sequence
from typing import NamedTuple

from relaytrain.job import JobFacts
from relaytrain.job.facts import SPARE_NODES_ENV


class JobNodes(NamedTuple):
    training: list[str]
    spares: list[str]


def split_nodes(job: JobFacts, training: int) -> JobNodes:
    """The job's nodes in Slurm's order: the first ``training`` train (0: all), the others wait as spares."""
    hosts = job.nodes()
    count = training or len(hosts)
    return JobNodes(hosts[:count], hosts[count:])


def publish(environ: MutableMapping[str, str], idle: Sequence[str]) -> None:
    """Name the idle spares to the next step (its ranks and the decision after it)."""
    environ[SPARE_NODES_ENV] = ",".join(idle)


def usable(spares: Sequence[str], usable_nodes: Collection[str] | None) -> tuple[str, ...]:
    """The spares that can run a step now (``usable_nodes`` None: Slurm could not say, all of them)."""
    return tuple(node for node in spares if usable_nodes is None or node in usable_nodes)


def still_idle(idle: Sequence[str], step_nodes: Collection[str]) -> list[str]:
    """The spares left idle once a step runs on ``step_nodes``."""
    return [spare for spare in idle if spare not in step_nodes]


def swap_in(
    step_nodes: Sequence[str], leaving: Collection[str], spares: Sequence[str], excluded: Collection[str]
) -> tuple[tuple[str, str], ...]:
    """(node, the spare in its place) for each node of ``leaving``, in the step's order, as far as there
    are idle spares (not in the step, not excluded), each spare in its node's position."""
    idle = [spare for spare in spares if spare not in step_nodes and spare not in excluded]
    return tuple(zip([n for n in step_nodes if n in leaving], idle, strict=False))


def left_out(order: Sequence[str], step_nodes: Collection[str], idle: Collection[str]) -> list[str]:
    """The job's nodes (``order``: Slurm's) a restart left out: a failed or slow node a spare replaced."""
    return [node for node in order if node not in step_nodes and node not in idle]


def out_of_order(nodes: Sequence[str], order: Sequence[str]) -> bool:
    """Whether ``nodes`` (rank blocks in this order) differ from Slurm's node order, which srun follows:
    a spare in a lower node's position needs a host file."""
    in_order = sorted(nodes, key=lambda n: order.index(n) if n in order else len(order))
    return list(nodes) != in_order
