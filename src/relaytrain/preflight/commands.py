"""`relaytrain preflight CONFIG`: the per-node checks of relaytrain.preflight, on this machine's ranks
(torchrun) outside Slurm, as a job step over the allocation inside one."""

from __future__ import annotations

import argparse
import os
import sys

from relaytrain.entry_points import CLI
from relaytrain.errors import UserError

STEP_TIMEOUT_S = 300.0  # the job step's srun: start-up plus the checks' budget, with room


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help="check every node (compute, network, memory, /dev/shm, checkpoint storage, GPU health)",
        description=(
            "Measure every node of the job and name the ones below threshold, one line each; the results "
            "go to RUN_DIR/preflight/JOB.json. Outside Slurm the ranks run on this machine (torchrun); in a "
            "Slurm allocation they run as a job step over its nodes. Exit 1 when a node is below threshold."
        ),
    )
    # An optional positional, not argparse.REMAINDER: a remainder would take the flags after CONFIG
    # (`preflight configs/debug.toml --nproc-per-node 2`) for overrides. Overrides are the parser's extras.
    parser.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help="TOML config of the run to check for (default: the embedded debug config); --section.key=value "
        "overrides may follow",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=0,
        metavar="N",
        help="the node count the run's needs are planned for (default: the nodes checked)",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="outside Slurm: ranks on this machine (each stands for a node; default 1)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds each rank spends measuring compute and network (default 5)",
    )
    parser.set_defaults(func=preflight_command, accepts_overrides=True)


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    from relaytrain.config.overrides import split_config_args

    return split_config_args(
        ([args.config] if args.config else []) + list(getattr(args, "extra_overrides", []))
    )


def _forwarded(args: argparse.Namespace) -> list[str]:
    """This command's own arguments, for the ranks it starts."""
    config, overrides = _config_and_overrides(args)
    return [
        *([config] if config else []),
        *overrides,
        "--nodes",
        str(args.nodes),
        "--budget",
        str(args.budget),
    ]


def preflight_command(args: argparse.Namespace) -> int:
    from relaytrain.config import load_config
    from relaytrain.job import JobFacts
    from relaytrain.job.env import in_srun_step

    if args.nodes < 0 or args.nproc_per_node < 1 or args.budget <= 0:
        raise UserError("preflight: --nodes >= 0, --nproc-per-node >= 1 and --budget > 0")
    config, overrides = _config_and_overrides(args)
    cfg = load_config(config, overrides)
    if "RANK" in os.environ or in_srun_step(os.environ):
        from relaytrain.preflight.run import run_preflight

        return run_preflight(cfg, args.nodes, args.budget)
    if JobFacts.from_env().in_slurm:
        return _job_step(args)
    if args.nproc_per_node > 1:
        import subprocess

        ranks = f"--nproc_per_node={args.nproc_per_node}"
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            ranks,
            "-m",
            CLI,
        ]
        torchrun.append("preflight")
        return subprocess.run([*torchrun, *_forwarded(args)], check=False).returncode
    from relaytrain.preflight.run import run_preflight

    return run_preflight(cfg, args.nodes, args.budget)


def _job_step(args: argparse.Namespace) -> int:
    """One task per node of the allocation, each running this command as a rank."""
    from relaytrain.job.slurm_command import run_slurm_command

    step = [
        "srun",
        "--ntasks-per-node=1",
        sys.executable,
        "-m",
        CLI,
        "preflight",
        *_forwarded(args),
    ]
    done = run_slurm_command(step, STEP_TIMEOUT_S, capture=False)
    if done.returncode is None:  # srun missing, or the step timed out
        raise UserError(f"preflight: the job step did not run: {done.error or done.outcome.name}")
    return done.returncode or 0
