"""CheckpointManager: save (sync or async), commit, retention, and resume for the training loop.

Every public method is called by every rank at the same point of the loop. Decisions that depend on the
file system or the clock are taken by rank 0 and broadcast on a dedicated gloo group, so ranks never
disagree; asynchronous saves run their collectives on a second gloo group, away from training traffic.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import relaytrain
from relaytrain.checkpoint import dcp_io
from relaytrain.checkpoint import files as L
from relaytrain.checkpoint.save_errors import disk_full_error, save_failure
from relaytrain.checkpoint.schedule import SaveSchedule, retention_victims
from relaytrain.checkpoint.sources import init_model_from, verify_model_fits
from relaytrain.checkpoint.state import (
    create_adam_state,
    model_state,
    optimizer_state,
    optimizers_have_state,
    set_model_state,
    set_optimizer_state,
)
from relaytrain.checkpoint.storage import ChecksumMismatch, LiveStager, RawWriter
from relaytrain.config.schema import CheckpointConfig, ModelConfig
from relaytrain.errors import UserError

log = logging.getLogger("relaytrain.checkpoint")

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


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint records about the run that wrote it (metadata.json, config.toml, tokenizer)."""

    name: str
    config_toml: str
    config_hash: str
    model: ModelConfig
    tokenizer: str  # "byte" or the tokenizer file / directory, copied into each checkpoint


