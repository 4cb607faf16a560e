"""Process-group setup: device and backend choice, timeouts, and the launch check.

One code path for a single process, torchrun, and srun-launched tasks (whose SLURM variables the
launcher's `apply_slurm_env` maps to RANK/WORLD_SIZE/... before we get here).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from relaytrain.config.schema import Config
from relaytrain.errors import InfrastructureError, UserError
from relaytrain.job import JobFacts, apply_slurm_env

log = logging.getLogger("relaytrain")


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    node: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("run.device='cuda' but no CUDA device is visible; use run.device='cpu' or 'auto'")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cpu_threads_per_rank(local_world_size: int, environ) -> int | None:
    """The intra-op threads a CPU rank should use, or None to keep what torch chose. Where
    OMP_NUM_THREADS is set (by the user, or by the job script from `slurm.cpus_per_task`) torch already
    follows it. Otherwise each of the node's ranks gets its share of the cores this process may run on
    (the affinity mask Slurm or taskset gave it, not the machine's): with more threads than cores, idle
    OpenMP threads spin beside the other ranks' and gloo ranks crawl."""
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def init_distributed(cfg: Config, store=None) -> DistEnv:
    """Initialise torch.distributed when launched with several processes; no-op for one. `store`: the
    store to build the default group on (a survivors' round, `resilience/rank/survivors.py`) instead of
    the launcher's rendezvous."""
    apply_slurm_env(os.environ)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = pick_device(cfg.run.device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    env = DistEnv(rank, local_rank, world_size, local_world_size, device, backend, JobFacts.from_env().host())
    if world_size > 1 and not dist.is_initialized():
        threads = cpu_threads_per_rank(local_world_size, os.environ) if device.type == "cpu" else None
        if threads is not None:
            torch.set_num_threads(threads)
        _init_group(cfg, env, store, cfg.resilience.init_timeout_s)
    return env


def _init_group(cfg: Config, env: DistEnv, store, timeout_s: float) -> None:
    rendezvous = {} if store is None else {"store": store, "rank": env.rank, "world_size": env.world_size}
    dist.init_process_group(
        backend=env.backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=env.device if env.device.type == "cuda" else None,
        **rendezvous,
    )
    health_check(env, timeout_s)
    # Training collectives may legitimately take longer than the start-up handshake; the hang
    # monitor, not the backend, is the first to act on one that never returns.
    set_group_timeouts(cfg.resilience.effective_collective_timeout_s())


def rejoin_distributed(cfg: Config, env: DistEnv, store, timeout_s: float) -> None:
    """A survivor's new default group on `store` (its round), same rank and world size: every group of
    the old one (the device mesh's, the checkpoint's) destroyed first."""
    shutdown_distributed()
    _init_group(cfg, env, store, timeout_s)


def group_timeout(group=None) -> timedelta | None:
    """The collective timeout of `group` (default: the default group); None for a backend that has none
    (the fake process group of `plan --simulate`)."""
    from relaytrain.torch_private import group_timeout as timeout_of

    return timeout_of(group)


def set_group_timeouts(seconds: float) -> int:
    """Give every process group this rank is in `seconds` as its collective timeout: the default group
    and those made since (the device mesh's, relaytrain's gloo groups); returns how many. Groups are
    created with the backend's default (NCCL 600 s, gloo 1800 s), not the default group's timeout.
    Groups made later take the default group's timeout with `match_default_timeout`."""
    from relaytrain.torch_private import process_groups, set_group_timeout

    groups = process_groups()
    for group in groups:
        set_group_timeout(group, timedelta(seconds=seconds))
    return len(groups)


def match_default_timeout() -> int:
    """Every group gets the default group's timeout (`ResilienceConfig.effective_collective_timeout_s`
    once `init_distributed` ran); call it after creating groups. Returns how many groups there are."""
    timeout = group_timeout()
    return 0 if timeout is None else set_group_timeouts(timeout.total_seconds())


def health_check(env: DistEnv, timeout_s: float) -> None:
    """The first all-reduce of the job: proves every rank joined and the network carries traffic."""
    log.info(
        "start: rank %d/%d local_rank %d node %s device %s backend %s",
        env.rank,
        env.world_size,
        env.local_rank,
        env.node,
        env.device,
        env.backend,
    )
    started = time.monotonic()
    probe = torch.ones(1, device=env.device)
    work = dist.all_reduce(probe, async_op=True)
    try:
        finished = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo raises on timeout, NCCL may abort
        raise InfrastructureError(_health_failure(env, timeout_s, exc)) from None
    if finished is False or int(probe.item()) != env.world_size:
        raise InfrastructureError(_health_failure(env, timeout_s, f"sum {probe.item()} != {env.world_size}"))
    if env.is_main:
        log.info(
            "health check passed: world size %d on %d node(s) in %.2f s",
            env.world_size,
            env.num_nodes,
            time.monotonic() - started,
        )


def _health_failure(env: DistEnv, timeout_s: float, detail: object) -> str:
    return (
        f"rank {env.rank}: the first all-reduce did not finish within {timeout_s:.0f} s ({detail}). Likely "
        "causes: a rank never started (check every rank's start line), the wrong network interface "
        "(set slurm.network_interface / NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), a wrong InfiniBand GID "
        "index (slurm.nccl_ib_gid_index), or MASTER_ADDR/MASTER_PORT unreachable from this node"
    )


def rank0_token() -> str:
    """A fresh random id chosen by rank 0, the same on every rank: one broadcast, for a start-up record."""
    box = [uuid.uuid4().hex[:16]]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
