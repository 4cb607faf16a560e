"""Surviving the cluster: stop signals, the time budget, requeue, hangs and NaN/Inf (docs/resilience.md)."""

from relaytrain.resilience.codes import (
    EXIT_DEADLINE,
    EXIT_DOUBLE_INTERRUPT,
    EXIT_HANG,
    EXIT_NONFINITE,
    EXIT_RESUME,
    StopReason,
)
from relaytrain.resilience.job_time import FAKE_END_TIME_ENV, job_end_time
from relaytrain.resilience.nan_guard import INJECT_STEPS_ENV, NanGuard, NanInjector
from relaytrain.resilience.requeue import (
    SlurmJob,
    decide_requeue,
    finished_message,
    handle_stop,
    mark_finished,
    mark_running,
)
from relaytrain.resilience.run_state import RUN_STATE_FILE, RunStateFile
from relaytrain.resilience.shutdown import ShutdownController
from relaytrain.resilience.watchdog import HangWatchdog, HardDeadline, dump_stacks

__all__ = [
    "EXIT_DEADLINE",
    "EXIT_DOUBLE_INTERRUPT",
    "EXIT_HANG",
    "EXIT_NONFINITE",
    "EXIT_RESUME",
    "FAKE_END_TIME_ENV",
    "INJECT_STEPS_ENV",
    "RUN_STATE_FILE",
    "HangWatchdog",
    "HardDeadline",
    "NanGuard",
    "NanInjector",
    "RunStateFile",
    "ShutdownController",
    "SlurmJob",
    "StopReason",
    "decide_requeue",
    "dump_stacks",
    "finished_message",
    "handle_stop",
    "job_end_time",
    "mark_finished",
    "mark_running",
]
