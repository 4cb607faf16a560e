"""Where snapshots live on a node, and their files.

``<checkpoint.snapshot_dir>/relaytrain-<job key>/<node>/step-<N>/rank-<r>.snap`` and beside it
``rank-<r>.json``, the file's manifest entry (size, xxh3 checksum, step, rank, world size, config hash),
written after the snapshot file is complete: a snapshot file without its entry is a write that did not
finish and is never read. The job key holds the Slurm job id (kept by a requeue) and a hash of the run
directory, so a job never reads another job's or another run's snapshots; the node folder keeps a node's
own files apart even where several nodes share one file system (it is the node's memory on a real
cluster, where `/dev/shm` is local to each node).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
from pathlib import Path
from typing import Any

from relaytrain.atomic import write_chunks
from relaytrain.checkpoint.checksums import Checksum
from relaytrain.job import marks
from relaytrain.job.facts import JobFacts

log = logging.getLogger("relaytrain.checkpoint")

PREFIX = "relaytrain-"
_STEP = re.compile(r"^step-(\d+)$")
_ENTRY = re.compile(r"^rank-(\d+)\.json$")


def _run_hash(run_dir: Path) -> str:
    return hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:10]


def job_key(run_dir: Path, job: JobFacts | None = None) -> str:
    """``job<id>-<run hash>`` in a Slurm job, ``local-<run hash>`` outside."""
    job = job or JobFacts.from_env()
    run_hash = _run_hash(run_dir)
    return f"job{job.job_id}-{run_hash}" if job.in_slurm else f"local-{run_hash}"


def job_root(snapshot_dir: str | Path, run_dir: Path, job: JobFacts | None = None) -> Path:
    return Path(snapshot_dir) / f"{PREFIX}{job_key(run_dir, job)}"


def step_dir(node_dir: Path, step: int) -> Path:
    return node_dir / f"step-{step}"


def snapshot_file(step_path: Path, rank: int) -> Path:
    return step_path / f"rank-{rank}.snap"


def entry_file(step_path: Path, rank: int) -> Path:
    return step_path / f"rank-{rank}.json"


def _durable(path: Path, chunks) -> tuple[int, str]:
    """Write `chunks` to `path` durably and atomically; (size, checksum)."""
    checksum, size = Checksum(), 0

    def counted():
        nonlocal size
        for chunk in chunks:
            checksum.update(chunk)
            size += len(chunk)
            yield chunk
            marks.mark()  # a chunk written: progress of the snapshot (or its restore's replica)

    write_chunks(path, counted(), durable=True)
    return size, checksum.text()


def write_snapshot(step_path: Path, rank: int, chunks, meta: dict[str, Any]) -> dict[str, Any]:
    """Write rank `rank`'s snapshot file (its own, or a peer's replica), then its manifest entry."""
    step_path.mkdir(parents=True, exist_ok=True)
    size, checksum = _durable(snapshot_file(step_path, rank), chunks)
    entry = {**meta, "rank": rank, "size": size, "checksum": checksum}
    _durable(entry_file(step_path, rank), [json.dumps(entry).encode()])
    return entry


def holdings(node_dir: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """step -> rank -> manifest entry of every snapshot file in this node's folder whose write finished
    (entry present, file of the recorded size). Content checksums are checked by the restore."""
    found: dict[int, dict[int, dict[str, Any]]] = {}
    if not node_dir.is_dir():
        return found
    for step_path in node_dir.iterdir():
        match = _STEP.match(step_path.name)
        if not match or not step_path.is_dir():
            continue
        for path in step_path.iterdir():
            ranked = _ENTRY.match(path.name)
            if not ranked:
                continue
            try:
                entry = json.loads(path.read_text())
                rank = int(ranked.group(1))
                data = snapshot_file(step_path, rank)
                if int(entry["step"]) != int(match.group(1)) or int(entry["rank"]) != rank:
                    continue
                if data.is_file() and data.stat().st_size == int(entry["size"]):
                    found.setdefault(int(match.group(1)), {})[rank] = entry
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return found


def read_file(step_path: Path, rank: int) -> mmap.mmap | bytearray:
    """A snapshot file's bytes, mapped copy-on-write: on a tmpfs the node's memory itself, read with no
    copy and no allocation; writable (decode's tensors view it) without ever changing the file. Files
    are replaced by a rename, never truncated, so a mapping stays whole even if the file is deleted."""
    with open(snapshot_file(step_path, rank), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return bytearray()
        # No MAP_POPULATE: on a private writable mapping it copies every page (a write fault each); a
        # read fault maps the file's own page.
        return mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def read_verified(step_path: Path, rank: int, checksum: str) -> mmap.mmap | bytearray | None:
    """The file's bytes when they match `checksum`, else None."""
    try:
        data = read_file(step_path, rank)
    except OSError:
        return None
    return data if checksum_of(data, checksum) == checksum else None


def checksum_of(data: bytes | memoryview, like: str) -> str:
    sum_ = Checksum.like(like)
    sum_.update(data)
    return sum_.text()


def keep_from(node_dir: Path, oldest_kept: int) -> None:
    """Remove this node's step folders older than `oldest_kept` (a crash half-way only loses old ones)."""
    if not node_dir.is_dir():
        return
    for step_path in node_dir.iterdir():
        match = _STEP.match(step_path.name)
        if match and int(match.group(1)) < oldest_kept:
            shutil.rmtree(step_path, ignore_errors=True)


def job_dirs(snapshot_dir: str | Path, job_id: str) -> list[Path]:
    """The snapshot folders of Slurm job `job_id` under `snapshot_dir` (one per run of the job)."""
    base = Path(snapshot_dir)
    if not job_id or not base.is_dir():
        return []
    return [p for p in base.glob(f"{PREFIX}job{job_id}-*") if p.is_dir() and not p.is_symlink()]


def node_dirs(root: Path) -> list[Path]:
    """The node folders of a job folder (`job_root`)."""
    return [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []


def remove_rank(node_dir: Path, rank: int) -> list[Path]:
    """Remove every snapshot file of `rank` (its own or a replica) from a node folder, entry first."""
    removed = []
    for step in holdings(node_dir):
        step_path = step_dir(node_dir, step)
        for path in (entry_file(step_path, rank), snapshot_file(step_path, rank)):
            if path.exists():
                path.unlink()
                removed.append(path)
    return removed


def remove_earlier_jobs(snapshot_dir: str | Path, run_dir: Path, job: JobFacts | None = None) -> list[Path]:
    """Remove this run's snapshot folders of other Slurm jobs from this node: what an earlier job of the
    run left here (a job requeued onto other nodes cleans up only on the nodes of its last step). The
    run lock lets one job at a time run it, so they are never read again."""
    base, mine = Path(snapshot_dir), job_root(snapshot_dir, run_dir, job)
    if not base.is_dir():
        return []
    removed = [p for p in base.glob(f"{PREFIX}job*-{_run_hash(run_dir)}") if p != mine and not p.is_symlink()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def remove_job(snapshot_dir: str | Path, job_id: str) -> list[Path]:
    """Remove every snapshot folder of Slurm job `job_id` under `snapshot_dir` (all its runs)."""
    removed = job_dirs(snapshot_dir, job_id)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
