"""Progress marks from code that holds no progress board: a checkpoint's writer and reader threads (per
tensor written or read), a snapshot's chunks, the tokenizing of a corpus prepared at set-up (per chunk).
The supervision front points them at its rank's board (``publish_to``); anywhere else a mark is a call
that does nothing."""

from __future__ import annotations

from relaytrain.job.progress import Phase, ProgressBoard

_boards: list[ProgressBoard] = []
# The phases these marks belong to: an asynchronous save's writer threads, still writing while the loop
# trains, must not show a training phase moving while its own thread may be stuck.
PHASES = frozenset({Phase.CHECKPOINT_SAVE, Phase.CHECKPOINT_LOAD, Phase.SNAPSHOT, Phase.STARTUP})


def publish_to(board: ProgressBoard | None) -> None:
    """Marks go to ``board`` from now on (None or a board that publishes nothing: nowhere)."""
    _boards[:] = [board] if board is not None and board.enabled else []


def mark(share: float | None = None) -> None:
    """Progress in the phase under way; ``share``: the next piece's share of the phase's budget."""
    if _boards and _boards[0].phase_now in PHASES:
        _boards[0].mark(share=share)
