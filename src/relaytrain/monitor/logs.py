"""Rank-tagged logging: one file per rank, rank 0 on the console, warnings from every rank.

Every line carries a timestamp and ``[rank R NODE local L]``, so lines from many ranks
interleaved in one SLURM output file can still be told apart.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from relaytrain.job.rundir import RunDir

_OWNED = "_relaytrain_handler"  # marks handlers installed here so a second call replaces them


class _CurrentStream(logging.StreamHandler):
    """Writes to whatever sys.stdout / sys.stderr is at emit time.

    A live rich progress bar swaps sys.stdout for a proxy that prints above the bar; a handler
    that captured the original stream at setup would draw through the bar instead.
    """

    def __init__(self, name: str):
        super().__init__()
        self._name = name

    @property  # type: ignore[override]
    def stream(self):
        return getattr(sys, self._name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass


class _RankLogFile(logging.FileHandler):
    """A rank's log file that, when a write fails (a full disk), says so once, not a traceback a line."""

    _reported = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if not self._reported:
            self._reported = True
            error = sys.exc_info()[1]
            print(f"relaytrain: cannot write {self.baseFilename} ({error}); console only", file=sys.stderr)


def setup_logging(run: RunDir, rank: int, local_rank: int, node: str, rank_logs: bool) -> Path | None:
    """Configure the root logger for this process; returns the rank's log file (or None).

    - ``rank_logs``: every rank writes all its INFO+ lines to ``<run_dir>/logs/rank_<rank>.log``
      (append mode, so requeued jobs continue the same file).
    - Rank 0 prints INFO+ to stdout; other ranks print only WARNING+ to stderr.
    Calling it again replaces the handlers it installed before; plain stdout/stderr handlers
    (``logging.basicConfig``) are replaced too.
    """
    fmt = logging.Formatter(
        f"%(asctime)s [rank {rank} {node} local {local_rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    root = logging.getLogger()
    consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for handler in list(root.handlers):
        # Ours from an earlier call, and plain console handlers (logging.basicConfig in the CLI):
        # left in place they would print every rank's INFO lines untagged.
        plain_console = type(handler) is logging.StreamHandler and handler.stream in consoles
        if getattr(handler, _OWNED, False) or plain_console:
            root.removeHandler(handler)
            if getattr(handler, _OWNED, False):
                handler.close()
    root.setLevel(logging.INFO)

    console = _CurrentStream("stdout") if rank == 0 else _CurrentStream("stderr")
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    handlers: list[logging.Handler] = [console]

    log_file = None
    if rank_logs:
        log_file = run.rank_log(rank)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = _RankLogFile(log_file, mode="a", encoding="utf-8")
        file_handler.setLevel(logging.INFO)
        handlers.append(file_handler)

    for handler in handlers:
        handler.setFormatter(fmt)
        setattr(handler, _OWNED, True)
        root.addHandler(handler)
    logging.captureWarnings(True)
    return log_file
