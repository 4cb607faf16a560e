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
fsynced, and ``latest`` moves only after COMPLETE is durable.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from relaytrain.errors import UserError
from relaytrain.job.rundir import RunDir

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
_CHUNK = 16 << 20


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


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_durable(source: Path, target: Path) -> None:
    """Copy a file and fsync the copy (its size goes into COMPLETE, so it must be on disk first)."""
    shutil.copyfile(source, target)
    fsync_path(target)


def write_durable(path: Path, data: bytes) -> None:
    """Write via a temp file, fsync it, rename over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


CHECKSUM_KIND = "xxh3_64"  # what new manifests record; "crc32" in those written before 2026-11-23
CHECKSUM_KINDS = ("xxh3_64", "crc32")


class Checksum:
    """A file's checksum as a manifest records it, ``<kind>:<hex>``, computed as the bytes go by.

    New checkpoints record xxh3_64 (xxhash, ~25 GB/s on one core of this project's machine): a save and
    a load compute it on their critical path, where zlib's CRC-32 (~6 GB/s) cost a load 15-35 % of its
    time. Checkpoints written before record crc32 and are verified with it. Both catch the flipped bits
    and torn pages a size check cannot; neither is meant to resist a forger (the manifest sits beside).
    """

    def __init__(self, kind: str = CHECKSUM_KIND):
        if kind not in CHECKSUM_KINDS:
            raise ValueError(f"unknown checksum kind {kind!r}")
        self.kind = kind
        self._xxh = xxhash.xxh3_64() if kind == "xxh3_64" else None
        self._crc = 0

    @classmethod
    def like(cls, recorded: str | None) -> Checksum:
        """A checksum of the kind `recorded` is (None: the kind new checkpoints record); ValueError for a
        kind this relaytrain does not know."""
        return cls(recorded.partition(":")[0] if recorded else CHECKSUM_KIND)

    def update(self, data) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def text(self) -> str:
        if self._xxh is not None:
            return f"xxh3_64:{self._xxh.hexdigest()}"
        return f"crc32:{self._crc:08x}"


def bytes_checksum(data) -> str:
    checksum = Checksum()
    checksum.update(data)
    return checksum.text()


def file_checksum(path: Path, like: str | None = None) -> str:
    """The checksum of the file's content, of the kind `like` is (None: the kind new checkpoints record)."""
    checksum = Checksum.like(like)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            checksum.update(chunk)
    return checksum.text()


def matches(path: Path, recorded: str) -> bool:
    """Whether the file's content has the checksum a manifest recorded (an unknown kind: no)."""
    try:
        return file_checksum(path, like=recorded) == recorded
    except ValueError:
        return False


def is_data_file(rel: str) -> bool:
    """A DCP shard file (model and optimizer tensors): the bulk of a checkpoint."""
    return rel.endswith(".distcp") and "/" not in rel


def listed_checksums(step_dir: Path) -> dict[str, str]:
    """Relative path -> checksum as the COMPLETE manifest records them (empty for old manifests)."""
    try:
        listed = json.loads((step_dir / COMPLETE).read_text())["files"]
        return {rel: e["checksum"] for rel, e in listed.items() if isinstance(e, dict) and "checksum" in e}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return {}


def manifest(step_dir: Path, checksums: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Relative path -> size and checksum of every file in the step directory except COMPLETE;
    checksums already computed (by the ranks that wrote the files) are taken from `checksums`."""
    known = checksums or {}
    files = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != COMPLETE and not path.name.endswith(".tmp"):
            rel = str(path.relative_to(step_dir))
            checksum = known.get(rel) or file_checksum(path)
            files[rel] = {"size": path.stat().st_size, "checksum": checksum}
    return files


def write_complete(step_dir: Path, checksums: dict[str, str] | None = None) -> None:
    """Commit a step directory whose files are all durable: fsync its folders, then write COMPLETE."""
    for folder in [p for p in step_dir.rglob("*") if p.is_dir()] + [step_dir]:
        fsync_path(folder)
    listing = {"files": manifest(step_dir, checksums)}
    write_durable(step_dir / COMPLETE, json.dumps(listing, indent=1).encode())


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


def damaged_problems(step_dir: Path, verify: bool = True, data: bool = True) -> list[str]:
    """What is wrong with a committed step directory's files (empty: all match the manifest).

    `verify` also compares content checksums (reads every byte); otherwise only sizes are compared.
    `data=False` leaves the checksums of the DCP shard files to the load that reads them anyway
    (storage.RawReader compares them on the way). Checkpoints written before checksums existed list
    sizes only.
    """
    try:
        listed = json.loads((step_dir / COMPLETE).read_text())["files"]
        listed = {rel: e if isinstance(e, dict) else {"size": e} for rel, e in listed.items()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        return [f"unreadable {COMPLETE} marker ({exc})"]
    problems = []
    for rel, entry in listed.items():
        path = inside(step_dir, rel)
        if path is None:
            problems.append(f"its {COMPLETE} manifest names {rel!r}, which is not a file inside it")
        elif not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != entry.get("size"):
            problems.append(f"{rel} has {path.stat().st_size} bytes, expected {entry.get('size')}")
        elif (
            verify
            and entry.get("checksum")
            and (data or not is_data_file(rel))
            and not matches(path, entry["checksum"])
        ):
            problems.append(f"{rel} does not match its checksum (its content changed after the save)")
    return problems


def resolve_checkpoint(path: str | Path) -> Path:
    """A step dir, a checkpoints dir (its ``latest``) or a run dir (``checkpoints/latest``) -> step dir."""
    path = Path(path).expanduser()
    if (path / COMPLETE).is_file() or (path / DCP_METADATA).is_file():
        return path
    for ckpt_dir in (path, RunDir(path).checkpoints):
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


def choose_resume(
    ckpt_dir: Path, verify: bool = True, data: bool = True, skip: frozenset[Path] = frozenset()
) -> tuple[Path | None, str]:
    """The step dir to resume from and a sentence saying why; (None, why) when there is none.

    ``latest`` wins when it is committed; otherwise the newest committed step. Incomplete step
    directories (a save that was killed) are never chosen, and a committed one whose files do not match
    its manifest (sizes; content checksums with `verify`, of shard files too with `data`) is skipped for
    the one before it, with a warning naming the file; so are the step dirs in `skip` (resolved paths: a
    load found them damaged).
    """
    entries = list_steps(ckpt_dir)
    complete = [e for e in entries if e.complete]
    skipped = [e for e in entries if not e.complete and (not complete or e.step > complete[-1].step)]
    for entry in skipped:
        log.warning(
            "skipping incomplete checkpoint %s (no %s marker: its save was interrupted)", entry.path, COMPLETE
        )
    latest = read_latest(ckpt_dir)
    candidates: list[tuple[Path, str]] = []
    if latest is not None and (latest / COMPLETE).is_file():
        newest = complete[-1].path if complete else latest
        if newest.resolve() != latest.resolve():
            log.warning(
                "latest points to %s but %s is newer and complete; using latest", latest.name, newest.name
            )
        candidates.append((latest, f"'latest' points to {latest.name}"))
        latest_step = int(_STEP_RE.match(latest.name).group(1))
        older = [e for e in complete if e.step < latest_step]
    else:
        why = "no 'latest' link" if latest is None else f"'latest' points to {latest.name}, not complete"
        older = complete
    for entry in reversed(older):
        reason = why if not candidates else "the checkpoints after it are damaged"
        candidates.append((entry.path, f"{reason}; using the newest complete checkpoint {entry.path.name}"))
    for path, reason in candidates:
        if path.resolve() in skip:
            continue
        problems = damaged_problems(path, verify, data)
        if not problems:
            return path, reason
        log.warning("skipping damaged checkpoint %s: %s", path, "; ".join(problems[:3]))
    if not complete:
        return None, f"no complete checkpoint in {ckpt_dir}"
    return None, f"every complete checkpoint in {ckpt_dir} is damaged"


def data_problems(step_dir: Path, checked: set[str]) -> list[str]:
    """Shard files whose content differs from the manifest, among those a load did not already check
    while reading them (files read in part, or written by torch's own writer)."""
    problems = []
    for rel, checksum in listed_checksums(step_dir).items():
        path = inside(step_dir, rel)
        if is_data_file(rel) and rel not in checked and path is not None and not matches(path, checksum):
            problems.append(f"{rel} does not match its checksum (its content changed after the save)")
    return problems
