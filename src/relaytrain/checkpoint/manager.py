"""CheckpointManager: the DCP tier of the persistence front (`front.py`): save (sync or async), commit,
retention, and resume.

Every public method is called by every rank at the same point of the loop. Decisions that depend on the
file system or the clock are taken by rank 0 and broadcast on the front's control group, so ranks never
disagree; DCP runs its collectives on the save group, away from training traffic (`collectives.py`). What
is saved is the `TrainingState`'s tree (`training_state.py`). The save path and the commit live here;
which checkpoint to load and loading it are `resume.py`'s; the metadata and train state files of a step
directory are written by `record.py`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from relaytrain.checkpoint import files
from relaytrain.checkpoint.checksums import write_complete
from relaytrain.checkpoint.collectives import Collectives
from relaytrain.checkpoint.host import HostStage
from relaytrain.checkpoint.record import RunRecord, write_run_record, write_train_state
from relaytrain.checkpoint.resume import CheckpointLoader
from relaytrain.checkpoint.save_errors import disk_full_error, save_failure
from relaytrain.checkpoint.schedule import SaveSchedule, retention_victims
from relaytrain.checkpoint.storage import WRITER_THREADS, LiveStager, RawWriter
from relaytrain.checkpoint.training_state import TrainingState
from relaytrain.config.schema import CheckpointConfig
from relaytrain.errors import UserError
from relaytrain.torch_private import stager_reusable

log = logging.getLogger("relaytrain.checkpoint")


def _device_stager():
    """DCP's stager for an async save of state off the host: host buffers for the snapshot, kept and reused
    by every save (no fresh allocation and page faults each time); pinned on CUDA so the device-to-host
    copy is fast. Only the copy blocks training. Non-blocking copies need an accelerator."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )
    return DefaultStager(options)


_DEFAULT_WRITE_BYTES_PER_S = 100e6  # pessimistic disk speed for the estimate before the first save


