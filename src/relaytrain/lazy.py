"""Lazy package exports (PEP 562): `from relaytrain.data import X` imports X's module on first use.

Packages use it so that light entry points (`relaytrain --help`, the job tools, the GPU sampler,
tokenizing workers, the early signal capture) do not pay seconds for importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` that resolves `exports` (name -> defining module) on demand."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
