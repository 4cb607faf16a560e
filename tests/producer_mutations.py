"""`relaytrain train` with one producer of `relaytrain verify`'s evidence broken on purpose, for
tests/test_verify_producers.py: the file is run as the training program (directly, or by torchrun as each
rank), patches the trainer's code named by `$PRODUCER_MUTATION`, then runs the real CLI. The mutations
break what the run does, not the files it leaves:

- `reseed`: the train loader re-seeded on resume (its saved seed + 1);
- `skip_batch`: the resume position one global batch ahead of the saved one;
- `other_shard`: each data-parallel rank of two reads the other rank's share (its record says its own);
- `drop_windows`: the trainer's ledger windows never written;
- `unrecorded_stop`: a stop whose event (and so its time) is never written;
- `saves_productive`: the ledger windows' checkpoint saves not taken out of their step time (productive
  inflated by the saves' time).
"""

from __future__ import annotations

import os
import sys

from relaytrain.cli import main
from relaytrain.data.loader import TrainLoader
from relaytrain.monitor import time_ledger
from relaytrain.monitor.metrics import MetricsLogger
from relaytrain.monitor.time_ledger import LedgerWindows


def _reseed() -> None:
    load = TrainLoader.load_state_dict

    def reseeded(self, state):
        load(self, state)
        self._set_seed(self.seed + 1)

    TrainLoader.load_state_dict = reseeded


def _skip_batch() -> None:
    load = TrainLoader.load_state_dict

    def ahead(self, state):
        load(self, state)
        self.samples_consumed += self.global_batch_size

    TrainLoader.load_state_dict = ahead


def _other_shard() -> None:
    read = TrainLoader.token_windows

    def other(self, start, count):
        return read(self, start + (1 - 2 * self.dp_rank) * count if self.dp_size == 2 else start, count)

    TrainLoader.token_windows = other


def _drop_windows() -> None:
    LedgerWindows.close_window = lambda self, step: None


def _unrecorded_stop() -> None:
    log_event = MetricsLogger.log_event

    def without_stop(self, event, step, **fields):
        if event != "stop":
            log_event(self, event, step, **fields)

    MetricsLogger.log_event = without_stop


def _saves_productive() -> None:
    time_ledger.PART_OF = {phase: part for phase, part in time_ledger.PART_OF.items() if part != "checkpoint"}


MUTATIONS = {
    "reseed": _reseed,
    "skip_batch": _skip_batch,
    "other_shard": _other_shard,
    "drop_windows": _drop_windows,
    "unrecorded_stop": _unrecorded_stop,
    "saves_productive": _saves_productive,
}

if __name__ == "__main__":
    MUTATIONS[os.environ["PRODUCER_MUTATION"]]()
    sys.exit(main(sys.argv[1:]))
