"""relaytrain's version, at the bottom layer so that any package may record it (checkpoints, exports)."""

__version__ = "0.1.0"
