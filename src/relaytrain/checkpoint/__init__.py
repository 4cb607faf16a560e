"""Checkpoints that are never lost: DCP save/resume with atomic commit, retention, export and import.

Names are imported lazily so that `relaytrain --help` and the job tools do not pay for importing torch.
"""

from __future__ import annotations

from relaytrain.lazy import lazy_getattr

_EXPORTS = {
    "CheckpointManager": "relaytrain.checkpoint.manager",
    "Persistence": "relaytrain.checkpoint.front",
    "RngState": "relaytrain.checkpoint.state",
    "RunRecord": "relaytrain.checkpoint.record",
    "TrainState": "relaytrain.checkpoint.state",
    "TrainingState": "relaytrain.checkpoint.training_state",
    "UnloadableCheckpoints": "relaytrain.checkpoint.resume",
    "load_model": "relaytrain.checkpoint.sources",
    "read_full_state": "relaytrain.checkpoint.sources",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
