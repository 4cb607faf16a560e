"""Checkpoints that are never lost: DCP save/resume with atomic commit, retention, export and import.

Names are imported lazily so that `relaytrain --help` and the job tools do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointManager": "relaytrain.checkpoint.manager",
    "load_model": "relaytrain.checkpoint.sources",
    "read_full_state": "relaytrain.checkpoint.sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'relaytrain.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
