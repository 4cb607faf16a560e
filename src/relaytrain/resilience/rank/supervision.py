"""Supervision: the one front the training loop faces for watching itself, the mirror of `Persistence`.

It owns, for one rank: the progress board and the step clock that feeds it (``job/clock.py``), the
stack signal (the node's hang watcher asks for the rank's stacks with it), the stop agreement
(``ShutdownController``), the NaN guard, the in-rank hang watchdog and the straggler watch with its stop
policy. Built at the process's start, ``watch(metrics, ...)`` once the model and the metrics exist; then
the loop makes a handful of calls:

- ``starting()`` before the state is restored (signal handlers first: a stop during the load is kept),
  ``running()`` once it is (the watchdog starts);
- ``agree(step, save_estimate_s, loss, grad_norm)`` in the optimizer section: the step's one collective
  and host read (all ranks' stop reasons and NaN flags), and the NaN policy's verdict;
- ``step_done(step)`` after each step; ``agree_after(step, reason, slow, saves)`` after its evaluation and
  saves: the stop a rank agrees to there (a stop signalled during them, `stop_at_step`, a straggler);
- ``beat()`` around long work; ``stop(reason, step, saves)`` for an agreed stop; ``record(...)`` when the
  run ends in an error; ``close(finished)`` at the end.

A program's loop (``relaytrain.program``) faces the same front, built by ``Supervision.for_program``: the
stop agreement alone (``starting``, ``agree_stop``, ``record``, ``close``), its board unpublished, as the
node's hang watcher cannot count a program's steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from relaytrain.config import Config
from relaytrain.job import marks, startup
from relaytrain.job.clock import StepClock
from relaytrain.job.progress import Phase, ProgressBoard
from relaytrain.job.rundir import RunDir
from relaytrain.resilience.codes import StopReason
from relaytrain.resilience.rank.nan_guard import NanGuard
from relaytrain.resilience.rank.shutdown import ShutdownController
from relaytrain.resilience.rank.stack_signal import StackSignal
from relaytrain.resilience.rank.straggler_watch import Metrics, Ranks, StragglerWatch
from relaytrain.resilience.rank.watchdog import HangWatchdog, backstop_timeout_s
from relaytrain.resilience.requeue import stop_fields

log = logging.getLogger("relaytrain")


class Saves(Protocol):
    """The run's persistence (checkpoint.Persistence), as a stop and the straggler's policy need it."""

    saves_by_itself: bool
    saved_step: int

    def save_seconds_estimate(self) -> float: ...

    def save_now(self, step: int, reason: str) -> None: ...

    def wait(self) -> None: ...


class Process(Ranks, Protocol):
    """This process's place in the job (parallel.DistEnv)."""

    local_rank: int


@dataclass(frozen=True)
class _ProgramPlace:
    """A program's rank as its stop agreement needs it (the other fields serve the straggler watch)."""

    rank: int
    local_rank: int
    device: torch.device


