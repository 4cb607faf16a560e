"""Write the generated reference pages: `python docs/reference/generate.py` (from the repository root).

- config.md: every config key, from the schema (relaytrain.config.docs);
- cli.md: every command and flag, from the argument parsers (relaytrain.cli.build_parser);
- run-directory.md: every file and folder of a run directory, from relaytrain.job.RunDir.

tests/test_reference_docs.py fails when a page differs from what this writes, byte for byte.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from relaytrain.cli import build_parser
from relaytrain.config.docs import render as render_config
from relaytrain.job import RunDir

HERE = Path(__file__).resolve().parent
COMMAND = "python docs/reference/generate.py"

CLI_HEADER = f"""# Command reference

Every `relaytrain` command and flag, generated from the argument parsers by `{COMMAND}`.
`relaytrain COMMAND --help` prints the same flags. Commands that take config overrides accept
`--section.key=value` after the config: every key is in [config.md](config.md)."""

RUN_DIR_HEADER = f"""# The run directory

A run writes everything into `<run.dir>/<run.name>/` (by default `runs/<name>/`). Every job of the run,
and `status`, `logs`, `report` and `verify`, read the same files. This page lists each of them. It is
generated from `relaytrain.job.RunDir` by `{COMMAND}`.

What is inside a checkpoint is described in [checkpointing.md](../checkpointing.md). `RANK`, `JOBID`,
`NODE` and `STEP` stand for a rank number, a Slurm job id, a node's host name and a step.
"""

# Sample arguments of RunDir's path methods, by parameter name.
SAMPLE = {"rank": "RANK", "job": "JOBID", "job_id": "JOBID", "node": "NODE", "step": "STEP"}
# RunDir members that are not one of its files.
NOT_FILES = {"of", "holding_job_log", "holds_run", "absolute", "markers", "record_rank", "relative"}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    if not action.help:
        return ""
    return action.help % {**vars(action), "prog": prog}


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{flags}`"
    metavar = action.metavar or action.dest.upper()
    return f"`{flags} {metavar}`"


def _commands(parser: argparse.ArgumentParser, prefix: str):
    """(name, one-line help, parser) of every subcommand, depth first, in help order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", helps.get(name) or "", sub
                yield from _commands(sub, f"{prefix}{name} ")


def render_cli() -> str:
    parts = [CLI_HEADER.rstrip("\n")]
    for name, summary, parser in _commands(build_parser(), ""):
        parts.append(f"\n## relaytrain {name}\n\n{summary[:1].upper()}{summary[1:]}.")
        if parser.description:
            parts.append(f"\n{' '.join(parser.description.split())}")
        if parser.get_default("accepts_overrides"):
            parts.append("\nTakes config overrides (`--section.key=value`, [config.md](config.md)).")
        rows = [
            f"| {_argument(a)} | {_cell(_help(a, parser.prog))} |"
            for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        ]
        if rows:
            parts.append("\n| argument | meaning |\n| --- | --- |")
            parts.extend(rows)
    return "\n".join(parts) + "\n"


def _run_dir_entries():
    """(path in the run directory, description) of each RunDir file or folder, in source order."""
    run = RunDir(Path("RUN"))
    for name, member in vars(RunDir).items():
        if name.startswith("_") or name in NOT_FILES:
            continue
        if isinstance(member, property):
            path, doc = member.fget(run), member.fget.__doc__
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            path, doc = member(run, *(SAMPLE[p] for p in params)), member.__doc__
        else:
            continue
        yield str(path.relative_to(run.root)), " ".join((doc or "").split("\n\n")[0].split())


def render_run_dir() -> str:
    rows = [f"| `{path}` | {_cell(doc)} |" for path, doc in _run_dir_entries()]
    return RUN_DIR_HEADER + "\n| path | what it holds |\n| --- | --- |\n" + "\n".join(rows) + "\n"


PAGES = {"config.md": render_config, "cli.md": render_cli, "run-directory.md": render_run_dir}


def main() -> int:
    for name, render in PAGES.items():
        (HERE / name).write_text(render())
        print(f"wrote {HERE.name}/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
