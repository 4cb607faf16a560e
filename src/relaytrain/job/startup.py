"""The start-up on the progress board: a rank is visible to its node's hang watcher before its process
group exists.

The task wrapper (``job/task.py``) opens the rank's board at its first instruction, in ``LAUNCH`` (the
process start and the imports: the wrapper execs the training command, which keeps its pid); the
training command's first act marks each module it imports from then on (``watch_imports``). The training
process opens it again as it begins the rendezvous (``enter(Phase.RENDEZVOUS)``, before
``init_process_group``), then the set-up (``Phase.STARTUP``: the model's build, the loaders); the
supervision front takes that same board (``take``) and the step clock publishes the rest (the restore,
each graph's compilation, the first step). Each phase gets its own limit
(``resilience.hangs.detect.phase_limit``).
"""

from __future__ import annotations

import os
import sys

from relaytrain.job.progress import Phase, ProgressBoard

_open: list[ProgressBoard] = []  # this process's board, opened before the supervision front took it


class _ImportMarks:
    """A meta path finder that finds nothing: each module imported marks progress (the start-up's imports
    and the lazy ones of its set-up move the board, a stuck one does not)."""

    def __init__(self, board: ProgressBoard):
        self.board = board

    def find_spec(self, _name: str, _path: object = None, _target: object = None) -> None:
        self.board.mark()


def watch_imports() -> None:
    """The training process's first act: its board in ``launch`` (the task wrapper's record, the same pid),
    each import a mark until the state is restored (``stop_watching_imports``)."""
    board = enter(Phase.LAUNCH)
    if board.enabled and not any(isinstance(f, _ImportMarks) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportMarks(board))


def stop_watching_imports() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ImportMarks)]


def env_ranks(environ: dict[str, str] | os._Environ = os.environ) -> tuple[int, int]:
    """(rank, local rank) from torchrun's variables, else Slurm's (before the mapping applied them)."""
    rank = environ.get("RANK") or environ.get("SLURM_PROCID") or "0"
    local = environ.get("LOCAL_RANK") or environ.get("SLURM_LOCALID") or "0"
    return int(rank), int(local)


def enter(phase: Phase) -> ProgressBoard:
    """Publish the start-up ``phase`` (the board opened on first use, from the environment's ranks)."""
    if not _open:
        _open.append(ProgressBoard.open_from_env(*env_ranks(), phase=phase))
    else:
        _open[0].phase(phase)
    return _open[0]


def take(rank: int, local_rank: int) -> ProgressBoard:
    """The board the start-up published on, when it is this rank's, else a new one (in set-up); the next
    start-up in this process (a test's next run) opens its own."""
    if _open and _open[0].rank == rank:
        return _open.pop()
    _open.clear()
    return ProgressBoard.open_from_env(rank, local_rank)
