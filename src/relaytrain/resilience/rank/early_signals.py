"""Stop signals that arrive before the trainer's handlers exist (while torch is still importing).

A requeued job can be preempted, or reach its time-limit signal, in its first seconds. With the
default action SIGTERM/SIGUSR2 would kill the rank without a marker, so the job would neither save
nor requeue and the chain of jobs would end. The CLI captures them first thing; ShutdownController
replays them once it is installed, and the run stops (and requeues) at its first step boundary.
The task wrapper in front of each Slurm task (``relaytrain.job.task``) records the stop signals that
arrive while it starts and names them in ``RELAYTRAIN_EARLY_SIGNALS``: they count as captured here.
This module must stay free of heavy imports.
"""

from __future__ import annotations

import os
import signal

from relaytrain.job.task import EARLY_SIGNALS_ENV

EARLY_SIGNALS = ("SIGTERM", "SIGUSR2")
_pending: list[int] = []


def _remember(signum: int, frame) -> None:
    if signum not in _pending:
        _pending.append(signum)


def capture_early_signals(names: tuple[str, ...] = EARLY_SIGNALS) -> None:
    """Record stop signals instead of dying on them, until `drain_early_signals` takes them over."""
    for name in names:
        signal.signal(getattr(signal, name), _remember)
    # Consumed once: a child process of this one does not get them again.
    for name in os.environ.pop(EARLY_SIGNALS_ENV, "").split(","):
        signum = getattr(signal, name, None) if name.startswith("SIG") else None
        if isinstance(signum, signal.Signals) and signum not in _pending:
            _pending.append(signum)


def drain_early_signals() -> list[int]:
    """The signals received so far (in order), forgotten afterwards."""
    received = list(_pending)
    _pending.clear()
    return received
