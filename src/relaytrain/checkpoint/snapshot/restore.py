"""Restoring the newest usable snapshot at the start of a run, before the DCP checkpoint is looked at.

Rank 0 gathers which snapshot files every rank's node holds and picks the newest step for which every
rank's file is on some node; a step is used only when it is newer than the newest complete checkpoint,
was taken with this world size and this config (a different world size falls back to DCP, which
reshards). Each rank reads its own file from its node, or receives it from a rank that holds it (its
replica on another node), checks it against the checksum its writer recorded and decodes it; a damaged
or partial step is reported in one line and skipped for the one before it. Afterwards the node folders
keep nothing newer than what the run continues from.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from relaytrain.checkpoint.collectives import Collectives
from relaytrain.checkpoint.files import list_steps
from relaytrain.checkpoint.snapshot import store
from relaytrain.checkpoint.snapshot.format import SnapshotFormatError, _local, decode
from relaytrain.checkpoint.snapshot.peers import all_gather, as_bytes_tensor, recv_blob, send_blob
from relaytrain.checkpoint.training_state import TrainingState

log = logging.getLogger("relaytrain.checkpoint")


class RestoredSnapshot(NamedTuple):
    step: int
    peer_files: int  # rank files fetched from a peer node (0: every rank's own node had its file)

    @property
    def tier(self) -> str:
        """Where the state came from, as the time ledger names it."""
        return "peer node" if self.peer_files else "node memory"


def restore_snapshot(
    state: TrainingState,
    coll: Collectives,
    node_dir: Path,
    node_leader: bool,
    ckpt_dir: Path,
    config_hash: str,
) -> RestoredSnapshot | None:
    """Into `state`, from this rank's node folder `node_dir` (`node_leader`: this rank trims it) or a peer:
    the step restored and how many rank files came from a peer node, or None when the run resumes from
    DCP (or fresh)."""
    rank, world_size = coll.rank, coll.world_size
    reports = all_gather(store.holdings(node_dir), coll.ctrl, world_size)
    damaged: set[int] = set()
    restored = None
    while restored is None:
        plan = coll.on_rank0(lambda: _plan(reports, ckpt_dir, world_size, config_hash, damaged))
        if plan is None:
            break
        step, sources, checksums = plan["step"], plan["sources"], plan["checksums"]
        tree, problem = None, None
        try:
            blob = _fetch(coll, store.step_dir(node_dir, step), sources)
            if blob is None or store.checksum_of(blob, checksums[rank]) != checksums[rank]:
                where = "its own node" if sources[rank] == rank else f"rank {sources[rank]}'s node"
                problem = f"rank {rank}'s file (from {where}) does not match its checksum"
            else:
                _, tree = decode(blob)
        except (OSError, SnapshotFormatError, RuntimeError) as exc:
            problem = f"rank {rank}'s file: {exc}"
        problems = [p for p in all_gather(problem, coll.ctrl, world_size) if p]
        if not problems:
            try:
                _load(state, tree)
            except (KeyError, ValueError, TypeError, RuntimeError) as exc:
                problem = f"rank {rank}: {exc}"
            problems = [p for p in all_gather(problem, coll.ctrl, world_size) if p]
            if problems:  # same config hash, so a bug: the state may be half loaded, never train on it
                found = "; ".join(problems[:2])
                raise RuntimeError(f"the snapshot of step {step} does not fit this run: {found}")
            restored = step
            break
        if rank == 0:
            log.warning("skipping the damaged snapshot of step %d: %s", step, "; ".join(problems[:3]))
        damaged.add(step)
    coll.barrier()  # every rank read what it needed before the node folders are trimmed
    if node_leader:
        forget_after(node_dir, restored or 0)
    if restored is None:
        return None
    fetched = sum(1 for dst, src in plan["sources"].items() if src != dst)
    if rank == 0:
        log.info(
            "resuming from the snapshot of step %d in node memory (%d of %d rank file(s) from a peer "
            "node): newer than the newest checkpoint",
            restored,
            fetched,
            world_size,
        )
    return RestoredSnapshot(restored, fetched)


def _plan(reports: list[dict], ckpt_dir: Path, world_size: int, config_hash: str, damaged: set[int]):
    """Rank 0: the newest usable step, where each rank's file comes from, its checksum; None: use DCP."""
    newest = max((e.step for e in list_steps(ckpt_dir) if e.complete), default=0)
    steps = sorted({s for report in reports for s in report}, reverse=True)
    for step in steps:
        if step <= newest:
            log.info(
                "the newest usable snapshot (step %d) is not newer than the checkpoint of step %d: "
                "resuming from the checkpoint",
                step,
                newest,
            )
            return None
        if step in damaged:
            continue
        entries: dict[int, tuple[int, dict[str, Any]]] = {}
        for holder, report in enumerate(reports):
            for rank, entry in report.get(step, {}).items():
                if rank not in entries or rank == holder:
                    entries[rank] = (holder, entry)
        sample = next(iter(entries.values()))[1]
        if sample.get("world_size") != world_size:
            log.info(
                "the snapshot of step %d was taken with world size %s, this run has %d: resuming from the "
                "checkpoint instead, which reshards",
                step,
                sample.get("world_size"),
                world_size,
            )
            return None
        if sample.get("config_hash") != config_hash:
            log.info("the config changed since the snapshot of step %d: resuming from the checkpoint", step)
            return None
        missing = [r for r in range(world_size) if r not in entries]
        if missing:
            log.warning(
                "skipping the partial snapshot of step %d: no node holds the file of rank(s) %s",
                step,
                ", ".join(map(str, missing)),
            )
            continue
        return {
            "step": step,
            "sources": {r: entries[r][0] for r in range(world_size)},
            "checksums": {r: entries[r][1]["checksum"] for r in range(world_size)},
        }
    if steps:
        log.info("no snapshot newer than the checkpoints is complete: resuming from the checkpoint")
    return None


