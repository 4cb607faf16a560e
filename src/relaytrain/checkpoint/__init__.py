"""Checkpoints that are never lost: DCP save/resume with atomic commit, retention, export and import."""

from relaytrain.checkpoint.manager import CheckpointManager
from relaytrain.checkpoint.sources import load_model, read_full_state

__all__ = ["CheckpointManager", "load_model", "read_full_state"]
