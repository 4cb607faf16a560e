"""Exit codes and stop reasons shared by the resilience pieces.

Exit codes are documented in docs/resilience.md. They describe what one rank did; the decision to
requeue lives in ``<run_dir>/run_state.json``, because launchers rewrite exit codes (torchrun, through
``relaytrain.job.torchrun``, exits 128 + the signal after a stop signal even when every worker saved and
exited 0; torchrun itself exits 1).
"""

from __future__ import annotations

import enum

EXIT_RESUME = 75  # EX_TEMPFAIL: stopped with a checkpoint, to be resumed (signal, time budget)
# Ctrl-C: stopped with a checkpoint because the user asked; 128 + SIGINT as a shell reports an
# interrupted command, not 75, which asks a batch script for a requeue.
EXIT_INTERRUPTED = 130
# a --command program asks for its job step to be started again inside the allocation (restart in
# place, capped by resilience.max_step_restarts, then a crash requeue): a transient failure it caught
EXIT_RESTART_STEP = 76
EXIT_HANG = 86  # the hang watchdog fired: no step finished within resilience.hang_timeout_s
EXIT_DEADLINE = 87  # the hard deadline passed after a stop request (the emergency save hung)
EXIT_NONFINITE = 88  # NaN/Inf loss or grad norm and the NaN policy said stop
# every rank stopped after a snapshot to have a straggler's node replaced by a spare or dropped
# (resilience.straggler_action): the batch job's driver starts the step again in place without it
EXIT_STRAGGLER = 89
# resilience.preflight = "exclude": every rank stopped before the first step, the nodes preflight named
# recorded in run_state.json; the same agreed stop as a straggler's (the driver decides from the record)
EXIT_PREFLIGHT = EXIT_STRAGGLER
EXIT_DOUBLE_INTERRUPT = 130  # a second Ctrl-C: exit at once, no save (128 + SIGINT, the shell convention)


class StopReason(enum.IntEnum):
    """Why a run stops. Values are ordered so that ranks agree with one MAX all-reduce.

    When ranks disagree the larger value wins: a user interrupt beats a preemption, which beats a
    time-limit signal, which beats the time budget. ``agree()`` only produces NONE..USER_INTERRUPT;
    the trainer passes the others to ``handle_stop`` itself.
    """

    NONE = 0
    STOP_AT_STEP = 1  # train.stop_at_step reached: a planned end of this job
    TIME_BUDGET = 2  # time left in the SLURM job < save estimate + resilience.time_budget_margin_s
    TIME_LIMIT_SIGNAL = 3  # resilience.slurm_signal (--signal=...@signal_lead_s), or SIGTERM near the end
    PREEMPTION = 4  # SIGTERM inside SLURM with plenty of time left: preemption (GraceTime)
    SIGNAL = 5  # a stop signal outside SLURM (kill, torchrun forwarding SIGTERM)
    USER_INTERRUPT = 6  # SIGINT (Ctrl-C)
    CANCELLED = 7  # SIGTERM from `scancel`: scontrol shows the job CANCELLED
    NAN = 8  # NaN/Inf loss or grad norm and the NaN policy stopped the run
    HANG = 9  # hang watchdog
    ERROR = 10  # an exception in the trainer
    PROGRAM_EXIT = 11  # a --command program exited 75 (or called exit_for_requeue) with no stop agreed
    # the run has checkpoints (or run_state.json records a resume) but none loads: never started over
    # without checkpoint.start_over_if_damaged, never requeued (the same files would fail again)
    DAMAGED_CHECKPOINT = 12
    # a straggler's node is to be replaced by a spare or dropped (resilience.straggler_action): every rank
    # reaches the verdict from the same gathered timings, stops after a snapshot and exits EXIT_STRAGGLER
    STRAGGLER = 13

    @property
    def label(self) -> str:
        return self.name.lower()


# Stops after which the run is resumable and the job may be requeued (if the policy allows).
REQUEUE_REASONS = frozenset(
    {StopReason.TIME_BUDGET, StopReason.TIME_LIMIT_SIGNAL, StopReason.PREEMPTION, StopReason.PROGRAM_EXIT}
)
# Time-limit stops (and a program's own request to continue, docs/programs.md) are capped by
# resilience.max_requeues; preemptions are not the job's fault.
TIME_LIMIT_REASONS = frozenset(
    {StopReason.TIME_BUDGET, StopReason.TIME_LIMIT_SIGNAL, StopReason.PROGRAM_EXIT}
)
# Real errors: the run is marked failed and never requeued.
FAILURE_REASONS = frozenset(
    {StopReason.NAN, StopReason.HANG, StopReason.ERROR, StopReason.DAMAGED_CHECKPOINT}
)
