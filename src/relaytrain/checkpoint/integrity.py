"""Whether a run's checkpoints are what a resume needs: every committed one matches its manifest, and
`latest` names a committed one. `relaytrain verify` asks it; a load asks `choose.py` instead, which
skips a damaged checkpoint for an older one where this reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relaytrain.checkpoint.checksums import damaged_problems
from relaytrain.checkpoint.files import COMPLETE, LATEST, list_steps, read_latest


@dataclass(frozen=True)
class CheckpointReport:
    violations: list[str]
    checked: int  # committed checkpoints whose every file was read and compared
    latest: str | None  # the step directory `latest` names

    def summary(self) -> str:
        if not self.checked:
            return "no committed checkpoint"
        return f"{self.checked} committed checkpoint(s) match their checksums, {LATEST} -> {self.latest}"


def check_checkpoints(ckpt_dir: Path) -> CheckpointReport:
    """Every file of every committed step directory against its COMPLETE manifest (sizes and content
    checksums, shard files too), and `latest`. Uncommitted step directories (a save that was interrupted)
    are never loaded and are not violations."""
    committed = [entry for entry in list_steps(ckpt_dir) if entry.complete]
    problems = []
    for entry in committed:
        problems += [f"checkpoint {entry.path.name}: {p}" for p in damaged_problems(entry.path, True, True)]
    latest = read_latest(ckpt_dir)
    if committed and latest is None:
        problems.append(f"{ckpt_dir / LATEST} does not point to a step directory")
    elif latest is not None and not (latest / COMPLETE).is_file():
        problems.append(f"{LATEST} points to {latest.name}, which is not a committed checkpoint")
    return CheckpointReport(problems, len(committed), latest.name if latest is not None else None)