@dataclass
class _Pending:
    step: int
    reason: str
    step_dir: Path
    started: float
    contents: list[str]
    future: Future | None = None
    finished: float | None = None
    blocking_s: float = 0.0
    checksums: dict[str, str] = field(default_factory=dict)  # this rank's files, computed off the loop
    written: Future | None = None  # this rank's write (async): the next optimizer step waits for it (live)
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointManager:
    """Saves and restores the training state's tree: model and optimizer state as DCP files (resharded on
    load), its components in each rank's ``train_state/rank_<r>.pt``. A `Reseedable` component (the RNG
    streams) cannot be carried to a different world size and is reseeded instead; every other one is
    restored from rank 0's file then. Whether to save is the front's decision; `enabled` (read once, by
    the front) only tells the load whether the run's own checkpoints are resumed."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        ckpt_dir: Path,
        record: RunRecord,
        state: TrainingState,
        collectives: Collectives,
        *,
        enabled: bool,
        parallel_dims: dict,
        on_commit: Callable[[int], None] | None = None,
    ):
        self.ckpt = cfg
        self._on_commit = on_commit  # rank 0, after each commit: the run's record of its newest checkpoint
        self.record = record
        self.ckpt_dir = ckpt_dir
        self.state = state
        self.rank, self.world_size = collectives.rank, collectives.world_size
        # as metadata.json stores it (tuples become lists), so that a comparison after loading is exact
        self.parallel_dims = json.loads(json.dumps(parallel_dims))
        self._coll = collectives
        self._stager = None
        # host buffers for a sync save's device tensors, kept for every save (allocated when first used)
        self._host_stages = [HostStage() for _ in range(WRITER_THREADS)]
        self._checksummer: ThreadPoolExecutor | None = None
        if self.ckpt.mode == "async":
            # Checksums of this rank's files are computed after its write, on this thread, not the loop's.
            self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="relaytrain-ckpt-checksum")
            on_host = state.on_host()
            # State already in host memory is written from the live tensors, with no copy: only the
            # optimizers change them in place, so their next step waits until this rank's write is done
            # (the forward and backward passes in between overlap with the write). Off the host: a copy.
            self._stager = LiveStager() if on_host else _device_stager()
        self._step_hooks = []
        if isinstance(self._stager, LiveStager):
            hook = self._before_optimizer_step
            self._step_hooks = [opt.register_step_pre_hook(hook) for opt in state.optimizers]
        self.last_save: dict[str, float] = {}  # seconds: blocking, written (since the start), commit
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix="relaytrain-ckpt-retention")
        self._retention: Future | None = None
        self._schedule = SaveSchedule(self.ckpt, self._coll.agree_flag)
        self._pending: _Pending | None = None
        self._saved_steps: set[int] = set()
        self._durations: list[float] = []
        self._loader = CheckpointLoader(
            self.ckpt,
            self.ckpt_dir,
            record.model,
            record.config_hash,
            state,
            self._coll,
            self.parallel_dims,
            enabled=enabled,
        )

    @property
    def resumed_layout(self) -> dict[str, Any] | None:
        """World size and parallel dims the resumed checkpoint was saved with (None: not resumed)."""
        return self._loader.resumed_layout

    # -- saving -----------------------------------------------------------------------------------

    def should_save(self, step: int, is_last: bool) -> bool:
        due = self._schedule.due(step, is_last)
        return due and step not in self._saved_steps

    def save(self, step: int, reason: str = "interval") -> None:
        self.wait()
        if step in self._saved_steps:
            log.info("step %d is already checkpointed; nothing to save (%s)", step, reason)
            return
        step_dir = self.ckpt_dir / files.step_dir_name(step)
        if self._coll.on_rank0(lambda: self._prepare_step_dir(step_dir, step)) in ("exists", "kept"):
            self._saved_steps.add(step)
            return
        started = time.perf_counter()
        self._schedule.mark_saved()
        state = self.state.state_dict(optimizer=self._coll.any(self.state.has_optimizer_state()))
        components = state.pop("states")  # this rank's file beside the DCP files; the rest is DCP's
        error = None
        try:
            own_train_state = write_train_state(
                step_dir, components, step=step, rank=self.rank, world_size=self.world_size
            )
        except OSError as exc:
            own_train_state, error = {}, exc
        if self._coll.any(error is not None):
            raise self._save_failed(step, step_dir, error)
        contents = ["model", "optimizer", "train_state"] if "optim" in state else ["model", "train_state"]
        pending = _Pending(step, reason, step_dir, started, contents, checksums=own_train_state)
        writer = RawWriter(step_dir, stages=self._host_stages)
        if self.ckpt.mode == "async":
            written = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._coll.save_group,
                async_stager=self._stager,
                no_dist=not self._coll.dist,
            )
            if not isinstance(self._stager, LiveStager) and not stager_reusable(self._stager):
                self._stager = _device_stager()  # this torch closed it after staging (torch_private)
            if isinstance(written, AsyncSaveResponse):
                written = written.upload_completion
            pending.written = written
            pending.future = self._checksummer.submit(self._checksums_after, written, writer, pending)
            pending.future.add_done_callback(
                lambda _f, p=pending: setattr(p, "finished", time.perf_counter())
            )
            pending.blocking_s = time.perf_counter() - started
            self._pending = pending
            log.info(
                "checkpoint step %d (%s): async save started, training blocked %.2fs",
                step,
                reason,
                pending.blocking_s,
            )
        else:
            try:
                dcp.save(
                    state,
                    storage_writer=writer,
                    process_group=self._coll.save_group,
                    no_dist=not self._coll.dist,
                )
            except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
                raise self._save_failed(step, step_dir, exc) from None
            pending.checksums |= writer.checksums
            pending.finished = time.perf_counter()
            pending.blocking_s = pending.finished - started
            self._commit(pending)

    def _prepare_step_dir(self, step_dir: Path, step: int) -> str:
        if (
            (step_dir / files.COMPLETE).is_file()
            and self._loader.resumed
            and self._loader.resumed == (step_dir.resolve(), step)
        ):
            log.info("step %d is the checkpoint this run resumed from; not saving it again", step)
            return "exists"
        if step_dir.name in self._loader.kept_damaged:
            log.warning(
                "not saving step %d: %s holds a damaged checkpoint this run started over beside "
                "(checkpoint.start_over_if_damaged), which is never replaced",
                step,
                step_dir,
            )
            return "kept"
        if step_dir.exists():
            # A killed save's leftovers, or a checkpoint of an abandoned line (resumed from an older step).
            log.warning("replacing existing %s", step_dir)
            files.remove_step_dir(step_dir)
        try:
            (step_dir / files.TRAIN_STATE_DIR).mkdir(parents=True)
        except OSError as exc:
            raise UserError(
                f"cannot create checkpoint directory {step_dir} ({exc.strerror}); set "
                "checkpoint.dir to a writable path"
            ) from None
        return "created"

    def _before_optimizer_step(self, *_args) -> None:
        """A live async save writes from the tensors the optimizer is about to change: wait for it."""
        pending = self._pending
        if pending is not None and pending.written is not None and not pending.written.done():
            waited = time.perf_counter()
            wait_futures([pending.written])
            pending.blocking_s += time.perf_counter() - waited

    def _checksums_after(self, written: Future, writer: RawWriter, pending: _Pending) -> dict[str, str]:
        written.result()
        return pending.checksums | writer.checksums

    def poll(self) -> None:
        """Commit a finished async save; cheap when none is pending (no collective)."""
        if self._pending is None:
            return
        if self._coll.any(not self._pending.future.done()):
            return
        self._finish_pending()

    def wait(self) -> None:
        """Until the pending save is committed and the retention it started has deleted what it deletes."""
        if self._pending is not None:
            self._finish_pending()
        retention, self._retention = self._retention, None
        if retention is not None:
            retention.result()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        error = None
        try:
            pending.checksums = pending.future.result()
        except (Exception, CheckpointException) as exc:  # reported below on every rank, after all know
            error = exc
        if self._coll.any(error is not None):
            log.error("checkpoint step %d failed on rank %d: %r", pending.step, self.rank, error)
            raise self._save_failed(pending.step, pending.step_dir, error)
        self._commit(pending)

    def _save_failed(self, step: int, step_dir: Path, error: BaseException | None) -> Exception:
        """Collective: every rank gets the same kind of error, and the partial step dir is gone."""
        full = self._coll.any(disk_full_error(error) is not None)
        return save_failure(step, step_dir, error, self.rank == 0, full)

    def _commit(self, pending: _Pending) -> None:
        """Every rank's files are written and fsynced (its save returned): rank 0 marks the step complete."""
        commit_started = time.perf_counter()
        checksums = self._coll.gather_dicts(pending.checksums)
        if self.rank == 0:
            write_run_record(
                pending.step_dir,
                self.record,
                step=pending.step,
                reason=pending.reason,
                contents=pending.contents,
                world_size=self.world_size,
                parallel_dims=self.parallel_dims,
                save_mode=self.ckpt.mode,
                lineage=self._loader.lineage,
            )
            write_complete(pending.step_dir, checksums)
            files.point_latest(self.ckpt_dir, pending.step_dir)
            if self._on_commit is not None:
                self._on_commit(pending.step)
            # Deleting old checkpoints need not hold up training; wait() (every save, load, close) joins it.
            self._retention = self._janitor.submit(self._apply_retention)
        self._coll.barrier()
        finished = pending.finished or time.perf_counter()
        self.last_save = {
            "blocking_s": pending.blocking_s,
            "written_s": finished - pending.started,
            "commit_s": time.perf_counter() - commit_started,
        }
        self._durations = (self._durations + [time.perf_counter() - pending.started])[-5:]
        self._saved_steps.add(pending.step)
        log.info(
            "checkpoint step %d (%s) committed: %s (write %.2fs, blocking %.2fs)",
            pending.step,
            pending.reason,
            pending.step_dir,
            finished - pending.started,
            pending.blocking_s,
        )

    def _apply_retention(self) -> None:
        entries = files.list_steps(self.ckpt_dir)
        victims = retention_victims(
            entries,
            files.read_latest(self.ckpt_dir),
            self.ckpt.keep_last,
            self.ckpt.keep_every,
            protected={self.ckpt_dir / name for name in self._loader.kept_damaged},
        )
        for entry in victims:
            log.info(
                "retention: removing %s%s", entry.path, "" if entry.complete else " (incomplete leftover)"
            )
            files.remove_step_dir(entry.path)

    def save_seconds_estimate(self) -> float:
        if self._durations:
            return max(self._durations)
        local_bytes = self.state.local_parameter_bytes()
        return 5.0 + 3 * local_bytes / _DEFAULT_WRITE_BYTES_PER_S  # weights + two AdamW moments

    # -- loading ----------------------------------------------------------------------------------

    def load(self, recorded_step: int = 0) -> int | None:
        """Resume (the step), or start at step 0 from checkpoint.init_from or fresh (None); see resume.py.

        ``recorded_step``: the step of the newest checkpoint the run's record says it has; when none loads,
        it makes the load an `UnloadableCheckpoints` error instead of a fresh start."""
        self.wait()
        step = self._loader.load(saved_this_run=bool(self._saved_steps), recorded_step=recorded_step)
        if step is not None:
            self._saved_steps = {s for s in self._saved_steps if s <= step}
            self._schedule.mark_saved()
        return step

    def continue_line_of_newest(self) -> None:
        """The run resumed from a state newer than its newest checkpoint (a snapshot): later checkpoints
        carry that checkpoint's lineage (an explicit resume's origin, the damaged dirs it keeps)."""
        complete = [e.path for e in files.list_steps(self.ckpt_dir) if e.complete]
        if complete:
            self._loader.continue_line_of(complete[-1])

    def close(self) -> None:
        """Commit a pending save, then release the stager, the checksum thread and the retention thread
        (the gloo groups are the front's).

        Safe in a ``finally``: a failed pending save is logged here (it already stays incomplete)."""
        try:
            self.wait()
        except Exception as exc:
            log.error("%s", exc)
        for hook in self._step_hooks:
            hook.remove()
        self._step_hooks = []
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._checksummer is not None:
            self._checksummer.shutdown()
            self._checksummer = None
        self._janitor.shutdown()
