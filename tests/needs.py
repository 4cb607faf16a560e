"""What a test needs from the machine: skipped on a developer's machine that lacks it, a failure under CI.

CI (``CI`` set, as ``.ci/run`` exports it) installs everything the suite needs; a test that would be
skipped there for a missing package, program or cluster hides a broken install step, so it fails.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def under_ci() -> bool:
    return bool(os.environ.get("CI"))


def skip_or_fail(reason: str) -> None:
    if under_ci():
        pytest.fail(f"CI is set, so this test must run, but: {reason}", pytrace=False)
    pytest.skip(reason)


def module(name: str) -> ModuleType:
    """Import ``name``, or skip (fail under CI) naming the install command."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        skip_or_fail(f"{name} cannot be imported ({error}); install the test extras: pip install -e '.[dev]'")
        raise  # not reached: skip_or_fail raises


def program(name: str, install: str) -> str:
    """The path of the program ``name``, or skip (fail under CI) naming how to install it."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} is not installed ({install})")
    return path
