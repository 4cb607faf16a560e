"""CLI: launch, sweep, chain, cancel, plan, doctor (status and logs: relaytrain.inspection.status)."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from relaytrain.errors import UserError


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False, width=150 if not sys.stdout.isatty() else None)


_SLURM_FLAGS = {  # CLI flag -> (SlurmConfig key, type)
    "nodes": ("nodes", int),
    "spare_nodes": ("spare_nodes", int),
    "gpus_per_node": ("gpus_per_node", int),
    "tasks_per_node": ("tasks_per_node", int),
    "cpus_per_task": ("cpus_per_task", int),
    "time": ("time", str),
    "partition": ("partition", str),
    "account": ("account", str),
    "qos": ("qos", str),
    "mem": ("mem", str),
    "gpu": ("gpu_type", str),
}
_LEVEL_STYLE = {"pass": "green", "ok": "green", "warn": "yellow", "fail": "red"}


def _node_range(text: str) -> tuple[int, int]:
    """`--nodes 4` -> (0, 4); `--nodes 2-4` -> (2, 4): slurm.min_nodes and slurm.nodes."""
    low, dash, high = text.strip().partition("-")
    try:
        lo, hi = (int(low), int(high)) if dash else (0, int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node count N or a range MIN-MAX (2-4)") from None
    if hi < 1 or (dash and not 1 <= lo <= hi):
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX (e.g. --nodes 2-4)")
    return lo, hi


def _add_slurm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes",
        type=_node_range,
        help="number of nodes, or MIN-MAX (e.g. 2-4): Slurm may start the job, and each requeue of it, on "
        "any count in the range",
    )
    p.add_argument(
        "--spare-nodes",
        type=int,
        metavar="K",
        help="also allocate K idle spare nodes: a failed or excluded node's place goes to one (same world "
        "size, no requeue; slurm.spare_nodes, docs/elastic.md); a straggling node's only with "
        "resilience.straggler_action replace or auto (the default, report, only names it)",
    )
    p.add_argument(
        "--gpus-per-node", type=int, help="GPUs per node (0: CPU-only nodes, set --tasks-per-node)"
    )
    p.add_argument("--tasks-per-node", type=int, help="processes per node (default: one per GPU)")
    p.add_argument("--cpus-per-task", type=int, help="CPUs per process; sets OMP_NUM_THREADS")
    p.add_argument("--time", help="time limit, e.g. 24:00:00")
    p.add_argument("--partition", help="Slurm partition (slurm.partition)")
    p.add_argument("--account", help="Slurm account to charge (slurm.account)")
    p.add_argument("--qos", help="Slurm quality of service (slurm.qos)")
    p.add_argument("--mem", help="memory per node as sbatch --mem (64G; 0: all); checked with CPU offload")
    p.add_argument("--gpu", help="GPU type for the memory check: h100, h200, a100, a100-40gb, mi250x, ...")
    p.add_argument("--profile", help="cluster profile: a TOML path or a name in configs/clusters/")


def _add_submit_flags(p: argparse.ArgumentParser) -> None:
    _add_slurm_flags(p)
    p.add_argument("--after", metavar="JOBID", help="start only after JOBID succeeded (afterok)")
    p.add_argument(
        "--dry-run", action="store_true", help="write the script and config, print, submit nothing"
    )
    p.add_argument("--force", action="store_true", help="submit even when relaytrain plan refuses the layout")
    p.add_argument(
        "--signal",
        dest="signal_spec",
        metavar="SIG[@S]|none",
        help="pre-timeout signal, S seconds before the limit (USR2@180); none: no signal. "
        "Default: resilience.slurm_signal@signal_lead_s, none for --command (docs/programs.md)",
    )


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """[CONFIG] and the overrides, split by the one owner of that syntax.

    argparse takes an argument with a space in it for a positional even when it starts with `--`, so
    `--command CMD --slurm.setup=['export A=1']` lands in `config`: the split puts it back.
    """
    from relaytrain.config.overrides import split_config_args

    config = getattr(args, "config", None)
    return split_config_args(([config] if config else []) + list(getattr(args, "extra_overrides", []) or []))


def _request(args: argparse.Namespace):
    from relaytrain.slurm.launch import LaunchRequest

    config, overrides = _config_and_overrides(args)
    slurm = {key: getattr(args, flag, None) for flag, (key, _) in _SLURM_FLAGS.items()}
    if slurm["nodes"] is not None:
        slurm["min_nodes"], slurm["nodes"] = slurm["nodes"]
    return LaunchRequest(
        config=config,
        overrides=overrides,
        slurm=slurm,
        profile=args.profile,
        command=getattr(args, "command_line", None),
        name=getattr(args, "name", None),
        jobid=getattr(args, "jobid", None),
        after=args.after,
        dry_run=args.dry_run,
        force=args.force,
        signal=getattr(args, "signal_spec", None),
        max_concurrent=getattr(args, "max_concurrent", None),
    )


def cmd_launch(args: argparse.Namespace) -> int:
    from relaytrain.slurm.launch import launch

    return launch(_request(args))


def cmd_sweep(args: argparse.Namespace) -> int:
    from relaytrain.slurm.launch import sweep

    return sweep(_request(args), args.grid)


def cmd_chain(args: argparse.Namespace) -> int:
    from relaytrain.slurm.launch import chain

    return chain(_request(args), args.configs)


def cmd_plan(args: argparse.Namespace) -> int:
    from relaytrain.plan.compare import report
    from relaytrain.plan.step_time import DEFAULT_MFU
    from relaytrain.slurm.launch import load_resolved
    from relaytrain.slurm.partition_plans import plans_for

    if args.mfu is not None and not 0 < args.mfu <= 100:
        raise UserError(f"--mfu {args.mfu:g}: the assumed MFU is a percentage in (0, 100], e.g. --mfu 40")
    req = _request(args)
    notes: list[str] = []
    cfg = load_resolved(req, notes=notes)
    plans = plans_for(cfg, DEFAULT_MFU if args.mfu is None else args.mfu / 100)
    console = _console()
    # The plan's tables, then with --simulate the fake-tensor step beside them, then the verdict.
    show = lambda: _print_plan(cfg, plans, console, notes)  # noqa: E731
    return report(cfg, plans, console, args.simulate, args.json, show)


def _print_plan(cfg, plans, console: Console, notes: list[str]) -> None:
    from relaytrain.plan.checks import plan_rows, range_rows
    from relaytrain.plan.spares import spare_rows

    plan = plans[-1]
    if len(plans) > 1:  # --nodes MIN-MAX: each count Slurm may start a job of the chain on
        counts = Table(title="node range: the layout at each count (global batch fixed)", show_header=True)
        for column in ("nodes", "ranks", "layout", "micro batch x accum", "memory per GPU", "verdict"):
            counts.add_column(column, overflow="fold")
        for row in range_rows(plans):
            counts.add_row(*row)
        console.print(counts)
        for other in plans[:-1]:
            for name, level, detail in other.checks:
                if level == "fail":
                    console.print(f"[red]fail at {other.nodes} node(s)[/]: {name}: {detail}")
    facts = Table(title=f"relaytrain plan: {cfg.run.name}", show_header=False)
    facts.add_column("what")
    facts.add_column("value")
    for name, value in plan_rows(plan) + spare_rows(cfg.slurm):
        facts.add_row(name, value)
    console.print(facts)
    checks = Table(show_header=True)
    for column in ("check", "result", "detail"):
        checks.add_column(column, overflow="fold")
    for name, level, detail in plan.checks:
        checks.add_row(name, f"[{_LEVEL_STYLE[level]}]{level}[/]", detail)
    console.print(checks)
    for line in notes:
        console.print(line)


def cmd_cancel(args: argparse.Namespace) -> int:
    from relaytrain.slurm.client import run_slurm, slurm_refusal
    from relaytrain.slurm.jobs import cancel_command

    if why := slurm_refusal(run_slurm(cancel_command(args.jobid, args.signal))):
        raise UserError(f"could not cancel job {args.jobid}: {why}; `relaytrain status` lists your jobs")
    what = f"sent SIG{args.signal.removeprefix('SIG')} to the steps of" if args.signal else "cancelled"
    print(f"{what} job {args.jobid}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from relaytrain.config import load_config

    config, overrides = _config_and_overrides(args)
    cfg = load_config(config, overrides) if config else None
    if cfg is not None:
        from relaytrain.data.fit import check_data_fits

        check_data_fits(cfg)  # before the checks' table: a preset on the toy corpus is refused outright
    from relaytrain.slurm.doctor import run_checks  # imports torch (the CPU capability)

    checks = run_checks(cfg, args.partition or "", args.account or "")
    table = Table(title="relaytrain doctor", show_header=True)
    for column in ("check", "result", "detail"):
        table.add_column(column, overflow="fold")
    for name, level, detail in checks:
        table.add_row(name, f"[{_LEVEL_STYLE[level]}]{level}[/]", detail)
    _console().print(table)
    return 1 if any(level == "fail" for _, level, _ in checks) else 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch",
        help="write an sbatch script for a config (or any command) and submit it",
        usage="relaytrain launch [CONFIG] [--section.key=value ...] [options]",
        description="Write an sbatch script for CONFIG and submit it. Any config key can follow as an "
        "override, e.g. --train.max_steps=1000 or --data.tokenizer=tokenizer.json (every key: "
        "docs/reference/config.md). --command 'CMD' runs your own program instead and needs --name.",
    )
    p.add_argument("config", nargs="?", help="TOML config (optional with --command)")
    _add_submit_flags(p)
    p.add_argument(
        "--command",
        dest="command_line",
        metavar="CMD",
        help="run this command instead of relaytrain train (DeepSpeed, Lightning, a script); needs --name",
    )
    p.add_argument("--name", help="run name (default: run.name of the config; required with --command)")
    p.add_argument("--jobid", help="attach to this existing allocation with srun --overlap (no sbatch)")
    p.set_defaults(func=cmd_launch, accepts_overrides=True)

    p = subparsers.add_parser("sweep", help="one job array over a grid of overrides or command values")
    p.add_argument("config", nargs="?", help="TOML config (optional with --command)")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="section.key (or, with --command, a {name} placeholder) and its values; repeat for a product",
    )
    p.add_argument(
        "--command",
        dest="command_line",
        metavar="CMD",
        help="run this command in each array task, {key} replaced by the point's value (docs/programs.md)",
    )
    p.add_argument("--name", help="sweep name: runs NAME-0, NAME-1, ... (default: run.name of the config)")
    p.add_argument(
        "--max-concurrent",
        type=int,
        metavar="N",
        help="run at most N array tasks at once (--array=0-K%%N); default: no cap",
    )
    _add_submit_flags(p)
    p.set_defaults(func=cmd_sweep, accepts_overrides=True)

    p = subparsers.add_parser("chain", help="submit configs as stages, each after the previous succeeded")
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="TOML configs, one per stage, in order")
    _add_submit_flags(p)
    p.set_defaults(func=cmd_chain, accepts_overrides=True)

    p = subparsers.add_parser("plan", help="check layout, memory per GPU and checkpoint time before queueing")
    p.add_argument("config", help="TOML config")
    _add_slurm_flags(p)
    p.add_argument(
        "--mfu",
        type=float,
        metavar="PERCENT",
        help="MFU assumed for the step-time and time-to-train estimates (default 40)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="also run one step of the real build at the real world size on fake tensors, beside the plan",
    )
    p.add_argument("--json", action="store_true", help="print the plan (and simulation) as one JSON record")
    p.set_defaults(func=cmd_plan, accepts_overrides=True, after=None, dry_run=False, force=False)

    p = subparsers.add_parser("cancel", help="cancel a job, or send its training processes a signal")
    p.add_argument("jobid", metavar="JOBID", help="the Slurm job id")
    p.add_argument("--signal", help="e.g. USR2: ask the run to checkpoint and stop instead of killing it")
    p.set_defaults(func=cmd_cancel)

    p = subparsers.add_parser("doctor", help="check Slurm, partition, account, shared fs, network, GPUs")
    p.add_argument("config", nargs="?", help="TOML config whose slurm section to check (optional)")
    p.add_argument("--partition", help="Slurm partition to check")
    p.add_argument("--account", help="Slurm account to check")
    p.set_defaults(func=cmd_doctor, accepts_overrides=True)
