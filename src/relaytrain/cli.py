"""The `relaytrain` command. Each package registers its own subcommands; this file only wires them.

User mistakes (relaytrain.errors.UserError) print one line and exit with code 2, never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

from relaytrain.resilience.rank.early_signals import capture_early_signals


def runs_training(argv: list[str]) -> bool:
    """Is this process `relaytrain [train ...]` or `python -m relaytrain.cli [train ...]`? (No command
    means train.) Another program that imports this module (a test runner) keeps its signals."""
    if not argv or (
        Path(argv[0]).name != "relaytrain" and Path(argv[0]).resolve() != Path(__file__).resolve()
    ):
        return False
    return len(argv) == 1 or argv[1] == "train"


# Before anything else, even the argument parser: a requeued job can be preempted or reach its
# time-limit signal in its first fraction of a second, and the default action of SIGTERM/SIGUSR2 would
# kill the rank without a checkpoint or a marker. Only for training; other commands keep the defaults.
if runs_training(sys.argv):
    capture_early_signals()

import argparse  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402

from relaytrain.errors import USAGE_EXIT_CODE, UserError  # noqa: E402
from relaytrain.version import __version__  # noqa: E402

# Packages whose `commands.register(subparsers)` adds subcommands, in help order.
COMMAND_MODULES = [
    "relaytrain.data.commands",
    "relaytrain.checkpoint.commands",
    "relaytrain.slurm.commands",
    "relaytrain.inspection.status",
    "relaytrain.localcluster.commands",
    "relaytrain.inspection.report_command",
    "relaytrain.inspection.verify",
    "relaytrain.preflight.commands",
]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config_args",
        nargs=argparse.REMAINDER,
        metavar="[CONFIG] [--section.key=value ...]",
        help="TOML config (default: the embedded debug config), then overrides",
    )


def split_config_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """[CONFIG] [--section.key=value ...] -> (config path or None, overrides)."""
    from relaytrain.config.overrides import split_config_args as split

    return split(list(args.config_args or []) + list(getattr(args, "extra_overrides", [])))


def warm_up_standby() -> None:
    """A standby process's work before it waits (job/standby.py): the trainer's imports (torch's with them)
    and Dynamo's, which the trainer's set-up loads (its step clock watches compilation)."""
    import relaytrain.trainer  # noqa: F401
    from relaytrain.torch_private import compiler

    compiler.import_dynamo()


def cmd_train(args: argparse.Namespace) -> int:
    from relaytrain.job.standby import become_rank

    become_rank(warm_up_standby)  # a standby process: warm, then this rank's (elsewhere: nothing)
    capture_early_signals()  # main(argv) called from Python: before importing torch (idempotent)
    from relaytrain.job import startup

    startup.watch_imports()  # on the progress board of a watched job: each import marks progress
    from relaytrain.config import load_config

    config, overrides = split_config_args(args)
    cfg = load_config(config, overrides)  # a config mistake is reported before torch is imported (seconds)
    from relaytrain.checkpoint.choose import check_resume

    check_resume(cfg)  # a checkpoint.resume path that names no checkpoint, before the run directory exists
    from relaytrain.data.fit import check_data_fits

    check_data_fits(cfg)  # a tokenizer or data too small for the model and the run (a preset on toy data)
    from relaytrain.trainer import train

    return train(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaytrain",
        description="Train Llama-style language models on a laptop, one node or a SLURM cluster.",
    )
    parser.add_argument("--version", action="version", version=f"relaytrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="train (or resume) a model from a TOML config")
    add_config_arguments(train)
    train.set_defaults(func=cmd_train, accepts_overrides=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # a package that has no commands yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    # `--section.key=value` overrides are not argparse options; commands that take them say so.
    args, extra = parser.parse_known_args(argv or ["train"])
    if extra:
        if not getattr(args, "accepts_overrides", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra_overrides = extra
    if not getattr(args, "func", None):
        parser.print_help()
        return USAGE_EXIT_CODE
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"relaytrain: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", USAGE_EXIT_CODE)
    except KeyboardInterrupt:
        print("relaytrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
