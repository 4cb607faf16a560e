"""Which checkpoint a run starts from, and loading it: resume, init_from, or fresh.

Rank 0 plans the load (reads the checkpoint directory, checks the chosen step before anything is
loaded) and broadcasts the plan; every rank then loads its shards and its train state. A checkpoint
found damaged while loading is skipped and the plan is made again, unless it was asked for by name.
A run that has checkpoints (or whose record, run_state.json, says it has one) of which none loads is never
started over from step 0 silently: `UnloadableCheckpoints` names each one and what is wrong with it,
unless checkpoint.start_over_if_damaged says to start over; the damaged ones are kept either way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from relaytrain.checkpoint import dcp_io
from relaytrain.checkpoint.checksums import damaged_problems, data_problems, listed_checksums
from relaytrain.checkpoint.choose import choose_resume, resolve_checkpoint
from relaytrain.checkpoint.collectives import Collectives
from relaytrain.checkpoint.files import COMPLETE, FORMAT_VERSION, list_steps, read_metadata, train_state_file
from relaytrain.checkpoint.sources import init_model_from, verify_model_fits
from relaytrain.checkpoint.storage import ChecksumMismatch
from relaytrain.checkpoint.training_state import MissingState, TrainingState
from relaytrain.config.schema import CheckpointConfig, ModelConfig
from relaytrain.errors import UserError

log = logging.getLogger("relaytrain.checkpoint")

KEPT_DAMAGED = "kept_damaged"  # metadata.json of a line that started over: the damaged step dirs it keeps
_LISTED = 3  # damaged checkpoints an error names one by one


class UnloadableCheckpoints(UserError):
    """The run has checkpoints, or its record says it has one, but none of them loads."""


class CheckpointLoader:
    """The load side of `CheckpointManager`; it remembers what this process resumed from, which the save
    side needs (a resumed step is not saved again; every checkpoint records the run's lineage)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        ckpt_dir: Path,
        model: ModelConfig,
        config_hash: str,
        state: TrainingState,
        collectives: Collectives,
        parallel_dims: dict,
        *,
        enabled: bool,
    ):
        self.ckpt = cfg
        # checkpoint.enabled as the persistence front read it: off, the run's own checkpoints are never
        # resumed (init_from still loads)
        self.enabled = enabled
        self.ckpt_dir = ckpt_dir
        self.model, self.config_hash = model, config_hash
        self.state = state
        self.coll = collectives
        self.rank, self.world_size = collectives.rank, collectives.world_size
        self.parallel_dims = parallel_dims
        self.resumed: tuple[Path, int] | None = None  # the step dir this process resumed from
        # world_size and parallel dims the resumed checkpoint was saved with (the trainer's resize event)
        self.resumed_layout: dict[str, Any] | None = None
        # The explicit checkpoint.resume this run's line of checkpoints started at: the step dir it
        # resolved to and the argument as given (absolute), so a requeue recognises its own progress.
        self.lineage = {"resumed_from": "", "resume_arg": ""}
        self._verified: Path | None = None  # the step dir whose checksums the last load plan checked
        # step dirs a load found damaged (skipped by the next plan), with what the load found
        self._damaged: dict[Path, str] = {}

    @property
    def kept_damaged(self) -> frozenset[str]:
        """Names of the damaged step dirs this line of checkpoints started over beside: never replaced or
        deleted by it (its metadata.json carries them to every requeue)."""
        return frozenset(self.lineage.get(KEPT_DAMAGED, ()))

    def load(self, saved_this_run: bool, recorded_step: int = 0) -> int | None:
        """The step resumed at, or None when the run starts at step 0 (fresh or init_from).

        ``recorded_step``: the step of the newest checkpoint the run's record says it has (0: none);
        with it, finding no checkpoint is an `UnloadableCheckpoints` error, not a fresh start."""
        while True:
            kind, path, why, lineage = self.coll.on_rank0(lambda: self._plan(saved_this_run, recorded_step))
            if kind == "refuse":
                raise UnloadableCheckpoints(why)
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
                self._damaged[Path(path).resolve()] = str(exc)
        if kind == "fresh":
            if lineage is not None:  # started over beside damaged checkpoints, which this line keeps
                self.lineage = {**self.lineage, **lineage}
                log.warning("starting over at step 0: %s", why)
            else:
                log.info("starting fresh: %s", why)
            return None
        if kind == "init":
            log.info("initialising weights from %s (fresh optimizer, step 0): %s", path, why)
            try:
                init_model_from(
                    Path(path), self.state.model_parts, self.model, process_group=self.coll.save_group
                )
            except UserError:
                raise
            except Exception as exc:
                raise UserError(
                    f"cannot load the weights of checkpoint.init_from={path} ({type(exc).__name__}: "
                    f"{exc}); it is damaged or not a checkpoint"
                ) from None
            return None
        raise AssertionError(kind)

    def _plan(self, saved_this_run: bool, recorded_step: int) -> tuple[str, str | None, str, dict | None]:
        """(kind, path, why, lineage) where lineage names the explicit resume path a run continues from
        (None: take it from the checkpoint's metadata), or for a start over the damaged dirs it keeps.
        Kind "refuse": no checkpoint of the run loads and `why` is the error."""
        ck = self.ckpt
        if saved_this_run:  # a reload during the run (NaN rollback): this run's own newest checkpoint
            chosen, why = self._choose_own()
            if chosen is not None:
                return "resume", str(chosen), why, None
        if self.resumed is not None:
            return "resume", str(self.resumed[0]), "reloading the checkpoint this run resumed from", None
        if self.enabled:
            planned = self._plan_own(recorded_step)
            if planned is not None:
                return planned
        if ck.init_from:
            return (
                "init",
                ck.init_from,
                "checkpoint.init_from is set and there is no checkpoint to resume",
                None,
            )
        why = f"no complete checkpoint in {self.ckpt_dir}" if self.enabled else "checkpointing is disabled"
        return "fresh", None, why, None

    def _plan_own(self, recorded_step: int) -> tuple[str, str | None, str, dict | None] | None:
        """`_plan` for a run that keeps checkpoints, per checkpoint.resume; None: it has none to resume."""
        ck = self.ckpt
        if ck.resume == "auto":
            chosen, why = self._choose_own()
            if chosen is not None:
                return "resume", str(chosen), why, None
            return self._unloadable(recorded_step)
        if ck.resume == "none":
            complete = [e for e in list_steps(self.ckpt_dir) if e.complete]
            if complete:
                raise UserError(
                    f"checkpoint.resume='none' but {self.ckpt_dir} already holds checkpoints (newest "
                    f"{complete[-1].path.name}); use checkpoint.resume=auto to continue them, or a new "
                    "run.name or checkpoint.dir to start over"
                )
            return None
        # A requeued job keeps its config: once this run has saved after resuming from the path, its own
        # newer checkpoints win over going back to it (which retention may have deleted since).
        own, why = self._choose_own()
        argument = _absolute(ck.resume)
        if own is not None:
            meta = read_metadata(own)
            if argument in (meta.get("resume_arg"), meta.get("resumed_from")) and own.resolve() != Path(
                argument
            ):
                return "resume", str(own), f"{why} (this run's progress since {ck.resume})", None
        explicit = resolve_checkpoint(ck.resume).resolve()
        lineage = {"resumed_from": str(explicit), "resume_arg": argument}
        return "resume", str(explicit), f"checkpoint.resume={ck.resume}", lineage

    def _choose_own(self) -> tuple[Path | None, str]:
        # Shard files are checked while the load reads them (storage.RawReader), not in a read before it.
        skip = frozenset(self._damaged)
        chosen, why = choose_resume(self.ckpt_dir, self.ckpt.verify, data=False, skip=skip)
        self._verified = chosen.resolve() if chosen is not None and self.ckpt.verify else None
        return chosen, why

    def _unloadable(self, recorded_step: int) -> tuple[str, str | None, str, dict | None] | None:
        """When none of the run's checkpoints loads: the refusal, or with checkpoint.start_over_if_damaged
        a fresh start that keeps them. None when the run has nothing to lose (no committed checkpoint, none
        recorded): it starts fresh."""
        entries = list_steps(self.ckpt_dir)
        if recorded_step <= 0 and not any(e.complete for e in entries):
            return None
        found = []
        for entry in reversed(entries):
            if not entry.complete:
                problem = f"incomplete (no {COMPLETE} marker)"
            else:
                problem = self._damaged.get(entry.path.resolve()) or "; ".join(
                    damaged_problems(entry.path, self.ckpt.verify, data=False)[:2]
                )
            found.append((entry.path.name, f"{entry.path.name} ({problem or 'does not load'})"))
        listed = "; ".join(text for _, text in found[:_LISTED])
        listed += f"; and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
        if recorded_step > 0 and not any(e.complete for e in entries):
            what = (
                f"the run's record (run_state.json) says it has a checkpoint of step {recorded_step}, "
                f"but {self.ckpt_dir} holds no complete checkpoint" + (f": {listed}" if listed else "")
            )
        else:
            what = f"every checkpoint of this run in {self.ckpt_dir} is damaged: {listed}"
        if self.ckpt.start_over_if_damaged:
            kept = [name for name, _ in found]
            why = f"checkpoint.start_over_if_damaged=true and {what}; they are kept as they are"
            return "fresh", None, why, {KEPT_DAMAGED: kept}
        return (
            "refuse",
            None,
            f"{what}. The run does not start over at step 0 by itself and left them untouched: restore the "
            "damaged files, or resume from a good copy with --checkpoint.resume=<step dir>, or start again "
            "at step 0 with --checkpoint.start_over_if_damaged=true (the damaged checkpoints are kept)",
            None,
        )

    def _check_resumable(self, step_dir: Path) -> dict[str, Any]:
        if not (step_dir / COMPLETE).is_file():
            raise UserError(
                f"checkpoint {step_dir} is incomplete (no {COMPLETE} marker: its save was "
                "interrupted); resume from an older step_<N> directory instead"
            )
        # choose_resume has just read every byte of the one it chose; sizes are enough then.
        verify = self.ckpt.verify and step_dir.resolve() != self._verified
        problems = damaged_problems(step_dir, verify, data=False)
        if problems:
            older = [
                e.path
                for e in list_steps(step_dir.parent)
                if e.complete and e.path != step_dir and not damaged_problems(e.path, verify=False)
            ]
            hint = f"checkpoint.resume={older[-1]}" if older else "checkpoint.resume=<an older step dir>"
            raise UserError(
                f"checkpoint {step_dir} is damaged ({'; '.join(problems[:3])}); resume from an "
                f"older one with --{hint}"
            )
        meta = read_metadata(step_dir)
        if "train_state" not in meta.get("contents", []):
            raise UserError(
                f"{step_dir} holds model weights only (an import or export); start from it with "
                f"checkpoint.init_from={step_dir} instead of checkpoint.resume"
            )
        if meta.get("format_version", 1) < FORMAT_VERSION:
            raise UserError(
                f"checkpoint {step_dir} has format {meta.get('format_version', 1)} (relaytrain "
                f"{meta.get('relaytrain_version')}), whose train state this relaytrain (format "
                f"{FORMAT_VERSION}) cannot restore; finish that run with the relaytrain that wrote it, or "
                f"start from its weights with --checkpoint.init_from={step_dir}"
            )
        verify_model_fits(step_dir, self.model)
        if meta.get("config_hash") != self.config_hash:
            log.warning(
                "the config changed since %s was written (hash %s -> %s); resuming anyway",
                step_dir,
                meta.get("config_hash"),
                self.config_hash,
            )
        return meta

    def _resume(self, step_dir: Path, why: str, lineage: dict | None) -> int:
        meta = self.coll.on_rank0(lambda: self._check_resumable(step_dir))
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
        same_world = meta["world_size"] == self.world_size
        try:
            tree = self.state.load_target(optimizer="optimizer" in meta["contents"])
            checked = dcp_io.load(
                tree,
                step_dir,
                process_group=self.coll.save_group,
                no_dist=not self.coll.dist,
                expected=listed_checksums(step_dir) if self.ckpt.verify else None,
            )
            self._check_data(step_dir, checked)
            source = train_state_file(step_dir, self.rank if same_world else 0)
            tree["states"] = torch.load(source, weights_only=True, map_location="cpu")["states"]
        except UserError:
            raise
        except Exception as exc:
            self._check_data(step_dir, set())  # garbage content makes torch's reader fail on the way
            raise UserError(
                f"cannot load checkpoint {step_dir} ({type(exc).__name__}: {exc}); it is damaged or "
                "not from this relaytrain; resume from an older one with "
                "--checkpoint.resume=<older step dir>"
            ) from exc
        try:
            # per-rank streams do not map onto another number of ranks: reseeded then
            self.state.load_state_dict(tree, reseed_at=None if same_world else (step, self.rank))
        except MissingState as exc:
            raise UserError(
                f"checkpoint {step_dir} has {exc.args[0]}; it was written by a different trainer: start "
                "from its weights with --checkpoint.init_from instead"
            ) from None
        self.resumed = (step_dir.resolve(), step)
        self.resumed_layout = {"world_size": meta["world_size"], **meta["parallel_dims"]}
        self.lineage = lineage or {k: str(meta.get(k, "")) for k in ("resumed_from", "resume_arg")}
        kept = meta.get(KEPT_DAMAGED)
        if isinstance(kept, list) and all(isinstance(name, str) for name in kept):
            self.lineage = {**self.lineage, KEPT_DAMAGED: kept}
        return step

    def continue_line_of(self, step_dir: Path) -> None:
        """The run resumed from a newer state than `step_dir` (a snapshot), its newest checkpoint: later
        checkpoints carry that one's lineage (an explicit resume's origin, the damaged dirs it keeps)."""
        try:
            meta = read_metadata(step_dir)
        except UserError as exc:  # its own load would fail the same way; the run goes on from the snapshot
            log.warning("%s", exc)
            return
        self.lineage = {k: str(meta.get(k, "")) for k in ("resumed_from", "resume_arg")}
        kept = meta.get(KEPT_DAMAGED)
        if isinstance(kept, list) and all(isinstance(name, str) for name in kept):
            self.lineage[KEPT_DAMAGED] = kept

    def _check_data(self, step_dir: Path, checked: set[str]) -> None:
        """Raise ChecksumMismatch on every rank when a shard file no rank checked while reading it (read in
        part when resharding, or written by torch's own writer) differs from the manifest."""
        if not self.ckpt.verify:
            return
        seen = set(self.coll.gather_dicts(dict.fromkeys(checked, "")))
        problems = self.coll.on_rank0(lambda: data_problems(step_dir, seen))
        if problems:
            raise ChecksumMismatch("; ".join(problems[:3]))


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())