class Supervision:
    """One rank's supervision, built in two steps: the board, the clock and the stack signal at the
    process's start (the node's hang watcher sees the rank, and can ask for its stacks, from then on: a
    hang while the model is built is named with them), then ``watch`` once the model and the metrics
    exist."""

    def __init__(self, cfg: Config, env: Process, run: RunDir, *, publish: bool = True):
        self.cfg, self.env, self.run = cfg, env, run
        # Where this rank is, for the node's hang watcher (only in a job step that runs one), and its
        # stacks on the watcher's request: the board its start-up published its launch and rendezvous on.
        # Unpublished (``publish=False``, a program): the watcher sees no rank it cannot judge.
        self.board = startup.take(env.rank, env.local_rank) if publish else ProgressBoard(None, env.rank, 0)
        self.clock = StepClock(self.board, env.device)
        if publish:
            marks.publish_to(self.board)  # a checkpoint's tensors and a snapshot's chunks mark progress
        self.stacks = StackSignal.register(run.stack_dump(env.rank), self.board.enabled)
        self.watchdog: HangWatchdog | None = None

    @classmethod
    def for_program(cls, cfg: Config, rank: int, device: torch.device, run: RunDir) -> Supervision:
        """A program's supervision (``relaytrain.program``): the stop agreement alone, built on every rank
        once the process group exists (its one collective: the job's end time)."""
        place = _ProgramPlace(rank, int(os.environ.get("LOCAL_RANK", "0")), torch.device(device))
        supervision = cls(cfg, place, run, publish=False)  # type: ignore[arg-type]  (no straggler watch)
        supervision.controller = supervision._stop_agreement()
        return supervision

    def _stop_agreement(self) -> ShutdownController:
        return ShutdownController(
            self.cfg.resilience, self.env.rank, self.env.device, self.run, board=self.board
        )

    def watch(
        self,
        metrics: Metrics,
        work_modules: Sequence[torch.nn.Module] = (),
        *,
        parts: Sequence[torch.nn.Module] = (),
        compiled: bool = False,
        tensor_parallel: bool = False,
        stages: Sequence[int] | None = None,
    ) -> None:
        """The stop agreement (one collective: the job's end time), the watchdog, the NaN guard and the
        straggler watch. ``metrics``: where events go (rank 0's straggler events and per-rank times too);
        ``work_modules`` and ``compiled``: the modules whose forward is the rank's own computation
        (``ParallelModel.work_modules``), timed for the straggler watch; ``parts``: the model's parts, whose
        layers' forward and backward mark progress on the board (and each graph compiled), and whose FSDP
        all-gathers and reduce-scatters are collectives on it; ``tensor_parallel``: tensor parallelism's
        redistributions are collectives on it too (not compiled); ``stages``: each
        rank's pipeline stage (``ParallelDims.pipeline_stages``), a rank's straggler peers."""
        cfg, env, run = self.cfg, self.env, self.run
        self.metrics = metrics
        self.controller = self._stop_agreement()
        self.watchdog = HangWatchdog(  # the hang monitor's backstop, after its cap
            backstop_timeout_s(cfg.resilience.hang_timeout_s),
            env.rank,
            run.hang_dump(env.rank),
            on_fire=lambda step: self.controller.finish(StopReason.HANG, step),
        )
        self.nan_guard = NanGuard(cfg.resilience, env.device)
        self.straggler = StragglerWatch(cfg.resilience, env, self.board, metrics, cfg.slurm.min_nodes, stages)
        if self.straggler.enabled:
            self.clock.add_reader(self.straggler)
            self.clock.time_alone(work_modules, compiled=compiled)
        self.clock.mark_layers([layer for part in parts for layer in part.layers.values()], compiled=compiled)
        self.clock.publish_collectives(parts, redistributions=tensor_parallel and not compiled)
        if compiled:
            self.clock.watch_compilation()

    # -- the start ----------------------------------------------------------------------------------

    def starting(self) -> None:
        """Before the state is restored: the stop signals' handlers."""
        self.controller.install()

    def running(self) -> None:
        """The state is restored: the in-rank watchdog starts; imports no longer mark progress."""
        startup.stop_watching_imports()
        self.watchdog.start()

    # -- every step ---------------------------------------------------------------------------------

    def agree(
        self, step: int, save_estimate_s: float, loss: torch.Tensor, grad_norm: torch.Tensor | float
    ) -> tuple[StopReason, str]:
        """The step's one collective and one host read: (the stop reason all ranks agreed, the NaN policy's
        verdict on the loss and grad norm of every rank: 'ok', 'skip', 'stop' or 'rollback')."""
        flag = self.nan_guard.flag(loss, grad_norm)
        reason, bad = self.controller.agree_with(step, save_estimate_s, flag)
        return reason, self.nan_guard.decide(bad)

    def step_done(self, step: int) -> None:
        """The step finished: the watchdog's beat, then the clock's readers (the board counts the step's
        collectives; every straggler_every steps the straggler watch gathers the ranks' times)."""
        self.watchdog.beat(step)
        # Counted per step: every collective on the board, log/eval/save steps' extra ones too (loss_mean,
        # checkpoint_*). The usual count is the mode over recent steps, which those rarer steps leave at
        # the every-step count (stop_agreement); only the step after one shows a higher last count.
        self.clock.step_done(step)

    def agree_stop(self, step: int, save_estimate_s: float = 0.0) -> StopReason:
        """The stop reason every rank agreed at ``step`` (one MAX all-reduce), without the NaN guard."""
        return self.controller.agree(step, save_estimate_s)

    @property
    def stop_requested(self) -> tuple[StopReason, int]:
        """The agreed stop reason and its step (``StopReason.NONE``, -1: none agreed)."""
        return self.controller.stop_reason, self.controller.stop_step

    @property
    def last_step(self) -> int:
        """The last step the stop agreement ran at."""
        return self.controller.last_step

    def time_left(self) -> float | None:
        """Seconds until the job's end time, as every rank agreed it (None: no end time)."""
        return self.controller.time_left()

    def saved(self, step: int) -> None:
        """A save started after ``step``: progress, as the hang timeout is per unit of work."""
        self.watchdog.beat(step)

    def agree_after(self, step: int, reason: StopReason, slow: bool, saves: Saves) -> StopReason:
        """The stop after ``step``'s evaluation and saves, given the step's agreed ``reason``: ``slow`` (an
        evaluation or a save ran) agrees again, so a stop signalled during them is agreed now, not a step
        later; then `stop_at_step`, then a straggler verdict to act on (every rank: the same verdict from
        the same gathered times), once a snapshot or checkpoint of this step is taken, or at once when the
        run takes neither by itself (the stop then saves)."""
        train = self.cfg.train
        if slow:
            reason = max(reason, self.agree_stop(step, saves.save_seconds_estimate()))
        if reason == StopReason.NONE and step == train.stop_at_step < train.max_steps:
            reason = StopReason.STOP_AT_STEP
        acts = self.straggler.verdict is not None and step < train.max_steps
        if reason == StopReason.NONE and acts and (saves.saved_step == step or not saves.saves_by_itself):
            reason = StopReason.STRAGGLER
        return reason

    def beat(self) -> None:
        """Long work under way (an evaluation batch, a rollback's load): not a hang, and progress marked."""
        self.watchdog.beat()
        self.clock.mark()

    # -- the end ------------------------------------------------------------------------------------

    def stop(self, reason: StopReason, step: int, saves: Saves) -> int:
        """Save where every rank agreed to stop, then hand the decision to requeue to run_state.json; the
        exit code. A NaN stop saves nothing (the state is not finite); a straggler's stop follows a
        snapshot or checkpoint just taken when the run takes them by itself."""
        log.info("stopping at step %d: %s", step, reason.name.lower())
        self.clock.enter(Phase.STOP)
        straggler = self.straggler.verdict if reason == StopReason.STRAGGLER else None
        if reason != StopReason.NAN:
            self.controller.start_hard_deadline()
            self.watchdog.beat()
            if straggler is None or not saves.saves_by_itself:
                saves.save_now(step, reason.name.lower())
            saves.wait()
        self.metrics.log_event("stop", step, **stop_fields(reason, self.cfg.checkpoint))
        return self.controller.finish(reason, step, facts={"straggler": straggler} if straggler else None)

    def record(self, reason: StopReason, step: int, **fields: Any) -> int:
        """The run ends without the loop's save: an error (or a damaged checkpoint), or a program's own stop
        after its save. Recorded in run_state.json (rank 0), requeued where the policy says; the exit code."""
        return self.controller.finish(reason, step, **fields)

    def close(self, finished: bool, exiting: bool = True) -> None:
        """The watchdog stops, the handlers go (``finished``: the run reached its end; ``exiting``: the
        process exits next, so the stop signals stay ignored after a stop or the end, see
        ``ShutdownController.uninstall``)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.controller.uninstall(exiting=exiting, finished=finished)

    def leave(self) -> None:
        """The process leaves: the watcher sees a rank that left, not one that stopped moving."""
        self.stacks.close()
        self.board.close()
