"""A rank's side of `resilience.survivors`: when another rank's process dies, this one stays.

Its failed collective (or the closed connections of a survivor that saw the loss first:
`sever_group_connections`) ends the trainer's run with `RankLost` instead of a crash record when the launcher
(torchrun's agent, `job/torchrun.py`) confirms a lost rank by opening a new round on its store
(`job/survivors.py`). The trainer's `train()` then rebuilds the process group in that round
(`rejoin`), in the same process (its imports, its torch runtime, its compile cache on disk and in memory),
and builds the trainer again, which restores the newest snapshot (this rank's own, in node memory) or
checkpoint: the step the failure interrupted is redone from the last step boundary every rank kept. The
replacement the launcher started joins the same round and restores the lost rank's state the same way
(from the node's snapshot folder or a peer node's copy, checked by its checksums).

Anything that goes wrong on that path (no round within `DETECT_WAIT_S`, a round that does not form
within `resilience.survivor_timeout_s`, any exception of `rejoin`) marks the round failed on the store
and ends this process as a crash: the launcher then ends every worker and fails, and the job step
restarts as without survivors (the batch driver's restart in place).

The recovery's cost is one `recovery` event in metrics.jsonl when the interrupted step is finished again:
detect (the failed collective to the launcher's confirmation), repair (the new round's process group,
which waits for the replacement's start-up), transfer (the restore, the slowest rank's), redo (the
replayed steps), each the maximum over ranks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from relaytrain.config.schema import ResilienceConfig
from relaytrain.errors import UserError
from relaytrain.job.survivors import (
    GENERATION_ENV,
    REPLACEMENTS_ENV,
    SurvivorRounds,
    sever_group_connections,
    under_agent,
)

log = logging.getLogger("relaytrain")

DETECT_WAIT_S = 10.0  # the launcher confirms a dead worker within its monitor interval (0.1 s by default)


class RankLost(Exception):
    """A rank's process died and the launcher opened round `generation` for its replacement."""

    def __init__(self, generation: int, lost_rank: int, lost_step: int, failed_at: float, seen_at: float):
        super().__init__(f"rank {lost_rank} lost at step {lost_step}; joining round {generation}")
        self.generation, self.lost_rank, self.lost_step = generation, lost_rank, lost_step
        self.failed_at, self.seen_at = failed_at, seen_at

    def detached(self) -> RankLost:
        """This loss without its traceback and cause: what they hold (the failed step's frames, the old
        trainer with its model, optimizer and process groups) can be freed before the next group."""
        self.__cause__ = self.__context__ = None
        return self.with_traceback(None)


@dataclass
class Recovery:
    """One recovery as this rank saw it (a replacement: its join and restore only)."""

    generation: int
    lost_rank: int
    lost_step: int  # the step the failure interrupted (0: a replacement, told by the survivors' maximum)
    started_at: float  # the earliest sign: the failed collective, or the launcher seeing the exit
    detect_s: float = 0.0
    repair_s: float = 0.0
    transfer_s: float = 0.0
    restored_at: float = 0.0
    restored_step: int = 0


