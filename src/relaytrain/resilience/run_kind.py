"""What kind of run a run directory holds, so that one directory never mixes two runs.

A run directory holds one run: relaytrain's trainer (`relaytrain train`, `launch CONFIG`) or another
program (`launch --command CMD`, a script using `relaytrain.program`). Their files have the same names
(run_state.json, metrics.jsonl, run.lock), so a program started in a trainer's directory would overwrite
its state, and `report` would stitch both into one history. `run_kind.json` records the kind (and, for a
launched program, its command) when a run first writes its directory; a later launch or start of another
kind, or of another command, is refused in one line. A directory written before this record existed is a
trainer's when it holds the trainer's resolved `config.toml`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from relaytrain.atomic import write_atomic
from relaytrain.errors import UserError
from relaytrain.job.rundir import RunDir

TRAIN = "train"
PROGRAM = "program"


@dataclass(frozen=True)
class RunKind:
    kind: str  # TRAIN or PROGRAM
    command: str = ""  # a launched program's command (`launch --command`); "" when not known

    def describe(self) -> str:
        if self.kind == TRAIN:
            return "a relaytrain train run"
        if self.command:
            return f"the run of --command {self.command!r}"
        return "a program's run (relaytrain.program)"


def recorded_kind(run: RunDir) -> RunKind | None:
    """The kind of run the directory holds, or None when it holds none yet (or cannot tell)."""
    try:
        data = json.loads(run.kind.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict) and data.get("kind") in (TRAIN, PROGRAM):
        return RunKind(data["kind"], str(data.get("command") or ""))
    if run.config.is_file():  # the trainer's resolved config: a run from before run_kind.json
        return RunKind(TRAIN)
    return None


def claim_kind(run: RunDir, wanted: RunKind) -> None:
    """Refuse (UserError) a directory that holds another kind of run or another command's run; else
    record `wanted` where nothing (or no command) is recorded yet."""
    found = refuse_other_kind(run, wanted)
    path = run.kind
    if found is not None and path.exists() and (found.command or not wanted.command):
        return
    record = {"kind": wanted.kind, **({"command": wanted.command} if wanted.command else {})}
    write_atomic(path, json.dumps(record) + "\n", durable=False)


def refuse_other_kind(run: RunDir, wanted: RunKind) -> RunKind | None:
    """Raise UserError when the directory holds another kind of run, or another command's; return what
    it holds (None: nothing yet). Writes nothing."""
    found = recorded_kind(run)
    path = run.kind
    if found is not None and found.kind != wanted.kind:
        raise UserError(
            f"the run directory {run.root} holds {found.describe()}, not {wanted.describe()}: give this run "
            "its own name (--name NAME, or --run.name=NAME)"
        )
    if found is not None and found.command and wanted.command and found.command != wanted.command:
        raise UserError(
            f"the run directory {run.root} holds {found.describe()}, not {wanted.describe()}: give this run "
            f"its own name (--name NAME), or to continue that run with this command delete {path}"
        )
    return found
