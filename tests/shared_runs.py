"""A run made once per test session and read by several tests, whichever xdist worker asks first.

A module- or session-scoped fixture runs once per xdist worker: two tests of one module that land on two
workers (the suite's `--dist loadgroup` hands out tests one by one) each paid for the same reference run.
Here the first worker to ask makes it under a lock in the session's shared temporary folder; the others
wait for it (wall time, no CPU) and read the same folder.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def once_per_session(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """The folder `make(folder)` filled, made once per session; a `make` that raised is tried again by the
    next caller (each test that needs it then shows the failure)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base folder is inside the session's
    folder, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            if folder.exists():  # a failed attempt's leftovers
                shutil.rmtree(folder)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder
