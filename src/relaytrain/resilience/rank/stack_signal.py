"""Every thread's Python stack, on the node hang watcher's request: faulthandler on ``STACK_SIGNAL``.

faulthandler writes from its C-level signal handler, so a rank whose main thread is stuck in a C call
(a collective, a read that never returns) still answers; the Python-level handlers of the stop signals
would run only once the call returns. Registered only where the watcher exists (the progress board is
enabled): a run outside a Slurm job has nobody who sends the signal.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path
from typing import IO

from relaytrain.job.progress import STACK_SIGNAL


class StackSignal:
    """``StackSignal.register(path)``: each ``STACK_SIGNAL`` appends every thread's stack to ``path``
    (the process continues); ``close()`` gives the signal back to its previous (ignoring) action."""

    def __init__(self, file: IO[str] | None):
        self._file = file

    @classmethod
    def register(cls, path: Path, enabled: bool = True) -> StackSignal:
        if not enabled:
            return cls(None)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            file = open(path, "a")  # noqa: SIM115  faulthandler writes to its descriptor until close()
        except OSError:  # no stacks on request costs the hang report a detail, never the run
            return cls(None)
        # chain=False: SIGURG's default action (ignore) is all there is to chain to
        faulthandler.register(STACK_SIGNAL, file=file, all_threads=True, chain=False)
        return cls(file)

    @property
    def registered(self) -> bool:
        return self._file is not None

    def close(self) -> None:
        if self._file is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._file.close()
            self._file = None
