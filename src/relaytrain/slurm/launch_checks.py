"""What `launch` and `sweep` refuse before a config is resolved or a file written: a request without a
config or command, flags that contradict each other, and a `--command` without a run name of its own;
and, once the config is resolved, data too small for the model it trains (`plan` gets that too).

A program's run directory must be its own: a config's `run.name` (the embedded default is `debug`) names
relaytrain's trainer run, whose run_state.json a program would overwrite. So `--command` needs `--name`
(or `--run.name=`); the refusal suggests a name taken from the command.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from relaytrain.config import Config, parse_override
from relaytrain.data.fit import check_data_fits
from relaytrain.errors import UserError
from relaytrain.slurm.script import check_survivors
from relaytrain.slurm.submit import check_after


def suggested_name(command: str) -> str:
    """A run name for a command: its script's stem (`python examples/ddp_train.py` -> ddp_train), else
    the module of `-m` or the program's name."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    scripts = [Path(w).stem for w in words if w.endswith(".py") and not w.startswith("-")]
    modules = [words[i + 1].rpartition(".")[2] for i, w in enumerate(words[:-1]) if w == "-m"]
    modules = [m for m in modules if m not in ("torchrun", "run")]  # the launcher, not the program
    name = (scripts or modules or [Path(words[0]).name if words else "program"])[0]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "program"


def _names_run(overrides: list[str]) -> bool:
    return any(parse_override(text)[:2] == ("run", "name") for text in overrides)


def check_request(req: Any, what: str) -> None:
    """Raise UserError (one line, exit 2) for a request (slurm.launch.LaunchRequest) that `what` (launch,
    sweep) cannot honour as given."""
    if req.command is None and req.config is None:
        raise UserError(f"relaytrain {what} needs a CONFIG, or --command 'CMD' (with --name)")
    if req.after and req.jobid:
        raise UserError(
            f"--after {req.after} and --jobid {req.jobid} conflict: --jobid runs now inside an existing "
            "allocation, --after queues a new job behind another; pass one of them"
        )
    if req.force and req.command is not None:
        raise UserError(
            "--force submits a layout relaytrain plan refuses, and a --command launch runs no plan (it is "
            "for relaytrain's trainer); drop --force"
        )
    if req.after:
        check_after(req.after)
    if req.command is not None and req.name is None and not _names_run(req.overrides):
        base = "NAME-0, NAME-1, ..." if what == "sweep" else "NAME"
        raise UserError(
            f"relaytrain {what} --command needs --name NAME: the program's own run directory (runs/{base}; "
            f"a config's run.name is for relaytrain's trainer), e.g. --name {suggested_name(req.command)}"
        )


def train_data_checked(req: Any, cfg: Config) -> Config:
    """`cfg`, once its data and tokenizer fit its model and run (relaytrain.data.fit), for a job that
    trains (a --command program reads its own data), its survivors (resilience.survivors) where they
    work, and its alerts' URL file is its owner's alone."""
    if req.command is None:
        check_data_fits(cfg)
    check_survivors(cfg, "command" if req.command is not None else "train")
    if cfg.notify.url_file:  # its mode, here, where the user can fix it: the job would only log it
        from relaytrain.resilience.batch.notify_send import webhook_url

        webhook_url(cfg.notify, {})
    return cfg