class CheckpointManager:
    """Saves and restores model parts and optimizers (DCP, resharded on load) and a registry of per-rank
    stateful objects (``train_state/rank_<r>.pt``: train state, data position, RNG, ...).

    `states` maps a name to an object with ``state_dict()`` / ``load_state_dict()``. An object with
    ``reseed(step, rank)`` (the RNG streams) cannot be carried to a different world size and is reseeded
    instead; every other one is restored from rank 0's file then.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        record: RunRecord,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        states: dict[str, Any],
        *,
        rank: int,
        world_size: int,
        parallel_dims: dict,
    ):
        self.ckpt = cfg
        self.record = record
        self.run_dir = Path(run_dir)
        self.ckpt_dir = Path(self.ckpt.dir) if self.ckpt.dir else self.run_dir / "checkpoints"
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)
        self.states = dict(states)
        self.rank, self.world_size = rank, world_size
        # as metadata.json stores it (tuples become lists), so that a comparison after loading is exact
        self.parallel_dims = json.loads(json.dumps(parallel_dims))
        self._dist = dist.is_available() and dist.is_initialized()
        if world_size > 1 and not self._dist:
            raise RuntimeError("CheckpointManager with world_size > 1 needs an initialized process group")
        # Control decisions (main thread) and async save traffic (background thread) each get their own
        # gloo group: collectives from two threads must never interleave on one group.
        self._ctrl = dist.new_group(backend="gloo") if self._dist else None
        self._save_pg = dist.new_group(backend="gloo") if self._dist else None
        self._stager = None
        self._checksummer: ThreadPoolExecutor | None = None
        if self.ckpt.mode == "async":
            # Checksums of this rank's files are computed after its write, on this thread, not the loop's.
            self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="relaytrain-ckpt-checksum")
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            on_host = all(p.device.type == "cpu" for part in self.model_parts for p in part.parameters())
            # State already in host memory is written from the live tensors, with no copy: only the
            # optimizers change them in place, so their next step waits until this rank's write is done
            # (the forward and backward passes in between overlap with the write).
            # Off the host: host buffers for the snapshot, kept and reused by every save (no fresh
            # allocation and page faults each time); pinned on CUDA so the device-to-host copy is fast.
            # Only the copy blocks training. Non-blocking copies need an accelerator.
            cuda = torch.cuda.is_available()
            self._stager = (
                LiveStager()
                if on_host
                else DefaultStager(
                    StagingOptions(
                        use_pinned_memory=cuda,
                        use_shared_memory=False,
                        use_async_staging=False,
                        use_non_blocking_copy=cuda,
                    )
                )
            )
        self._step_hooks = []
        if isinstance(self._stager, LiveStager):
            self._step_hooks = [o.register_step_pre_hook(self._before_optimizer_step) for o in optimizers]
        self.last_save: dict[str, float] = {}  # seconds: blocking, written (since the start), commit
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix="relaytrain-ckpt-retention")
        self._retention: Future | None = None
        self._schedule = SaveSchedule(self.ckpt, self._agree_flag)
        self._pending: _Pending | None = None
        self._saved_steps: set[int] = set()
        self._durations: list[float] = []
        self._resumed: tuple[Path, int] | None = None  # the step dir this process resumed from
        # world_size and parallel dims the resumed checkpoint was saved with (the trainer's resize event)
        self.resumed_layout: dict[str, Any] | None = None
        # The explicit checkpoint.resume this run's line of checkpoints started at: the step dir it
        # resolved to and the argument as given (absolute), so a requeue recognises its own progress.
        self._lineage = {"resumed_from": "", "resume_arg": ""}
        self._loads = 0
        self._verified: Path | None = None  # the step dir whose checksums the last load plan checked
        self._damaged: set[Path] = set()  # step dirs a load found damaged (skipped by the next plan)

    # -- collectives on the control group ---------------------------------------------------------

    def _broadcast(self, obj):
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctrl)
        return box[0]

    def _agree_flag(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (a one-element tensor broadcast: cheap enough for every step)."""
        if not self._dist:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.broadcast(t, src=0, group=self._ctrl)
        return bool(t.item())

    def _any(self, flag: bool) -> bool:
        if not self._dist:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._ctrl)
        return bool(t.item())

    def _barrier(self) -> None:
        if self._dist:
            dist.barrier(group=self._ctrl)

    def _on_rank0(self, fn):
        """Run `fn` on rank 0, hand its result (or its UserError) to every rank."""
        result = None
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except UserError as exc:
                result = ("error", str(exc))
        kind, value = self._broadcast(result)
        if kind == "error":
            raise UserError(value)
        return value

    # -- saving -----------------------------------------------------------------------------------

    def should_save(self, step: int, is_last: bool) -> bool:
        if not self.ckpt.enabled:
            return False
        due = self._schedule.due(step, is_last)
        return due and step not in self._saved_steps

    def save(self, step: int, reason: str = "interval") -> None:
        if not self.ckpt.enabled:
            log.warning("checkpoint.enabled=false: no checkpoint for step %d (%s)", step, reason)
            return
        self.wait()
        if step in self._saved_steps:
            log.info("step %d is already checkpointed; nothing to save (%s)", step, reason)
            return
        step_dir = self.ckpt_dir / L.step_dir_name(step)
        if self._on_rank0(lambda: self._prepare_step_dir(step_dir, step)) == "exists":
            self._saved_steps.add(step)
            return
        started = time.perf_counter()
        self._schedule.mark_saved()
        try:
            own_train_state, error = self._write_train_state(step_dir, step), None
        except OSError as exc:
            own_train_state, error = {}, exc
        if self._any(error is not None):
            raise self._save_failed(step, step_dir, error)
        contents = ["model", "train_state"]
        state: dict[str, Any] = {"model": model_state(self.model_parts)}
        # A never-stepped optimizer has no state; asking for it would create some (and change training).
        if self._any(optimizers_have_state(self.optimizers)):
            state["optim"] = optimizer_state(self.model_parts, self.optimizers)
            contents.insert(1, "optimizer")
        pending = _Pending(step, reason, step_dir, started, contents, checksums=own_train_state)
        writer = RawWriter(step_dir)
        if self.ckpt.mode == "async":
            written = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._save_pg,
                async_stager=self._stager,
                no_dist=not self._dist,
            )
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
                dcp.save(state, storage_writer=writer, process_group=self._save_pg, no_dist=not self._dist)
            except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
                raise self._save_failed(step, step_dir, exc) from None
            pending.checksums |= writer.checksums
            pending.finished = time.perf_counter()
            pending.blocking_s = pending.finished - started
            self._commit(pending)

    def _prepare_step_dir(self, step_dir: Path, step: int) -> str:
        if (
            (step_dir / L.COMPLETE).is_file()
            and self._resumed
            and self._resumed == (step_dir.resolve(), step)
        ):
            log.info("step %d is the checkpoint this run resumed from; not saving it again", step)
            return "exists"
        if step_dir.exists():
            # A killed save's leftovers, or a checkpoint of an abandoned line (resumed from an older step).
            log.warning("replacing existing %s", step_dir)
            L.remove_step_dir(step_dir)
        try:
            (step_dir / L.TRAIN_STATE_DIR).mkdir(parents=True)
        except OSError as exc:
            raise UserError(
                f"cannot create checkpoint directory {step_dir} ({exc.strerror}); set "
                "checkpoint.dir to a writable path"
            ) from None
        return "created"

    def _write_train_state(self, step_dir: Path, step: int) -> dict[str, str]:
        """Write this rank's train state file; its manifest checksum, computed from the bytes written."""
        payload = {
            "format_version": L.FORMAT_VERSION,
            "states": {name: obj.state_dict() for name, obj in self.states.items()},
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
        }
        path = L.train_state_file(step_dir, self.rank)
        tmp = path.with_name(path.name + ".tmp")
        data = io.BytesIO()
        torch.save(payload, data)
        with open(tmp, "wb") as f:
            f.write(data.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        return {str(path.relative_to(step_dir)): L.crc_text(zlib.crc32(data.getbuffer()))}

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

    def _gather_checksums(self, own: dict[str, str]) -> dict[str, str]:
        if not self._dist:
            return own
        box = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(own, box, dst=0, group=self._ctrl)
        return {k: v for part in box or [] for k, v in part.items()}

    def poll(self) -> None:
        """Commit a finished async save; cheap when none is pending (no collective)."""
        if self._pending is None:
            return
        if self._any(not self._pending.future.done()):
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
        if self._any(error is not None):
            log.error("checkpoint step %d failed on rank %d: %r", pending.step, self.rank, error)
            raise self._save_failed(pending.step, pending.step_dir, error)
        self._commit(pending)

    def _save_failed(self, step: int, step_dir: Path, error: BaseException | None) -> Exception:
        """Collective: every rank gets the same kind of error, and the partial step dir is gone."""
        full = self._any(disk_full_error(error) is not None)
        return save_failure(step, step_dir, error, self.rank == 0, full)

    def _commit(self, pending: _Pending) -> None:
        """Every rank's files are written and fsynced (its save returned): rank 0 marks the step complete."""
        commit_started = time.perf_counter()
        checksums = self._gather_checksums(pending.checksums)
        if self.rank == 0:
            self._write_metadata(pending)
            L.write_complete(pending.step_dir, checksums)
            L.point_latest(self.ckpt_dir, pending.step_dir)
            # Deleting old checkpoints need not hold up training; wait() (every save, load, close) joins it.
            self._retention = self._janitor.submit(self._apply_retention)
        self._barrier()
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

    def _write_metadata(self, pending: _Pending) -> None:
        meta = {
            "format": L.FORMAT_NAME,
            "format_version": L.FORMAT_VERSION,
            "step": pending.step,
            "reason": pending.reason,
            "contents": pending.contents,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "unix_time": time.time(),
            "relaytrain_version": relaytrain.__version__,
            "torch_version": torch.__version__,
            "config_hash": self.record.config_hash,
            "run_name": self.record.name,
            "world_size": self.world_size,
            "parallel_dims": self.parallel_dims,
            "save_mode": self.ckpt.mode,
            **self._lineage,
            "model": dataclasses.asdict(self.record.model),
            "tokenizer": self.record.tokenizer,
        }
        L.write_durable(pending.step_dir / L.METADATA, json.dumps(meta, indent=1).encode())
        L.write_durable(pending.step_dir / L.CONFIG, self.record.config_toml.encode())
        tokenizer = _tokenizer_file(self.record.tokenizer)
        if tokenizer is not None:
            L.copy_durable(tokenizer, pending.step_dir / L.TOKENIZER)

    def _apply_retention(self) -> None:
        entries = L.list_steps(self.ckpt_dir)
        victims = retention_victims(
            entries, L.read_latest(self.ckpt_dir), self.ckpt.keep_last, self.ckpt.keep_every, protected=set()
        )
        for entry in victims:
            log.info(
                "retention: removing %s%s", entry.path, "" if entry.complete else " (incomplete leftover)"
            )
            L.remove_step_dir(entry.path)

    def save_seconds_estimate(self) -> float:
        if self._durations:
            return max(self._durations)
        local_bytes = sum(
            p.numel() * p.element_size() for part in self.model_parts for p in part.parameters()
        )
        return 5.0 + 3 * local_bytes / _DEFAULT_WRITE_BYTES_PER_S  # weights + two AdamW moments

    # -- loading ----------------------------------------------------------------------------------

    def load(self) -> int | None:
        self.wait()
        self._loads += 1
        while True:
            kind, path, why, lineage = self._on_rank0(self._plan_load)
            if kind != "resume":
                break
            try:
                return self._resume(Path(path), why, lineage)
            except ChecksumMismatch as exc:
                if lineage is not None:  # asked for by name: no silent substitute
                    raise UserError(
                        f"checkpoint {path} is damaged ({exc}); resume from an older one with "
                        "--checkpoint.resume=<older step dir>"
                    ) from None
                log.warning("skipping damaged checkpoint %s: %s", path, exc)
                self._damaged.add(Path(path).resolve())
        if kind == "fresh":
            log.info("starting fresh: %s", why)
            return None
        if kind == "init":
            log.info("initialising weights from %s (fresh optimizer, step 0): %s", path, why)
            try:
                init_model_from(Path(path), self.model_parts, self.record.model, process_group=self._save_pg)
            except UserError:
                raise
            except Exception as exc:
                raise UserError(
                    f"cannot load the weights of checkpoint.init_from={path} ({type(exc).__name__}: "
                    f"{exc}); it is damaged or not a checkpoint"
                ) from None
            return None
        raise AssertionError(kind)

    def _plan_load(self) -> tuple[str, str | None, str, dict | None]:
        """(kind, path, why, lineage) where lineage names the explicit resume path a run continues from
        (None: take it from the checkpoint's metadata)."""
        ck = self.ckpt
        if self._saved_steps:  # a reload during the run (NaN rollback): this run's own newest checkpoint
            chosen, why = self._choose_own()
            if chosen is not None:
                return "resume", str(chosen), why, None
        if self._resumed is not None:
            return "resume", str(self._resumed[0]), "reloading the checkpoint this run resumed from", None
        if ck.enabled and ck.resume == "auto":
            chosen, why = self._choose_own()
            if chosen is not None:
                return "resume", str(chosen), why, None
        elif ck.enabled and ck.resume == "none":
            complete = [e for e in L.list_steps(self.ckpt_dir) if e.complete]
            if complete:
                raise UserError(
                    f"checkpoint.resume='none' but {self.ckpt_dir} already holds checkpoints (newest "
                    f"{complete[-1].path.name}); use checkpoint.resume=auto to continue them, or a new "
                    "run.name or checkpoint.dir to start over"
                )
        elif ck.enabled:
            # A requeued job keeps its config: once this run has saved after resuming from the path, its
            # own newer checkpoints win over going back to it (which retention may have deleted since).
            own, why = self._choose_own()
            argument = _absolute(ck.resume)
            if own is not None:
                meta = L.read_metadata(own)
                if argument in (meta.get("resume_arg"), meta.get("resumed_from")) and own.resolve() != Path(
                    argument
                ):
                    return "resume", str(own), f"{why} (this run's progress since {ck.resume})", None
            explicit = L.resolve_checkpoint(ck.resume).resolve()
            lineage = {"resumed_from": str(explicit), "resume_arg": argument}
            return "resume", str(explicit), f"checkpoint.resume={ck.resume}", lineage
        if ck.init_from:
            return (
                "init",
                ck.init_from,
                "checkpoint.init_from is set and there is no checkpoint to resume",
                None,
            )
        why = "checkpointing is disabled" if not ck.enabled else f"no complete checkpoint in {self.ckpt_dir}"
        return "fresh", None, why, None

    def _choose_own(self) -> tuple[Path | None, str]:
        # Shard files are checked while the load reads them (storage.RawReader), not in a read before it.
        skip = frozenset(self._damaged)
        chosen, why = L.choose_resume(self.ckpt_dir, self.ckpt.verify, data=False, skip=skip)
        self._verified = chosen.resolve() if chosen is not None and self.ckpt.verify else None
        return chosen, why

    def _check_resumable(self, step_dir: Path) -> dict[str, Any]:
        if not (step_dir / L.COMPLETE).is_file():
            raise UserError(
                f"checkpoint {step_dir} is incomplete (no {L.COMPLETE} marker: its save was "
                "interrupted); resume from an older step_<N> directory instead"
            )
        # choose_resume has just read every byte of the one it chose; sizes are enough then.
        verify = self.ckpt.verify and step_dir.resolve() != self._verified
        problems = L.damaged_problems(step_dir, verify, data=False)
        if problems:
            older = [
                e.path
                for e in L.list_steps(step_dir.parent)
                if e.complete and e.path != step_dir and not L.damaged_problems(e.path, verify=False)
            ]
            hint = f"checkpoint.resume={older[-1]}" if older else "checkpoint.resume=<an older step dir>"
            raise UserError(
                f"checkpoint {step_dir} is damaged ({'; '.join(problems[:3])}); resume from an "
                f"older one with --{hint}"
            )
        meta = L.read_metadata(step_dir)
        if "train_state" not in meta.get("contents", []):
            raise UserError(
                f"{step_dir} holds model weights only (an import or export); start from it with "
                f"checkpoint.init_from={step_dir} instead of checkpoint.resume"
            )
        if meta.get("format_version", 1) < L.FORMAT_VERSION:
            raise UserError(
                f"checkpoint {step_dir} has format {meta.get('format_version', 1)} (relaytrain "
                f"{meta.get('relaytrain_version')}), whose train state this relaytrain (format "
                f"{L.FORMAT_VERSION}) cannot restore; finish that run with the relaytrain that wrote it, or "
                f"start from its weights with --checkpoint.init_from={step_dir}"
            )
        verify_model_fits(step_dir, self.record.model)
        if meta.get("config_hash") != self.record.config_hash:
            log.warning(
                "the config changed since %s was written (hash %s -> %s); resuming anyway",
                step_dir,
                meta.get("config_hash"),
                self.record.config_hash,
            )
        return meta

    def _resume(self, step_dir: Path, why: str, lineage: dict | None) -> int:
        meta = self._on_rank0(lambda: self._check_resumable(step_dir))
        step = int(meta["step"])
        log.info("resuming from %s (step %d): %s", step_dir, step, why)
        if meta["world_size"] != self.world_size or meta["parallel_dims"] != self.parallel_dims:
            log.info(
                "resharding: saved with world size %s parallel dims %s, loading with world size %s "
                "parallel dims %s",
                meta["world_size"],
                meta["parallel_dims"],
                self.world_size,
                self.parallel_dims,
            )
        try:
            state: dict[str, Any] = {"model": model_state(self.model_parts)}
            if "optimizer" in meta["contents"]:
                create_adam_state(self.optimizers)
                state["optim"] = optimizer_state(self.model_parts, self.optimizers)
            checked = dcp_io.load(
                state,
                step_dir,
                process_group=self._save_pg,
                no_dist=not self._dist,
                expected=L.listed_checksums(step_dir) if self.ckpt.verify else None,
            )
            self._check_data(step_dir, checked)
            set_model_state(self.model_parts, state["model"])
            if "optim" in state:
                set_optimizer_state(self.model_parts, self.optimizers, state["optim"])
            same_world = meta["world_size"] == self.world_size
            source = L.train_state_file(step_dir, self.rank if same_world else 0)
            payload = torch.load(source, weights_only=True, map_location="cpu")
        except UserError:
            raise
        except Exception as exc:
            self._check_data(step_dir, set())  # garbage content makes torch's reader fail on the way
            raise UserError(
                f"cannot load checkpoint {step_dir} ({type(exc).__name__}: {exc}); it is damaged or "
                "not from this relaytrain; resume from an older one with "
                "--checkpoint.resume=<older step dir>"
            ) from exc
        missing = sorted(set(self.states) - set(payload["states"]))
        if missing:
            raise UserError(
                f"checkpoint {step_dir} has no saved state for {', '.join(missing)}; it was written by a "
                "different trainer: start from its weights with --checkpoint.init_from instead"
            )
        for name, obj in self.states.items():
            if not same_world and hasattr(obj, "reseed"):
                obj.reseed(step, self.rank)  # per-rank streams do not map onto another number of ranks
            else:
                obj.load_state_dict(payload["states"][name])
        self._resumed = (step_dir.resolve(), step)
        self.resumed_layout = {"world_size": meta["world_size"], **meta["parallel_dims"]}
        self._lineage = lineage or {k: str(meta.get(k, "")) for k in ("resumed_from", "resume_arg")}
        self._saved_steps = {s for s in self._saved_steps if s <= step}
        self._schedule.mark_saved()
        return step

    def _check_data(self, step_dir: Path, checked: set[str]) -> None:
        """Raise ChecksumMismatch on every rank when a shard file no rank checked while reading it (read in
        part when resharding, or written by torch's own writer) differs from the manifest."""
        if not self.ckpt.verify:
            return
        seen = set(self._gather_checksums(dict.fromkeys(checked, "")))
        problems = self._on_rank0(lambda: L.data_problems(step_dir, seen))
        if problems:
            raise ChecksumMismatch("; ".join(problems[:3]))

    def close(self) -> None:
        """Commit a pending save, then release the stager, the checksum thread and the gloo groups.

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
        for group in (self._ctrl, self._save_pg):
            if group is not None and self._dist and dist.is_initialized():
                dist.destroy_process_group(group)
        self._ctrl = self._save_pg = None
        self._dist = False


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _tokenizer_file(spec: str) -> Path | None:
    if spec == "byte":
        return None
    path = Path(spec).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        log.warning("tokenizer file %s not found; checkpoints will not carry a copy of it", spec)
        return None
    return path
