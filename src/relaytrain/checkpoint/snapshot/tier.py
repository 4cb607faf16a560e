"""SnapshotTier: the persistence front's in-memory tier (take, restore, clean up); `front.py` decides
when each runs, beside the DCP tier.

At each snapshot step (the front's `SnapshotPacing` picks them) each rank copies its training state (the
`TrainingState`'s tree: model and optimizer shards, train state, data position, RNG) into a host buffer
allocated once per run (`prepare`: in the background at start-up, sized from the state) and reused. Host
tensors are copied at once; device tensors by copies the step only launches (format.Staging): they run
beside the next step's forward and backward, which do not change the state, and the next optimizer step
waits for them only if they are still running (`before_update`). A background thread waits for them,
then sends the snapshot to the rank's peers on other nodes (`peers.py`) and writes it, and the peers'
copies, into the node's snapshot folder (`store.py`). The next snapshot first waits for that thread (so
the buffer is never refilled before it was written); the ranks then agree that the previous step was
written everywhere, and only then is the one before it deleted, so the newest step every rank finished
always survives. That one agreement (an all-reduce of the maximum) also carries the previous
snapshot's measured figures, its blocking copy, background work and the wait for it, and the pacing's
step figures: every rank gets the same numbers, and an automatic interval chosen from them is the same on
every rank.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from relaytrain.checkpoint.checksums import Checksum
from relaytrain.checkpoint.collectives import Collectives
from relaytrain.checkpoint.host import DeviceCopy
from relaytrain.checkpoint.snapshot import store
from relaytrain.checkpoint.snapshot.format import Staged, Staging, layout_bytes, tensors_of
from relaytrain.checkpoint.snapshot.peers import Ring, all_gather, as_bytes_tensor, recv_blob, send_blob
from relaytrain.checkpoint.snapshot.restore import forget_after, restore_snapshot
from relaytrain.checkpoint.training_state import TrainingState
from relaytrain.config.schema import CheckpointConfig
from relaytrain.job.facts import JobFacts
from relaytrain.job.rundir import RunDir

log = logging.getLogger("relaytrain.checkpoint")

FORMAT = 1


class SnapshotTier:
    """Called by every rank at the same points: `restore` at start, `take` after each step, `close`. Built
    by the front only when snapshots are on; it runs on the front's collectives (`replica_group`: its
    writer thread's transfers)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run: RunDir,
        config_hash: str,
        state: TrainingState,
        collectives: Collectives,
        copy: DeviceCopy | None = None,
    ):
        self.cfg = cfg
        self.on = True  # until `close`
        self.restored_from = ""  # after `restore`: "node memory" or "peer node" when a snapshot was loaded
        self.config_hash = config_hash
        self.state = state
        self._coll = collectives
        rank, world_size = collectives.rank, collectives.world_size
        self.rank, self.world_size = rank, world_size
        self.last: dict[str, float] = {}  # the newest snapshot: blocking_s, waited_s, bytes (rank 0 logs)
        self._waited = 0.0  # of its blocking_s, the wait for the previous snapshot's background work
        # its write, once done: replicate_s, replicated_bytes, write_s, background_s
        self.written: dict[str, float] = {}
        job = JobFacts.from_env()
        self.root = store.job_root(cfg.snapshot_dir, run.root, job)
        self.ring = Ring.of(all_gather(job.host(), self._coll.ctrl, world_size), cfg.snapshot_replicas)
        self.node_dir = self.root / self.ring.hosts[rank]
        self.targets, self.sources = self.ring.targets(rank), self.ring.sources(rank)
        if self.ring.is_node_leader(rank):
            for stale in store.remove_earlier_jobs(cfg.snapshot_dir, run.root, job):
                log.info("removed the snapshots an earlier job of this run left on this node: %s", stale)
        if rank == 0:
            nodes = len(self.ring.nodes)
            clipped = (
                f" (clipped from {cfg.snapshot_replicas}: {nodes} node(s), ranks on one node are no "
                "replica of each other)"
                if self.ring.degree < cfg.snapshot_replicas
                else ""
            )
            log.info(
                "snapshots %s in %s on each node, %d replica(s) on other nodes%s",
                _pace(cfg),
                self.root,
                self.ring.degree,
                clipped,
            )
        self._staging = Staging(copy)
        self._copying: Staged | None = None  # the newest snapshot, until the optimizer step after it
        self.held_back = 0  # optimizer steps that found the newest snapshot's copies still running
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="relaytrain-snapshot")
        self._pending: tuple[int, Future] | None = None
        self._taken = 0  # the newest step snapshotted
        self.background_ended = 0.0  # when the newest snapshot's background work ended (perf_counter)

    # -- taking snapshots ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """At start-up, after any restore: allocate the host buffer in the background, sized from the
        state (with the moments a never-stepped Adam will have). Local: no collective."""
        tensors = tensors_of(self.state.state_dict(optimizer=False))
        nbytes = layout_bytes(tensors) + optimizer_bytes(self.state.optimizers)
        # headroom for what the estimate leaves out (an optimizer's scalars, a component's tensors)
        nbytes += nbytes // 100 + (1 << 20)
        self._staging.reserve(nbytes, pin=any(t.device.type != "cpu" for t in tensors))

    def before_update(self) -> bool:
        """Before the optimizer step changes the state: the newest snapshot's device copies, when still
        running, are waited for by the device (the step's kernels queue behind them; the host goes on).
        Whether they were still running."""
        staged, self._copying = self._copying, None
        if staged is None or not staged.hold_back():
            return False
        self.held_back += 1
        return True

    def take(self, step: int, figures: dict[str, float] | None = None) -> dict[str, float] | None:
        """Snapshot `step` (every rank, at the same step); the previous snapshot's settled figures
        (`settle`), `figures` (the pacing's) agreed with them, or None when none was pending."""
        started = time.perf_counter()
        prune, settled = self._settle(figures)
        waited = time.perf_counter() - started
        if step <= self._taken and self.ring.is_node_leader(self.rank):
            forget_after(self.node_dir, step - 1)  # a rollback went back: those steps are another line
        self._taken = step
        tree = self.state.state_dict(optimizer=self._coll.any(self.state.has_optimizer_state()))
        meta = {"format": FORMAT, "step": step, "world_size": self.world_size}
        meta["config_hash"] = self.config_hash
        staged = self._copying = self._staging.stage(tree, meta)  # the buffer's last snapshot was written
        self.written = {}
        self._pending = (step, self._writer.submit(self._background, step, staged, meta, prune))
        # waited_s: of blocking_s, the wait for the previous snapshot's background work (and the ranks'
        # agreement on its figures); the rest is the copy of this one
        blocking = time.perf_counter() - started
        self.last = {"blocking_s": blocking, "waited_s": waited, "bytes": float(staged.size)}
        self._waited = settled["overran_s"] if settled else 0.0
        if self.rank == 0:
            log.info(
                "snapshot step %d: training blocked %.3fs, %.1f MB per rank",
                step,
                self.last["blocking_s"],
                staged.size / 1e6,
            )
        return settled

    @property
    def background_running(self) -> bool:
        """Whether the newest snapshot's background work (replication, writes) is still running."""
        return self._pending is not None and not self._pending[1].done()

    @property
    def background_ended_at(self) -> float | None:
        """When (`time.perf_counter`) the newest snapshot's background work ended; None while it runs."""
        return None if self.background_running else self.background_ended

    def _settle(self, figures: dict[str, float] | None = None) -> tuple[int, dict[str, float] | None]:
        """Wait for the previous snapshot's write. (When every rank finished it, the step before which this
        node's snapshots may go (0: none may); its figures and `figures`, the maximum over ranks: `step`,
        blocking_s and waited_s (of its take), background_s, replicate_s, write_s, overran_s (this wait
        for it), or None when none was pending.)"""
        if self._pending is None:
            return 0, None
        step, future = self._pending
        self._pending = None
        failed = None
        waiting, overran = time.perf_counter(), not future.done()  # done: the work fit, no wait
        try:
            future.result()
        except Exception as exc:  # a full tmpfs costs this snapshot, never the training run
            failed = exc
            log.error("snapshot step %d failed on rank %d: %s", step, self.rank, exc)
        mine = {"failed": float(failed is not None), "blocking_s": self.last.get("blocking_s", 0.0)}
        mine |= {"waited_s": self._waited, "overran_s": time.perf_counter() - waiting if overran else 0.0}
        mine |= {key: self.written.get(key, 0.0) for key in ("background_s", "replicate_s", "write_s")}
        mine |= figures or {}
        agreed = dict(zip(mine, self._coll.max_of(list(mine.values())), strict=True))
        prune = step if not agreed.pop("failed") and self.ring.is_node_leader(self.rank) else 0
        return prune, {"step": float(step), **agreed}

    def _background(self, step: int, staged: Staged, meta: dict[str, Any], prune: int) -> None:
        """`_write`, its end time kept before the future says done (`background_ended_at`)."""
        try:
            self._write(step, staged, meta, prune)
        finally:
            self.background_ended = time.perf_counter()

    def _write(self, step: int, staged: Staged, meta: dict[str, Any], prune: int) -> None:
        """On the writer thread: delete what `_settle` allows, send to the peers (before writing: a failed
        local write never leaves a peer waiting), then write this rank's file and the replicas it got."""
        began = time.perf_counter()
        staged.wait()  # the device copies (launched by `take`) are done: the buffer may be read
        copied = time.perf_counter()
        if prune:
            store.keep_from(self.node_dir, prune)
        chunks = staged.chunks()
        checksum = _checksum(chunks)
        started, works = time.perf_counter(), []
        for dst in self.targets:
            parts = [as_bytes_tensor(staged.header), staged.data]
            works += send_blob(parts, checksum, dst, self._coll.replica_group)
        received = [(src, *recv_blob(src, 2, self._coll.replica_group)) for src in self.sources]
        for work in works:
            work.wait()
        replicated = time.perf_counter()
        step_path = store.step_dir(self.node_dir, step)
        entry = store.write_snapshot(step_path, self.rank, chunks, meta)
        if entry["checksum"] != checksum:
            raise OSError(f"snapshot of step {step} changed while it was written")
        for src, parts, sent_checksum in received:
            replica = store.write_snapshot(step_path, src, parts, {**meta, "rank": src})
            if replica["checksum"] != sent_checksum:
                store.entry_file(step_path, src).unlink(missing_ok=True)
                raise OSError(f"the replica of rank {src}'s snapshot of step {step} arrived damaged")
        self.written = {
            "copy_s": copied - began,  # the wait for the device copies (none for host tensors)
            "replicate_s": replicated - started,  # sending to the peers and receiving theirs, both ways
            "replicated_bytes": float(staged.size * len(self.targets)),
            "write_s": time.perf_counter() - replicated,  # this rank's file and the replicas it received
            "background_s": time.perf_counter() - began,  # all of it, the pruning of old steps too
        }

    def settle(self, figures: dict[str, float] | None = None) -> dict[str, float] | None:
        """Every rank: wait until the newest snapshot is written here and on the peers (as the next `take`
        would, a collective); its figures agreed with `figures` (see `_settle`)."""
        if not self.on:
            return None
        prune, settled = self._settle(figures)
        if prune:
            store.keep_from(self.node_dir, prune)
        return settled

    def wait(self) -> dict[str, float]:
        """`settle`; this rank's timings of the write (`written`)."""
        self.settle()
        return dict(self.written)

    # -- restoring ------------------------------------------------------------------------------------

    def restore(self, ckpt_dir: Path) -> int | None:
        """Load the newest snapshot every shard of which is on some node, when it is newer than the newest
        complete checkpoint in `ckpt_dir` and from this world size; its step, or None (then: DCP)."""
        if not self.on or self.cfg.resume != "auto":
            return None
        leader = self.ring.is_node_leader(self.rank)
        restored = restore_snapshot(self.state, self._coll, self.node_dir, leader, ckpt_dir, self.config_hash)
        if restored is None:
            return None
        self.restored_from = restored.tier
        return restored.step

    # -- the end ----------------------------------------------------------------------------------------

    def close(self, finished: bool) -> None:
        """Wait for the pending write; when the run finished, delete this node's snapshots."""
        if not self.on:
            return
        if self._pending is not None:
            try:
                self._pending[1].result()
            except Exception as exc:
                log.error("snapshot step %d failed on rank %d: %s", self._pending[0], self.rank, exc)
            self._pending = None
        self._writer.shutdown()
        if finished:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the last node folder of a shared file system takes it
                self.root.rmdir()
        self.on = False


def optimizer_bytes(optimizers: list) -> int:
    """Snapshot bytes of the optimizers' state: what they hold, and for a never-stepped Adam/AdamW the
    moments and step count its first step will create (`state.create_adam_state`)."""
    import torch

    total = 0
    for opt in optimizers:
        adam = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
        for group in opt.param_groups:
            for p in group["params"]:
                held = opt.state.get(p)
                if held:
                    total += layout_bytes(tensors_of(dict(held)))
                elif adam and p.requires_grad:
                    moments = tensors_of(p) * (3 if group.get("amsgrad") else 2)
                    total += layout_bytes(moments) + layout_bytes([torch.zeros((), dtype=torch.float64)])
    return total


def _pace(cfg: CheckpointConfig) -> str:
    if cfg.snapshot_every == "auto":
        return f"at an automatic interval (at most {cfg.snapshot_max_overhead:.1%} of step time)"
    return f"every {cfg.snapshot_every} step(s)"


def _checksum(chunks) -> str:
    checksum = Checksum()
    for chunk in chunks:
        checksum.update(chunk)
    return checksum.text()
