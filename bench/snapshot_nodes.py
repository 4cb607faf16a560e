"""One task of `python bench/snapshot.py`'s two-node part: run by `relaytrain launch --command` on 2 nodes
of the local cluster (1 task each, each node with its own /dev/shm), with the resolved config of the
launch (RELAYTRAIN_CONFIG: the debug config with a model large enough for ~1 GB of state per rank).

It builds the trainer (model shards, AdamW state, data position, RNG: what a snapshot and a checkpoint
hold) and, through relaytrain's own code paths only:

1. saves a DCP checkpoint of step 1 (the persistence front's DCP tier: `CheckpointManager.save`, sync)
   to the run directory;
2. changes every parameter, takes the snapshot of step 2 (its snapshot tier: `SnapshotTier.take`) and
   waits for its write (`SnapshotTier.wait`): the blocking copy, the exchange with the peer node over the
   gloo group (each rank sends its file to the other node and receives the other's), and the writes;
3. restores three times (`SnapshotTier.restore`, then `CheckpointManager.load` when it finds no usable
   snapshot, as the front's `restore` does, timed apart): with both nodes' folders intact (local
   memory), after rank 1's node folder is deleted (rank 1's file comes from its replica on node 0), and
   after both are deleted (the DCP checkpoint of step 1; the page cache is dropped first when this
   process may). Before each
   one the parameters, AdamW's moments and its step counters are zeroed; after it a checksum of each of
   them on every rank is compared with the state that was saved (`model_exact`, `optim_exact`;
   `bit_exact`: both, and the training step restored is the one saved).

The moments hold distinct values (not those of a fresh optimizer), and the snapshot's differ from the
checkpoint's, so a restore that leaves the optimizer out, or takes it from the wrong tier, is seen.
`--tiers local,dcp` runs in one process (no peer): the comparison's own test.

Rank 0 writes the timings as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from relaytrain.checkpoint.checksums import Checksum
from relaytrain.checkpoint.snapshot.format import _local
from relaytrain.checkpoint.state import create_adam_state, model_state
from relaytrain.config import load_config
from relaytrain.monitor.logs import setup_logging
from relaytrain.parallel.distributed import init_distributed, shutdown_distributed
from relaytrain.trainer import Trainer, prepare_run_dir

TIERS = ("local", "peer", "dcp")


def _checksum(tensors) -> str:
    checksum = Checksum()
    for tensor in tensors:
        checksum.update(_local(tensor).detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return checksum.text()


def optimizer_tensors(optimizers) -> list[torch.Tensor]:
    """AdamW's state in a fixed order: each parameter's moments and step counter."""
    return [opt.state[p][key] for opt in optimizers for group in opt.param_groups for p in group["params"]
            if p in opt.state for key in sorted(opt.state[p])]  # fmt: skip


def fingerprint(trainer: Trainer) -> dict[str, str]:
    """Checksums of this rank's model state and optimizer state."""
    return {"model": _checksum(model_state(trainer.model.model_parts).values()),
            "optim": _checksum(optimizer_tensors(trainer.optimizers))}  # fmt: skip


def change_state(trainer: Trainer, how) -> None:
    """Apply ``how(tensor)`` in place to every parameter and every optimizer state tensor."""
    with torch.no_grad():
        for part in trainer.model.model_parts:
            for param in part.parameters():
                how(_local(param))
        for tensor in optimizer_tensors(trainer.optimizers):
            how(_local(tensor))