class Survivors:
    """Built once per process by `train()`, handed to each trainer it builds."""

    def __init__(self, cfg: ResilienceConfig, environ: dict[str, str] | os._Environ = os.environ):
        several = int(environ.get("WORLD_SIZE", "1") or 1) > 1
        # relaytrain's torchrun says how many lost ranks it replaces (--survivor-replacements): without it
        # (or under torchrun itself) no replacement comes.
        replacements = int(environ.get(REPLACEMENTS_ENV, "0") or 0)
        self.on = bool(cfg.survivors) and under_agent(environ) and replacements > 0
        self.timeout_s = cfg.survivor_timeout_s
        self.generation = int(environ.get(GENERATION_ENV, "0") or 0) if self.on else 0
        self.rounds = SurvivorRounds.from_env(cfg.init_timeout_s, environ) if self.on else None
        self.recovery: Recovery | None = None
        self.store_port = int(environ.get("MASTER_PORT", "0") or 0)
        if cfg.survivors and not self.on and several:
            log.warning(
                "resilience.survivors needs several ranks under relaytrain's torchrun with "
                "--survivor-replacements=N (docs/resilience.md, Survivors); off here"
            )
        if self.rounds is not None:
            self.rounds.enable()
            if self.generation:  # a replacement: the round the launcher started it for
                lost_rank, lost_at = self.rounds.lost(self.generation)
                self.recovery = Recovery(self.generation, lost_rank, 0, lost_at)

    def replacement_store(self):
        """The store a replacement builds its process group on (None: the launcher's rendezvous)."""
        return self.rounds.group_store(self.generation) if self.generation and self.rounds else None

    def caught(self, exc: BaseException, step: int) -> RankLost | None:
        """`exc` ended the loop after `step`: a RankLost when the launcher confirms a lost rank."""
        if self.rounds is None or isinstance(exc, UserError | KeyboardInterrupt | SystemExit):
            return None
        failed_at = time.time()
        sever_group_connections(self.store_port)  # the ranks blocked in a collective with this one fail now
        generation = self.rounds.wait_generation(self.generation, DETECT_WAIT_S)
        if generation is None:
            self.rounds.fail(f"no lost rank after {type(exc).__name__}")
            return None
        lost_rank, _lost_at = self.rounds.lost(generation)
        log.warning("rank %d was lost at step %d: this rank stays (%s: %s)", lost_rank, step + 1,
                    type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")  # fmt: skip
        return RankLost(generation, lost_rank, step + 1, failed_at, time.time())

    def rejoin(self, lost: RankLost, join: Callable[[object, float], None]) -> None:
        """Build this rank's process group in round `lost.generation` (`join(store, timeout_s)`: the
        trainer's `rejoin_distributed`, which destroys the old groups first); on any failure the round is
        marked failed and the exception raised, to end this process as a crash."""
        try:
            lost_at = self.join_round(lost, join)
        except BaseException as exc:
            self.fall_back(exc)
            raise
        self.generation = lost.generation
        started = min(lost.failed_at, lost_at)
        self.recovery = Recovery(lost.generation, lost.lost_rank, lost.lost_step, started,
                                 detect_s=lost.seen_at - lost.failed_at,
                                 repair_s=time.time() - lost.seen_at)  # fmt: skip

    def join_round(self, lost: RankLost, join: Callable[[object, float], None]) -> float:
        """The group built in the new round; returns when the launcher saw the lost rank exit."""
        assert self.rounds is not None
        _rank, lost_at = self.rounds.lost(lost.generation)
        join(self.rounds.group_store(lost.generation), self.timeout_s)
        return lost_at

    def fall_back(self, exc: BaseException) -> None:
        if self.rounds is not None:
            log.error("the in-process recovery failed (%s: %s); falling back to a restart of every rank",
                      type(exc).__name__, exc)  # fmt: skip
            self.rounds.fail(f"{type(exc).__name__}: {exc}")

    def restored(self, step: int, restore_s: float, device) -> None:
        """After the trainer's restore: the ranks' recovery figures, their maxima (one MAX all-reduce on
        `device`: every rank is in the recovery when any is, the replacement too)."""
        rec = self.recovery
        if rec is None:
            return
        box = [rec.detect_s, rec.repair_s, restore_s, float(rec.lost_step), -rec.started_at]
        figures = _max_over_ranks(box, device)
        rec.detect_s, rec.repair_s, rec.transfer_s = figures[:3]
        rec.lost_step, rec.started_at = int(figures[3]), -figures[4]
        rec.restored_at, rec.restored_step = time.time(), step

    def step_done(self, step: int, log_event: Callable[..., None]) -> None:
        """`log_event("recovery", step, ...)` once `step` is the interrupted step finished again."""
        recovered = self.finished(step) if self.recovery is not None else None
        if recovered is not None:
            log_event("recovery", step, **recovered)
            if self.rounds is not None:  # the agent may start its next standby process
                self.rounds.mark_recovered(recovered["generation"])

    def finished(self, step: int) -> dict | None:
        """The `recovery` event's fields once `step` is the interrupted step finished again, else None."""
        rec = self.recovery
        if rec is None or step < rec.lost_step:
            return None
        self.recovery = None
        now = time.time()
        return {
            "generation": rec.generation,
            "lost_rank": rec.lost_rank,
            "lost_step": rec.lost_step,
            "restored_step": rec.restored_step,
            "steps_replayed": rec.lost_step - 1 - rec.restored_step,  # finished before the loss, run again
            "detect_s": round(rec.detect_s, 4),
            "repair_s": round(rec.repair_s, 4),
            "transfer_s": round(rec.transfer_s, 4),
            "redo_s": round(now - rec.restored_at, 4),
            "fault_to_step_s": round(now - rec.started_at, 4),
        }


def _max_over_ranks(values: list[float], device) -> list[float]:
    import torch
    import torch.distributed as dist

    box = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return box.tolist()
