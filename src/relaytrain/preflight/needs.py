"""What the run needs of each node, as `relaytrain plan` computes it (nothing is recomputed here):
host memory (relaytrain.plan.host_memory), the snapshot folder in /dev/shm
(relaytrain.plan.snapshot_memory) and the space one save takes (relaytrain.plan.checks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from relaytrain.config import Config
from relaytrain.plan.checks import make_plan
from relaytrain.plan.host_memory import host_memory_parts
from relaytrain.plan.snapshot_memory import snapshot_bytes_per_node


@dataclass(frozen=True)
class Needs:
    host_bytes: float = 0.0  # host memory per node
    shm_bytes: float = 0.0  # the node's snapshot folder (checkpoint.snapshot_dir)
    save_bytes: float = 0.0  # one checkpoint save

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def run_needs(cfg: Config, nodes: int, per_node: int, gpus_per_node: int) -> Needs:
    """The plan's figures per node for `nodes` nodes of `per_node` processes (GPUs when
    `gpus_per_node`); zeros where the plan cannot lay the run out (its layout check says why)."""
    plan = make_plan(cfg, nodes, gpus_per_node, tasks_per_node=0 if gpus_per_node else per_node)
    if plan.memory is None:
        return Needs()
    parts = host_memory_parts(cfg, plan.memory, plan.dims, nodes, per_node, plan.parameters, gpus_per_node)
    shm = 0.0
    if cfg.checkpoint.enabled and cfg.checkpoint.snapshot_every:
        shm, _ = snapshot_bytes_per_node(cfg, plan.dims, nodes, per_node, plan.parameters)
    save = plan.checkpoint_bytes if cfg.checkpoint.enabled else 0.0
    return Needs(host_bytes=sum(value for _, value in parts), shm_bytes=shm, save_bytes=save)
