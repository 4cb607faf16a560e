"""The on-disk layout of a checkpoint directory and the durable, atomic operations on it.

    <checkpoint dir>/
        step_<N>/                   one checkpoint
            .metadata, __<r>_<t>.distcp torch.distributed.checkpoint files (model, optimizer; storage.py)
            train_state/rank_<r>.pt     per-rank registry of states (train state, data position, RNG)
            metadata.json               step, reason, config hash, parallel dims, world size, versions
            config.toml                 the full config of the run that wrote it
            tokenizer.json              copy of the run's tokenizer file (HF tokenizers only)
            COMPLETE                    written last: a manifest of every file, its size and checksum
        latest -> step_<N>          symlink to the newest committed checkpoint, swapped atomically

A step directory counts only once COMPLETE exists; COMPLETE is written after every rank's files are
fsynced (checksums.write_complete), and ``latest`` moves only after COMPLETE is durable. Which step
directory a run resumes from is choose.py's decision.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaytrain.atomic import fsync_path, replacing
from relaytrain.errors import UserError

log = logging.getLogger("relaytrain.checkpoint")

COMPLETE = "COMPLETE"
METADATA = "metadata.json"
CONFIG = "config.toml"
TOKENIZER = "tokenizer.json"
TRAIN_STATE_DIR = "train_state"
LATEST = "latest"
DCP_METADATA = ".metadata"
FORMAT_NAME = "relaytrain-checkpoint"
FORMAT_VERSION = 2  # 2: train_state/rank_<r>.pt holds a registry of named states (RNG once)

_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def step_number(name: str) -> int | None:
    """N of a ``step_<N>`` directory name; None for any other name."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def train_state_file(step_dir: Path, rank: int) -> Path:
    return step_dir / TRAIN_STATE_DIR / f"rank_{rank}.pt"


@dataclass(frozen=True)
class StepEntry:
    step: int
    path: Path
    complete: bool


def list_steps(ckpt_dir: Path) -> list[StepEntry]:
    """Every ``step_<N>`` directory, oldest first, with whether it is committed."""
    if not ckpt_dir.is_dir():
        return []
    entries = []
    for child in ckpt_dir.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            entries.append(StepEntry(int(match.group(1)), child, (child / COMPLETE).is_file()))
    return sorted(entries, key=lambda e: e.step)


def read_latest(ckpt_dir: Path) -> Path | None:
    """Where ``latest`` points (it may point to a missing or damaged directory), or None.

    relaytrain only ever points it at a sibling ``step_<N>``; any other target (absolute, ``..``) is
    ignored, so that a checkpoint directory never leads a load outside itself.
    """
    link = ckpt_dir / LATEST
    if not link.is_symlink():
        return None
    target = os.readlink(link)
    if not _STEP_RE.match(target):
        log.warning("ignoring %s: it points to %r, not to a step_<N> directory beside it", link, target)
        return None
    return ckpt_dir / target


def copy_durable(source: Path, target: Path) -> None:
    """Copy a file and fsync the copy (its size goes into COMPLETE, so it must be on disk first)."""
    shutil.copyfile(source, target)
    fsync_path(target)


def point_latest(ckpt_dir: Path, step_dir: Path) -> None:
    """Atomically make ``latest`` point to `step_dir` (a relative symlink swapped with os.replace)."""
    with replacing(ckpt_dir / LATEST, durable=True) as tmp:
        os.symlink(step_dir.name, tmp)


def remove_step_dir(step_dir: Path) -> None:
    """Delete a checkpoint so that a crash half-way leaves an incomplete dir, never a damaged complete one."""
    marker = step_dir / COMPLETE
    if marker.exists():
        marker.unlink()
        fsync_path(step_dir)
    shutil.rmtree(step_dir, ignore_errors=True)


def read_metadata(step_dir: Path) -> dict[str, Any]:
    path = step_dir / METADATA
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(
            f"checkpoint {step_dir} has no readable {METADATA} ({exc}); it is not a "
            "relaytrain checkpoint or it is damaged"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise UserError(f"{path} is not relaytrain checkpoint metadata")
    return data


def inside(step_dir: Path, rel: Any) -> Path | None:
    """`step_dir / rel` when `rel` names a regular file path inside `step_dir` (not absolute, no ``..``,
    not a symbolic link); None otherwise."""
    if not isinstance(rel, str) or not rel or "\\" in rel:
        return None
    parts = Path(rel).parts
    if Path(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        return None
    path = step_dir / rel
    return None if path.is_symlink() else path