def _fetch(coll: Collectives, step_path: Path, sources: dict[int, int]):
    """This rank's snapshot bytes: from its node's folder (`step_path`: the step's there), or sent by the
    rank that holds them. Every rank walks the same list of transfers in the same order, so each send
    meets its receive."""
    rank = coll.rank
    mine = None
    for dst in sorted(sources):
        src = sources[dst]
        if src == dst or rank not in (src, dst):
            continue
        if rank == src:
            try:
                data = store.read_file(step_path, dst)
            except OSError:
                data = b""  # the receiver's checksum check reports it
            for work in send_blob([as_bytes_tensor(data)], "", dst, coll.ctrl):
                work.wait()
        else:
            parts, _ = recv_blob(src, 1, coll.ctrl)
            mine = parts[0]
    if sources[rank] == rank:
        mine = store.read_file(step_path, rank)
    return mine


def _fill(target: dict[str, Any], saved: dict[str, Any], what: str) -> None:
    if set(target) != set(saved):
        differ = sorted(set(target) ^ set(saved))[:3]
        raise ValueError(f"its {what} entries differ from this run's ({', '.join(differ)})")
    for key, value in target.items():
        if isinstance(value, torch.Tensor):
            local = _local(value)
            if tuple(local.shape) != tuple(saved[key].shape) or local.dtype != saved[key].dtype:
                raise ValueError(f"{key}: snapshot {list(saved[key].shape)} vs this run {list(local.shape)}")
            if local.device.type == "cpu" and local.is_contiguous():
                # numpy's copy: torch's copy_ wakes its thread pool for every tensor (see format.Staging)
                np.copyto(_bytes(local), _bytes(saved[key].contiguous()))
            else:
                with torch.no_grad():
                    local.copy_(saved[key])
        else:
            target[key] = saved[key]


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _load(state: TrainingState, tree: dict[str, Any]) -> None:
    """The decoded tree into `state`: its tensors copied into the load target's, then loaded as a tree."""
    target = state.load_target(optimizer="optim" in tree)
    for key in target:
        _fill(target[key], tree[key], key)
    state.load_state_dict({**target, "states": tree["states"]})


def forget_after(node_dir: Path, step: int) -> None:
    """Snapshots newer than where the run continues belong to a line it abandoned: remove them."""
    for path in node_dir.glob("step-*") if node_dir.is_dir() else []:
        number = path.name.removeprefix("step-")
        if number.isdigit() and int(number) > step:
            shutil.rmtree(path, ignore_errors=True)
