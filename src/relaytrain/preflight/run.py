"""Preflight as one rank of a job (torchrun locally, srun's tasks in Slurm): measure this rank's node,
gather every rank's results on rank 0, judge them, print one line per node below threshold and write
`<run_dir>/preflight/<job>.json`."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from relaytrain.atomic import write_atomic
from relaytrain.config import Config
from relaytrain.job import JobFacts, RunDir
from relaytrain.preflight import judge as judging
from relaytrain.preflight import measure
from relaytrain.preflight.needs import Needs, run_needs

log = logging.getLogger(__name__)
BELOW_THRESHOLD_EXIT = 1


IN_JOB_BUDGET_S = 2.0  # the checks before a job step's first step: compute and network get 0.8 s each
PHASE_SHARE = 0.4  # of the budget, for compute and for network each (the rest: storage, gathering, judging)


def job_name(facts: JobFacts) -> str:
    """The name of this job's results file: the Slurm job id (`-r1` after a requeue, `-s1` after a step
    restarted in place), or `local-<UTC time>` outside Slurm."""
    if not facts.in_slurm:
        return time.strftime("local-%Y%m%d-%H%M%S", time.gmtime())
    name = facts.requeue_id
    name += f"-r{facts.restart_count}" if facts.restart_count else ""
    return name + (f"-s{facts.step_restarts}" if facts.step_restarts else "")


def checkpoint_folder(cfg: Config) -> Path:
    return (
        Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else RunDir.of(cfg.run.dir, cfg.run.name).checkpoints
    )


def measure_rank(cfg: Config, env, budget_s: float) -> dict:
    """This rank's figures; each measurement gets its share of `budget_s`."""
    import torch

    dtype = torch.float32
    if env.device.type == "cuda" and cfg.parallel.param_dtype != "float32":
        dtype = torch.bfloat16
    figures: dict[str, float | None] = {}
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    figures["gflops"] = measure.compute_rate(env.device, dtype, budget_s * PHASE_SHARE)["gflops"]
    seconds["compute"] = time.perf_counter() - t0
    figures["gbps"] = None
    if env.distributed:
        t0 = time.perf_counter()
        figures["gbps"] = measure.allreduce_bandwidth(env.device, None, budget_s * PHASE_SHARE)["gbps"]
        seconds["network"] = time.perf_counter() - t0
    # Outside Slurm the ranks of one machine stand for nodes, so that they are compared with each other.
    node = (
        env.node
        if JobFacts.from_env().in_slurm or env.local_world_size == 1
        else f"{env.node}:{env.local_rank}"
    )
    result: dict = {"rank": env.rank, "node": node, "device": str(env.device), "dtype": str(dtype)}
    if env.local_rank == 0:  # node-wide readings: once per node
        figures["host_free_bytes"] = measure.available_memory()
        if cfg.checkpoint.snapshot_every and cfg.checkpoint.enabled:
            figures["shm_free_bytes"] = measure.free_bytes(Path(cfg.checkpoint.snapshot_dir))
        if cfg.checkpoint.enabled:
            t0 = time.perf_counter()
            storage = measure.storage_probe(checkpoint_folder(cfg))
            seconds["storage"] = time.perf_counter() - t0
            figures["storage_free_bytes"] = storage["free_bytes"]
            figures["storage_write_mb_s"] = storage.get("write_mb_s")
            result["storage_error"] = storage.get("error")
    if env.device.type == "cuda":
        gpu = measure.gpu_health(env.device.index or 0)
        result["gpu"] = {"index": env.device.index or 0, **gpu} if gpu else None
    result["figures"] = figures
    result["seconds"] = seconds
    return result


def gather(result: dict, env) -> list[dict]:
    if not env.distributed:
        return [result]
    import torch.distributed as dist

    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, result)
    return everyone


DEFAULT_LIMITS = judging.Thresholds()


def run_preflight(
    cfg: Config, nodes: int = 0, budget_s: float = 5.0, limits: judging.Thresholds = DEFAULT_LIMITS
) -> int:
    """Run the checks as this rank; rank 0 reports. 0: every node passed, 1: a node is below threshold.
    `nodes`: the run's node count the plan's needs are computed for (0: this job's)."""
    from relaytrain.parallel.distributed import init_distributed, shutdown_distributed

    env = init_distributed(cfg)
    started = time.perf_counter()  # the checks' time, as in a job step (whose process group is up)
    try:
        ranks = gather(measure_rank(cfg, env, budget_s), env)
    finally:
        shutdown_distributed()
    return report(cfg, env, ranks, nodes, limits, started)[0]


def check_in_job(cfg: Config, env, run: RunDir | None = None) -> int:
    """`resilience.preflight` in a Slurm job: the checks on the training job's ranks and process group,
    before its first step (called by relaytrain.trainer); the lines go to the job log. Every rank returns
    the exit code to stop with: 0 to train, EXIT_PREFLIGHT when `exclude` leaves nodes out (exclude.py)."""
    mode = cfg.resilience.preflight
    if mode == "off" or not JobFacts.from_env().in_slurm:
        return 0
    started = time.perf_counter()
    ranks = gather(measure_rank(cfg, env, IN_JOB_BUDGET_S), env)
    path = report(cfg, env, ranks, 0, DEFAULT_LIMITS, started)[1]
    if mode != "exclude":
        return 0
    from relaytrain.preflight.exclude import stop_for

    problems = judged(cfg, env, ranks, 0, DEFAULT_LIMITS)[1]  # every rank: the same verdict
    return stop_for(problems, judging.report_lines(problems), str(path or ""), env, run)


def judged(
    cfg: Config, env, ranks: list[dict], nodes: int, limits: judging.Thresholds
) -> tuple[Needs, dict[str, list[str]]]:
    """(the run's needs, {node: what falls short}) from every rank's results: pure, the same on each rank."""
    per_node = env.local_world_size
    gpus = per_node if env.device.type == "cuda" else 0
    needs = run_needs(cfg, nodes or env.num_nodes, per_node, gpus)
    return needs, judging.judge(ranks, needs.as_dict(), limits)


def report(
    cfg: Config, env, ranks: list[dict], nodes: int, limits: judging.Thresholds, started: float
) -> tuple[int, Path | None]:
    """Rank 0: judge, print one line per node below threshold and the summary, write the results.
    (1 when a node is below threshold else 0, the results file); (0, None) on the other ranks."""
    if not env.is_main:
        return 0, None
    needs, problems = judged(cfg, env, ranks, nodes, limits)
    lines = judging.report_lines(problems)
    for line in lines:
        print(line, flush=True)
    facts = JobFacts.from_env()
    record = {
        "job": job_name(facts),
        "time": time.time(),
        "seconds": time.perf_counter() - started,
        "summary": judging.summary(problems),
        "lines": lines,
        "nodes": {node: {"passed": not found, "problems": found} for node, found in problems.items()},
        "needs": needs.as_dict(),
        "thresholds": limits.as_dict(),
        "ranks": ranks,
    }
    path = RunDir.of(cfg.run.dir, cfg.run.name).preflight(record["job"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1, default=str) + "\n", durable=False)
    print(f"preflight: {record['summary']} in {record['seconds']:.1f} s ({path})", flush=True)
    return (BELOW_THRESHOLD_EXIT if lines else 0), path
