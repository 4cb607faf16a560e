"""Surviving the cluster: stop signals, the time budget, requeue, hangs and NaN/Inf (docs/resilience.md)."""

from __future__ import annotations

from relaytrain.lazy import lazy_getattr

_EXPORTS = {
    "EXIT_DEADLINE": "relaytrain.resilience.codes",
    "EXIT_DOUBLE_INTERRUPT": "relaytrain.resilience.codes",
    "EXIT_HANG": "relaytrain.resilience.codes",
    "EXIT_INTERRUPTED": "relaytrain.resilience.codes",
    "EXIT_NONFINITE": "relaytrain.resilience.codes",
    "EXIT_RESUME": "relaytrain.resilience.codes",
    "HangWatchdog": "relaytrain.resilience.rank.watchdog",
    "HardDeadline": "relaytrain.resilience.rank.watchdog",
    "NanGuard": "relaytrain.resilience.rank.nan_guard",
    "RUN_STATE_FILE": "relaytrain.resilience.run_state",
    "RunLock": "relaytrain.resilience.run_lock",
    "RunState": "relaytrain.resilience.run_state",
    "RunStateError": "relaytrain.resilience.run_state",
    "RunStateFile": "relaytrain.resilience.run_state",
    "RunStatus": "relaytrain.resilience.run_state",
    "ShutdownController": "relaytrain.resilience.rank.shutdown",
    "StackSignal": "relaytrain.resilience.rank.stack_signal",
    "StopReason": "relaytrain.resilience.codes",
    "Supervision": "relaytrain.resilience.rank.supervision",
    "capture_early_signals": "relaytrain.resilience.rank.early_signals",
    "decide_requeue": "relaytrain.resilience.requeue",
    "dump_stacks": "relaytrain.resilience.rank.watchdog",
    "exit_code_for": "relaytrain.resilience.requeue",
    "finished_message": "relaytrain.resilience.requeue",
    "handle_stop": "relaytrain.resilience.requeue",
    "mark_finished": "relaytrain.resilience.requeue",
    "mark_running": "relaytrain.resilience.requeue",
    "recorded_checkpoint_step": "relaytrain.resilience.run_state",
    "recorded_step": "relaytrain.resilience.run_state",
    "stop_fields": "relaytrain.resilience.requeue",
    "take_run_lock": "relaytrain.resilience.run_lock",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
