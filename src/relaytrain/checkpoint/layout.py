"""The on-disk layout of a checkpoint directory and the durable, atomic operations on it.

    <checkpoint dir>/
        step_<N>/                   one checkpoint
            .metadata, __<r>_0.distcp   torch.distributed.checkpoint files (model, optimizer)
            train_state/rank_<r>.pt     per-rank train state (step, data position, scheduler, RNG)
            metadata.json               step, reason, config hash, layout, world size, versions, time
            config.toml                 the full config of the run that wrote it
            tokenizer.json              copy of the run's tokenizer file (HF tokenizers only)
            COMPLETE                    written last: a manifest of every file and its size
        latest -> step_<N>          symlink to the newest committed checkpoint, swapped atomically

A step directory counts only once COMPLETE exists; COMPLETE is written after every rank's files are
fsynced, and ``latest`` moves only after COMPLETE is durable.
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
FORMAT_VERSION = 1

_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


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
    """Where ``latest`` points (it may point to a missing or damaged directory), or None."""
    link = ckpt_dir / LATEST
    if not link.is_symlink():
        return None
    return ckpt_dir / os.readlink(link)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write via a temp file, fsync it, rename over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def manifest(step_dir: Path) -> dict[str, int]:
    """Relative path -> size of every file in the step directory except COMPLETE."""
    files = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != COMPLETE and not path.name.endswith(".tmp"):
            files[str(path.relative_to(step_dir))] = path.stat().st_size
    return files


def write_complete(step_dir: Path) -> None:
    """Commit a step directory whose files are all durable: fsync its folders, then write COMPLETE."""
    for folder in [p for p in step_dir.rglob("*") if p.is_dir()] + [step_dir]:
        fsync_path(folder)
    write_durable(step_dir / COMPLETE, json.dumps({"files": manifest(step_dir)}, indent=1).encode())


def point_latest(ckpt_dir: Path, step_dir: Path) -> None:
    """Atomically make ``latest`` point to `step_dir` (a relative symlink swapped with os.replace)."""
    tmp = ckpt_dir / f".{LATEST}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(step_dir.name, tmp)
    os.replace(tmp, ckpt_dir / LATEST)
    fsync_path(ckpt_dir)


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


def damaged_problems(step_dir: Path) -> list[str]:
    """What is wrong with a committed step directory's files (empty: sizes match the manifest)."""
    try:
        listed = json.loads((step_dir / COMPLETE).read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"unreadable {COMPLETE} marker ({exc})"]
    problems = []
    for rel, size in listed.items():
        path = step_dir / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel} has {path.stat().st_size} bytes, expected {size}")
    return problems


def resolve_checkpoint(path: str | Path) -> Path:
    """A step dir, a checkpoints dir (its ``latest``) or a run dir (``checkpoints/latest``) -> step dir."""
    path = Path(path).expanduser()
    if (path / COMPLETE).is_file() or (path / DCP_METADATA).is_file():
        return path
    for ckpt_dir in (path, path / "checkpoints"):
        if (ckpt_dir / LATEST).is_symlink() or list_steps(ckpt_dir):
            chosen, _ = choose_resume(ckpt_dir)
            if chosen is None:
                raise UserError(f"{ckpt_dir} holds no complete checkpoint")
            return chosen
    if not path.exists():
        raise UserError(f"checkpoint path {path} does not exist")
    raise UserError(
        f"{path} is not a checkpoint: give a step_<N> directory, a checkpoints directory or a run directory"
    )


def choose_resume(ckpt_dir: Path) -> tuple[Path | None, str]:
    """The step dir to resume from and a sentence saying why; (None, why) when there is none.

    ``latest`` wins when it is committed; otherwise the newest committed step. Incomplete step
    directories (a save that was killed) are never chosen.
    """
    entries = list_steps(ckpt_dir)
    complete = [e for e in entries if e.complete]
    skipped = [e for e in entries if not e.complete and (not complete or e.step > complete[-1].step)]
    for entry in skipped:
        log.warning(
            "skipping incomplete checkpoint %s (no %s marker: its save was interrupted)", entry.path, COMPLETE
        )
    latest = read_latest(ckpt_dir)
    if latest is not None and (latest / COMPLETE).is_file():
        newest = complete[-1].path if complete else latest
        if newest.resolve() != latest.resolve():
            log.warning(
                "latest points to %s but %s is newer and complete; using latest", latest.name, newest.name
            )
        return latest, f"'latest' points to {latest.name}"
    if not complete:
        return None, f"no complete checkpoint in {ckpt_dir}"
    why = "no 'latest' link" if latest is None else f"'latest' points to {latest.name}, which is not complete"
    return complete[-1].path, f"{why}; using the newest complete checkpoint {complete[-1].path.name}"
