"""Stop every rank at the same step: signal flags, the time budget, and one MAX all-reduce per step.

A signal handler only records the signal: a rank blocked inside a collective runs Python handlers
late (between bytecodes), so saving from the handler is racy. At each step boundary ``agree()``
all-reduces (MAX) each rank's local stop reason, so all ranks see the same reason at the same step,
save the same checkpoint, and none is left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job import JobFacts, RunDir
from relaytrain.job.progress import ProgressBoard
from relaytrain.resilience.codes import EXIT_DOUBLE_INTERRUPT, StopReason
from relaytrain.resilience.rank.early_signals import EARLY_SIGNALS, drain_early_signals
from relaytrain.resilience.rank.watchdog import HardDeadline
from relaytrain.resilience.requeue import handle_stop

log = logging.getLogger(__name__)

# Slurm sends a --signal up to 60 s early and checks limits every 30 s: a SIGTERM this close to the
# end (on top of signal_lead_s) is the time limit, not a preemption.
TIME_LIMIT_SLACK_S = 90.0
# Two SIGINTs this close together are one Ctrl-C delivered twice (by the terminal to the whole process
# group and again by torchrun), not a second Ctrl-C.
DOUBLE_INTERRUPT_MIN_GAP_S = 1.0
# How long the hard deadline waits for a stop record in progress on the main thread (scontrol requeue
# has its own 30 s timeout) before it exits without writing one.
RECORD_WAIT_S = 45.0


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class ShutdownController:
    """Per-rank stop logic. Build it on every rank after the process group exists (it runs one
    collective to share the job's end time), ``install()`` in the main thread, then call
    ``agree(step, save_estimate_s)`` (or ``agree_with``, which also carries the NaN guard's flag) once
    per step, at the same points and the same number of times on all ranks.

    ``resilience``: the [resilience] section; ``run``: the run directory, where run_state.json and the
    hard deadline's stack dumps go; ``board``: this rank's progress board, which shows the hang watcher
    when the rank waits in the stop agreement (none: not published)."""

    def __init__(
        self,
        resilience: ResilienceConfig,
        rank: int,
        device: torch.device,
        run: RunDir,
        group=None,
        board: ProgressBoard | None = None,
    ):
        self.resilience = resilience
        self.rank = rank
        self.board = board if board is not None else ProgressBoard(None, rank, 0)
        self.device = torch.device(device)
        self.group = group
        self.run = run
        self.job = JobFacts.from_env()
        self.in_slurm = self.job.in_slurm
        self.stop_reason = StopReason.NONE
        self.stop_step = -1
        self.last_step = 0
        self._signals: list[int] = []  # in arrival order; written only by the handler
        self._first_sigint_at: float | None = None
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends of signal.set_wakeup_fd's pipe
        self._previous_wakeup_fd = -1
        # The stop is recorded (run_state.json, requeue) once: by finish() or by the hard deadline.
        self._record_lock = threading.Lock()
        self._recorded = False
        self.end_time, self.end_source, self.preempted_at = self._shared_end_time()
        self.deadline = HardDeadline(
            self.resilience.hard_deadline_s,
            rank,
            run.deadline_dump(rank),
            describe=self._describe,
            on_expire=self._on_deadline,
        )

    # -- the job's end time -------------------------------------------------------------------------
    def _shared_end_time(self) -> tuple[float | None, str, float | None]:
        """(the job's end time, where it came from, when Slurm began to preempt the job), as rank 0
        read them. The preemption is read after the end time: a preemption that begins between the two
        reads still names the (then shortened) end time's cause."""
        end, source, preempted = None, "", None
        if self.rank == 0:
            end, source = self.job.end_time()
            preempted = self.job.preempt_time(source) if end is not None else None
        if _world(self.group) > 1:  # one scontrol query per job, not per rank
            t = torch.tensor(
                [end if end is not None else -1.0, preempted if preempted is not None else -1.0],
                dtype=torch.float64,
                device=self.device,
            )
            with self.board.collective("job_end_time"):
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            end = float(t[0].item()) if t[0].item() > 0 else None
            preempted = float(t[1].item()) if t[1].item() > 0 else None
            source = source or "rank 0"
        if self.rank == 0:
            if end is None:
                log.info("job end time unknown (%s): no time-budget stop", source)
            elif preempted is not None:
                log.warning(
                    "the job is being preempted (since %s): Slurm ends it at %s, %.0f s from now; a "
                    "stop now is a preemption",
                    time.strftime("%H:%M:%S", time.localtime(preempted)),
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end)),
                    end - time.time(),
                )
            else:
                log.info(
                    "job ends at %s (%s, %.0f s from now): the run stops with a checkpoint when less "
                    "than save estimate + %.0f s remain",
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end)),
                    source,
                    end - time.time(),
                    self.resilience.time_budget_margin_s,
                )
                if end - time.time() < self.resilience.time_budget_margin_s:
                    log.warning(
                        "the job has less time left (%.0f s) than resilience.time_budget_margin_s="
                        "%.0f: it will stop after its first step",
                        end - time.time(),
                        self.resilience.time_budget_margin_s,
                    )
        return end, source, preempted

    def time_left(self) -> float | None:
        return None if self.end_time is None else self.end_time - time.time()

    # -- signals ------------------------------------------------------------------------------------
    def install(self) -> None:
        """Install the handlers for resilience.signals (main thread only) and arm the hard deadline.

        The start-up recorder's signals that resilience.signals does not list get their default
        action back; one of them that arrived during start-up is delivered again, with that action.
        """
        for name in self.resilience.signals:
            signum = getattr(signal, name)
            if name == "SIGUSR1" and self.device.type == "cuda":
                log.warning("resilience.signals has SIGUSR1, which NCCL uses internally; prefer SIGUSR2")
            self._previous[signum] = signal.signal(signum, self._handle)
        unlisted = [getattr(signal, n) for n in EARLY_SIGNALS if getattr(signal, n) not in self._previous]
        for signum in unlisted:
            signal.signal(signum, signal.SIG_DFL)
        for signum in drain_early_signals():
            if signum in self._previous:
                log.info(
                    "%s arrived during start-up: the run stops at its first step boundary",
                    signal.Signals(signum).name,
                )
                self._handle(signum, None)
            else:
                log.warning(
                    "%s arrived during start-up and is not in resilience.signals: its default action applies",
                    signal.Signals(signum).name,
                )
                signal.raise_signal(signum)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C-level handler must never block on a full pipe
        self._wakeup = (read_fd, write_fd)
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self.deadline.arm(read_fd, frozenset(self._previous))

    def uninstall(self, exiting: bool = False, finished: bool = False) -> None:
        """Restore the previous handlers and cancel the hard deadline.

        ``exiting=True`` (the trainer, right before the process exits): after a stop request, once
        a stop was recorded (``finish``: a program's own exit 75 needs no signal), or once the run
        ``finished``, the stop signals other than SIGINT are ignored from here on, and the hard
        deadline keeps running. A time-limit signal that reaches a finished run while it exits must
        not kill it (exit 140 would fail the job whose run is complete).
        torchrun SIGTERMs the other workers as soon as one exits with a non-zero code (75), and they
        may still be tearing down; SIG_IGN (unlike a Python handler, which interpreter finalization
        resets to the default) keeps their clean 75 from turning into -15.
        """
        if exiting and (self.stop_requested or self._recorded or finished):
            for signum in self._previous:
                if signum != signal.SIGINT:
                    signal.signal(signum, signal.SIG_IGN)
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        self.deadline.cancel()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    @property
    def stop_requested(self) -> bool:
        return bool(self._signals) or self.stop_reason != StopReason.NONE

    def _handle(self, signum: int, frame) -> None:
        # Only assignments and a raw write: no locks, no logging (the main thread may hold them).
        if signum == signal.SIGINT:
            now = time.monotonic()
            if (
                self._first_sigint_at is not None
                and now - self._first_sigint_at >= DOUBLE_INTERRUPT_MIN_GAP_S
            ):
                os.write(2, f"relaytrain: second Ctrl-C on rank {self.rank}: exiting now, no save\n".encode())
                os._exit(EXIT_DOUBLE_INTERRUPT)
            if self._first_sigint_at is None:
                self._first_sigint_at = now
        if signum not in self._signals:
            self._signals.append(signum)
        self.deadline.trigger()

    def classify(self, signum: int) -> StopReason:
        """The stop reason one received signal stands for (the rule in docs/resilience.md)."""
        name = signal.Signals(signum).name
        if name == "SIGINT":
            return StopReason.USER_INTERRUPT
        left = self.time_left()
        if name == self.resilience.slurm_signal and name != "SIGTERM":
            if not self.in_slurm:
                return StopReason.SIGNAL  # sent by hand: no scheduler sends a time-limit signal here
            too_early = left is not None and left > self.resilience.signal_lead_s + TIME_LIMIT_SLACK_S
            if too_early or not self.job.sends_pre_timeout_signal(name):
                # Not Slurm's --signal (far too early, or the job asked for none): someone ran
                # `scancel --signal` (`relaytrain cancel --signal`) to stop the run with a checkpoint;
                # requeuing would restart it.
                return StopReason.CANCELLED
            return StopReason.TIME_LIMIT_SIGNAL
        if not self.in_slurm:
            return StopReason.SIGNAL
        if self.preempted_at is not None:  # the end time near is the preemption's grace time
            return StopReason.PREEMPTION
        if left is not None and left <= self.resilience.signal_lead_s + TIME_LIMIT_SLACK_S:
            return StopReason.TIME_LIMIT_SIGNAL
        return StopReason.PREEMPTION

    def local_reason(self, save_estimate_s: float = 0.0) -> StopReason:
        """This rank's view, before agreeing: received signals, then the time budget."""
        reason = max((self.classify(s) for s in list(self._signals)), default=StopReason.NONE)
        left = self.time_left()
        if left is not None and left < save_estimate_s + self.resilience.time_budget_margin_s:
            # A preempted job's time runs out at the grace time's end: that stop is the preemption's.
            budget = StopReason.TIME_BUDGET if self.preempted_at is None else StopReason.PREEMPTION
            reason = max(reason, budget)
        return StopReason(reason)

    # -- the one collective per step ----------------------------------------------------------------
    def agree(self, step: int, save_estimate_s: float = 0.0) -> StopReason:
        """MAX over ranks of the local stop reasons. Every rank must call it at the same points."""
        return self.agree_with(step, save_estimate_s)[0]

    def agree_with(
        self, step: int, save_estimate_s: float = 0.0, flag: torch.Tensor | None = None
    ) -> tuple[StopReason, bool]:
        """``agree`` plus the MAX over ranks of ``flag`` (a 1-element 0/1 tensor on this device, the NaN
        guard's) in the same all-reduce and the same single host read: the trainer's one synchronisation
        per step. Returns the agreed stop reason and whether any rank raised the flag."""
        reason, flagged = self.local_reason(save_estimate_s), False
        if _world(self.group) > 1 or flag is not None:
            # torch.full launches a fill: no host-to-device copy (a synchronisation on CUDA)
            parts = [torch.full((1,), int(reason), dtype=torch.int64, device=self.device)]
            if flag is not None:
                parts.append(flag.reshape(1).to(device=self.device, dtype=torch.int64))
            t = torch.cat(parts)
            if _world(self.group) > 1:
                # left once the result is on the host: with NCCL the all-reduce itself only queues
                with self.board.collective("stop_agreement"):
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                    values = t.tolist()  # the one read
            else:
                values = t.tolist()
            reason, flagged = StopReason(int(values[0])), bool(flag is not None and values[1])
        self.last_step = step
        if reason != StopReason.NONE and self.stop_reason == StopReason.NONE:
            self.stop_reason, self.stop_step = reason, step
            self.start_hard_deadline()
            if self.rank == 0:
                left = self.time_left()
                log.warning(
                    "stop agreed by all ranks at step %d: %s%s; saving a checkpoint",
                    step,
                    reason.label,
                    "" if left is None else f" ({left:.0f} s left in the job)",
                )
        return max(reason, self.stop_reason), flagged

    def start_hard_deadline(self) -> None:
        """Start the hard-deadline clock (idempotent); agree() does it when a stop is agreed."""
        self.deadline.arm()
        self.deadline.trigger()

    def _describe(self) -> str:
        reason = self.stop_reason if self.stop_reason != StopReason.NONE else self.local_reason()
        return f"step {self.last_step}, stop reason {reason.label}"

    # -- the end of a stop ---------------------------------------------------------------------------
    def finish(
        self,
        reason: StopReason,
        step: int,
        *,
        saved: bool = True,
        message: str = "",
        user_error: str = "",
        facts: Mapping[str, Any] | None = None,
    ) -> int:
        """Record the stop (rank 0: run_state.json and requeue), disarm the hard deadline, return the
        exit code. Call it on every rank once the stop's checkpoint is complete (or after an error).

        ``user_error``: the message of a UserError the run failed with (not retried by the end of the step).
        ``facts``: more fields for run_state.json (a straggler stop's ``straggler``).
        Whatever teardown follows is no longer the stop's business: a hard deadline still armed would
        requeue a second time and mark the saved stop as not saved.
        """
        with self._record_lock:
            code = handle_stop(
                self.resilience,
                self.run,
                reason,
                step,
                self.rank,
                saved=saved,
                message=message,
                user_error=user_error,
                facts=facts,
            )
            self._recorded = True
        self.deadline.cancel()
        return code

    def _on_deadline(self) -> bool:
        """The hard deadline expired: record the stop as not saved, unless finish() got there first."""
        if not self._record_lock.acquire(timeout=RECORD_WAIT_S):
            return True  # the main thread is stuck writing the record: exit without one
        try:
            if self._recorded:
                return False  # the stop completed while the deadline expired: nothing is stuck
            self._recorded = True
            if self.rank == 0:
                reason = self.stop_reason if self.stop_reason != StopReason.NONE else self.local_reason()
                handle_stop(
                    self.resilience,
                    self.run,
                    reason,
                    self.last_step,
                    self.rank,
                    saved=False,
                    message=(
                        f"hard deadline: the save did not finish within {self.resilience.hard_deadline_s:g} s"
                    ),
                )
            return True
        finally:
            self._record_lock.release()
