"""File checksums and the COMPLETE manifest that records them.

A committed step directory's COMPLETE marker lists every file with its size and checksum
(`write_complete`, the commit); a load checks the directory against it (`damaged_problems`,
`data_problems`) and storage.py checks DCP shard files with `Checksum` while reading them.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import xxhash

from relaytrain.atomic import fsync_path, write_atomic
from relaytrain.checkpoint.files import COMPLETE, inside

_CHUNK = 16 << 20

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
    write_atomic(step_dir / COMPLETE, json.dumps(listing, indent=1), durable=True)


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


def data_problems(step_dir: Path, checked: set[str]) -> list[str]:
    """Shard files whose content differs from the manifest, among those a load did not already check
    while reading them (files read in part, or written by torch's own writer)."""
    problems = []
    for rel, checksum in listed_checksums(step_dir).items():
        path = inside(step_dir, rel)
        if is_data_file(rel) and rel not in checked and path is not None and not matches(path, checksum):
            problems.append(f"{rel} does not match its checksum (its content changed after the save)")
    return problems
