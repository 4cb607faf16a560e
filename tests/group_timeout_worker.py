"""Run under torchrun (gloo): init_distributed, the device mesh of a layout and the persistence front's
gloo groups; writes one JSON file per rank into the working directory (ranks printing to one pipe can
interleave their lines): every process group this rank is in -> its timeout in seconds, and the intra-op
threads the rank runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed import distributed_c10d as c10d

from relaytrain.checkpoint.collectives import Collectives
from relaytrain.config.loader import load_config
from relaytrain.parallel.dims import ParallelDims
from relaytrain.parallel.distributed import group_timeout, init_distributed, shutdown_distributed
from relaytrain.parallel.mesh import build_mesh

cfg = load_config(None, ["--run.device=cpu", f"--resilience.collective_timeout_s={sys.argv[1]}"])
env = init_distributed(cfg)
replicate, shard, pp = (int(n) for n in sys.argv[2:5])
mesh = build_mesh(ParallelDims(replicate, shard, 1, 1, pp, env.world_size), "cpu")
Collectives(env.rank, env.world_size, replicas=True)  # the persistence front's groups, snapshots on
groups = {c10d._world.pg_names[g]: group_timeout(g).total_seconds() for g in c10d._world.pg_map}
report = {
    "rank": env.rank,
    "dims": list(mesh.mesh_dim_names),
    "groups": groups,
    "threads": torch.get_num_threads(),
}
Path(f"groups-rank{env.rank}.json").write_text(json.dumps(report))
shutdown_distributed()
