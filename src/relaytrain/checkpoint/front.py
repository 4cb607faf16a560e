"""Persistence: the one front the training loop faces for keeping its state, over two tiers.

The DCP tier (`manager.py`: checkpoints on the shared file system, resharded on load) and, with
`checkpoint.snapshot_every`, the snapshot tier (`snapshot/tier.py`: each rank's state in node memory and
on peer nodes, at the steps `snapshot/pacing.py` picks) both persist the one `TrainingState`, over the
one set of gloo groups created here (`collectives.py`). The front owns the decisions between them: a
start restores a snapshot newer than the newest checkpoint before DCP is looked at; a step's snapshot is
taken after its checkpoint decision, none at the last step (the newest one is settled there, so its
cost is recorded); the end commits a pending save before the snapshot tier closes and both before the
groups go. `checkpoint.enabled` is read here once for every persistence decision (outside: the config
check before a start, `choose.check_resume`; the plan; the stop event's `saved` field, resilience/).

Every method is called by every rank at the same point of the loop. Its loads, saves and snapshots are
sections of the rank's step clock (`job/clock.py`): timed there for the metrics and the time ledger, and
shown on the progress board with the save estimate as their budget: the hang monitor gives a save the
time it was expected to take, and a stuck one is named as a stuck save.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relaytrain.checkpoint.collectives import Collectives
from relaytrain.checkpoint.files import read_latest
from relaytrain.checkpoint.manager import CheckpointManager
from relaytrain.checkpoint.record import RunRecord
from relaytrain.checkpoint.save_errors import disk_full_error
from relaytrain.checkpoint.snapshot.pacing import EventSink, SnapshotPacing
from relaytrain.checkpoint.snapshot.tier import SnapshotTier
from relaytrain.checkpoint.training_state import TrainingState
from relaytrain.config.schema import CheckpointConfig
from relaytrain.errors import UserError
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import Phase
from relaytrain.job.rundir import RunDir

log = logging.getLogger("relaytrain.checkpoint")


class Persistence:
    """`restore` at the start, `after_step` after every step, `save_now` at a stop, `close` at the end."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run: RunDir,
        record: RunRecord,
        state: TrainingState,
        *,
        rank: int,
        world_size: int,
        parallel_dims: dict,
        on_commit: Callable[[int], None] | None = None,
        clock: StepClock | None = None,
        on_event: EventSink | None = None,
    ):
        self.cfg = cfg
        self.run = run
        self.clock = clock if clock is not None else StepClock()
        self.board = self.clock.board
        self.enabled = cfg.enabled  # off: nothing is saved, no snapshot is taken, no own checkpoint resumed
        snapshots_on = self.enabled and bool(cfg.snapshot_every)  # an interval, or "auto"
        self.collectives = Collectives(rank, world_size, replicas=snapshots_on, board=self.board)
        ckpt_dir = Path(cfg.dir) if cfg.dir else run.checkpoints
        # The DCP tier exists when saving is off too: init_from loads through it, and the loop's stop
        # agreement asks it how long a save would take.
        self.checkpoints = CheckpointManager(
            cfg,
            ckpt_dir,
            record,
            state,
            self.collectives,
            enabled=self.enabled,
            parallel_dims=parallel_dims,
            on_commit=on_commit,
        )
        self.snapshots: SnapshotTier | None = None
        if snapshots_on:
            self.snapshots = SnapshotTier(cfg, run, record.config_hash, state, self.collectives)
        # `on_event`: (event, step, **fields) into metrics.jsonl, the snapshots' costs and intervals
        self.pacing = SnapshotPacing(cfg, rank, on_event)
        self._resumed: int | None = None
        self.restored_from = ""  # after `restore`: the tier the state came from ("" when none was loaded)
        self.saved_step = -1  # the last step after_step saved a checkpoint or took a snapshot at
        self._phase = self.clock.section  # its loads, saves and snapshots: sections of the step clock

    # -- the start ----------------------------------------------------------------------------------

    def restore(self, recorded_step: int = 0) -> int | None:
        """The step the run continues from (a snapshot newer than the newest checkpoint wins: a crash lost
        no more than it), or None when it starts at step 0 (fresh or init_from). `recorded_step`: the
        newest checkpoint the run's record says it has (see `CheckpointManager.load`)."""
        with self._phase(Phase.CHECKPOINT_LOAD, self.save_seconds_estimate()):
            step = self.snapshots.restore(self.checkpoints.ckpt_dir) if self.snapshots is not None else None
            if step is not None:
                self.checkpoints.continue_line_of_newest()  # e.g. the damaged dirs its line keeps
                self.restored_from = self.snapshots.restored_from
            else:
                step = self.checkpoints.load(recorded_step)
                self.restored_from = "checkpoint" if step is not None else ""
        if self.snapshots is not None:
            self.snapshots.prepare()  # the host buffer, allocated in the background from the loaded state
        self._resumed = step
        return step

    def save_initial(self) -> None:
        """Step 0's checkpoint, when checkpoint.save_initial asks for one and the run did not resume."""
        if self.enabled and self.cfg.save_initial and self._resumed is None:
            with self._phase(Phase.CHECKPOINT_SAVE, self.save_seconds_estimate()):
                self.checkpoints.save(0, reason="initial")

    @property
    def resumed_layout(self) -> dict[str, Any] | None:
        """World size and parallel dims of the checkpoint the run resumed from (None: not from one)."""
        return self.checkpoints.resumed_layout

    # -- every step ---------------------------------------------------------------------------------

    def after_step(self, step: int, is_last: bool) -> bool:
        """Commit a finished async save, save when due, then take the step's snapshot (none at the last
        step: the run ends there). Whether a save started (it took time the loop may account for)."""
        self.pacing.step_ended(self.snapshots.background_ended_at if self.snapshots is not None else None)
        self.checkpoints.poll()
        saved = self.enabled and self.checkpoints.should_save(step, is_last)
        if saved:
            with self._phase(Phase.CHECKPOINT_SAVE, self.save_seconds_estimate()):
                self.checkpoints.save(step, reason="final" if is_last else "interval")
            self.saved_step = step
        snapshots = self.snapshots
        if snapshots is not None and not is_last and self.pacing.due(step):
            measured = self.pacing.measuring
            with self._phase(Phase.SNAPSHOT, snapshots.last.get("blocking_s", 0.0)):
                settled = snapshots.take(step, self.pacing.times.figures())
                # its work waited for: what one costs, or clean steps to time (pacing.py); every snapshot
                # before such a one was waited for too, so `take` settled none
                if measured:
                    settled = snapshots.settle(self.pacing.times.figures())
            self.pacing.taken(step, settled, measured)
            self.saved_step = step
        elif snapshots is not None and is_last:  # the run's last snapshot: its cost recorded too
            with self._phase(Phase.SNAPSHOT, snapshots.last.get("blocking_s", 0.0)):
                self.pacing.record(snapshots.settle(self.pacing.times.figures()))
        self.pacing.resumed(snapshots is not None and snapshots.background_running)
        return saved

    def before_optimizer_step(self) -> None:
        """Every step, before the optimizer changes the state: the newest snapshot's device copies, when
        still running, go first (on the device; the host does not wait)."""
        if self.snapshots is not None:
            self.snapshots.before_update()

    @property
    def saves_by_itself(self) -> bool:
        """Whether the run takes snapshots or checkpoints on its own schedule (not only when it stops)."""
        cfg = self.cfg
        return self.snapshots is not None or (self.enabled and (cfg.interval > 0 or cfg.interval_minutes > 0))

    def save_seconds_estimate(self) -> float:
        return self.checkpoints.save_seconds_estimate()

    @property
    def last_snapshot(self) -> dict[str, float]:
        """The newest snapshot's blocking_s, waited_s (of it) and bytes (empty: none taken)."""
        return self.snapshots.last if self.snapshots is not None else {}

    # -- stops, rollbacks, the end ------------------------------------------------------------------

    def save_now(self, step: int, reason: str) -> None:
        """A stop: the step every rank stopped at, committed before this returns (nothing when off)."""
        if self.enabled:
            with self._phase(Phase.CHECKPOINT_SAVE, self.save_seconds_estimate()):
                self.checkpoints.wait()
                self.checkpoints.save(step, reason=reason)
                self.checkpoints.wait()

    def reload(self) -> int | None:
        """The run's newest checkpoint again (NaN rollback), from DCP; None when there is none."""
        self.before_optimizer_step()  # the load writes into the tensors a snapshot may still be copying
        with self._phase(Phase.CHECKPOINT_LOAD, self.save_seconds_estimate()):
            return self.checkpoints.load()

    def wait(self) -> None:
        """Until a pending save is committed and the newest snapshot's work is done, its cost recorded (a
        stop's snapshot is settled here, not by a next one). Every rank calls it at the same step."""
        self.checkpoints.wait()
        if self.snapshots is not None:
            self.pacing.record(self.snapshots.settle(self.pacing.times.figures()))

    def disk_full_failure(self, exc: BaseException, step: int) -> UserError | None:
        """When `exc` is a full disk met outside a save (the run's records, most often while an async save
        fills the disk): the pending save is settled first, so that a failed one's partial step directory
        is gone (its space free for the stop's record) and its own message, naming the checkpoint kept, is
        the run's; else one message naming the run's folder. None for any other error."""
        if isinstance(exc, UserError) or disk_full_error(exc) is None:
            return None
        try:
            self.checkpoints.wait()
        except UserError as save_failed:
            return save_failed
        except Exception as other:  # not a full disk: reported, the full disk stays the run's error
            log.error("%s", other)
        latest = read_latest(self.checkpoints.ckpt_dir)
        kept = f"the last complete checkpoint ({latest.name}) is intact" if latest else "no checkpoint yet"
        return UserError(
            f"no space left on the device at step {step} ({disk_full_error(exc)}; {kept}); free space under "
            f"{self.run.root} and {self.checkpoints.ckpt_dir} and submit the run again to continue"
        )

    def close(self, finished: bool) -> None:
        """Commit a pending save (an error is logged: safe in a ``finally``), stop the snapshot tier (its
        node folder deleted when the run `finished`, else kept for the next start), release the groups."""
        self.checkpoints.close()
        if self.snapshots is not None:
            self.snapshots.close(finished)
        self.collectives.close()

    def snapshot_slowdown_s(self) -> float:
        """Seconds so far, in this process, that steps ran slower while a snapshot's background work ran
        (the time the loop waited on saves, snapshots and restores: their sections on the step clock)."""
        return self.pacing.times.slowdown_total_s