def drop_page_cache() -> bool:
    """So that the DCP load reads the disk, not the pages its save left in memory (needs root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def barrier() -> None:
    if dist.is_initialized():  # one process has no group
        dist.barrier()


def gathered(value) -> list:
    if not dist.is_initialized():
        return [value]
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, value)
    return box


def restore(trainer: Trainer, tier: str, expected: dict[str, str], expected_step: int, rank: int) -> dict:
    snapshots, checkpoint = trainer.persistence.snapshots, trainer.persistence.checkpoints
    if (tier == "peer" and rank == 1) or tier == "dcp":
        shutil.rmtree(snapshots.node_dir, ignore_errors=True)  # the node lost its memory
    change_state(trainer, torch.Tensor.zero_)
    dropped = drop_page_cache() if tier == "dcp" and rank == 0 else False
    barrier()
    started = time.perf_counter()
    step = snapshots.restore(checkpoint.ckpt_dir)
    snapshot_s = time.perf_counter() - started
    source = "snapshot"
    if step is None:
        step, source = checkpoint.load(), "checkpoint"
    seconds = time.perf_counter() - started
    barrier()
    total = time.perf_counter() - started  # the slowest rank's
    found = fingerprint(trainer)
    model_exact = all(gathered(found["model"] == expected["model"]))
    optim_exact = all(gathered(found["optim"] == expected["optim"]))
    exact = model_exact and optim_exact and step == expected_step
    return {"tier": tier, "step": step, "source": source, "restore_s": total, "rank_s": gathered(seconds),
            "snapshot_lookup_s": snapshot_s, "bit_exact": exact, "model_exact": model_exact,
            "optim_exact": optim_exact, "page_cache_dropped": dropped}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    parser.add_argument("--tiers", default=",".join(TIERS), help="the restores to time, in this order")
    args = parser.parse_args()
    tiers = args.tiers.split(",")
    if unknown := set(tiers) - set(TIERS):
        parser.error(f"--tiers: unknown {', '.join(sorted(unknown))}; choose from {','.join(TIERS)}")
    cfg = load_config(os.environ["RELAYTRAIN_CONFIG"])
    env = init_distributed(cfg)
    run_dir = prepare_run_dir(cfg, env.is_main)
    setup_logging(run_dir, env.rank, env.local_rank, env.node, cfg.metrics.rank_logs)
    log = logging.getLogger("relaytrain")
    torch.manual_seed(cfg.run.seed)
    trainer = Trainer(cfg, env)
    try:
        create_adam_state(trainer.optimizers)  # the moments a first step would create: a full state
        generator = torch.Generator().manual_seed(env.rank)  # moments: this rank's shards
        change_state(trainer, lambda t: t.copy_(torch.rand(t.shape, generator=generator).to(t.dtype)))
        for tensor in optimizer_tensors(trainer.optimizers):
            if tensor.dim() == 0:  # a step counter: the same on every rank, as training keeps it
                tensor.fill_(7)
        checkpoint, snapshots = trainer.persistence.checkpoints, trainer.persistence.snapshots
        trainer.state.step = 1
        started = time.perf_counter()
        checkpoint.save(1)
        checkpoint.wait()
        barrier()
        dcp_save_s = time.perf_counter() - started
        at_checkpoint = fingerprint(trainer)
        change_state(trainer, lambda t: t.add_(1))
        trainer.state.step = 2
        at_snapshot = fingerprint(trainer)
        snapshots.take(2)
        blocking = snapshots.last
        written = gathered(snapshots.wait())
        barrier()
        results = {
            "nodes": gathered(env.node),
            "params": sum(_local(p).numel() for part in trainer.model.model_parts for p in part.parameters()),
            "snapshot_bytes": gathered(blocking["bytes"]),
            "blocking_s": gathered(blocking["blocking_s"]),
            "written": written,
            "dcp_save_s": dcp_save_s,
            "restores": [],
        }
        for tier in tiers:
            expected, step = (at_checkpoint, 1) if tier == "dcp" else (at_snapshot, 2)
            results["restores"].append(restore(trainer, tier, expected, step, env.rank))
            if env.is_main:
                log.info("bench: restore from %s: %s", tier, results["restores"][-1])
        if env.is_main:
            Path(args.out).write_text(json.dumps(results, indent=1))
        trainer.persistence.close(finished=True)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
