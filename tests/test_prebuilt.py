"""tests/prebuilt.py: the test session's one build of DeepSpeed's ops survives a build that was killed,
and never waits for ever on another."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

import prebuilt


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Path:
    """An empty extension cache, and a build that does nothing (the ops' build takes minutes)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(prebuilt, "BUILD", "pass")
    return tmp_path


def test_a_baton_left_by_a_killed_build_is_removed_before_building(extensions):
    from torch.utils.cpp_extension import _get_build_directory

    batons = [
        Path(_get_build_directory(op, verbose=False)) / "lock" for op in ("cpu_adam", "deepspeed_shm_comm")
    ]
    for baton in batons:
        baton.touch()  # what a build killed between taking and leaving torch's baton leaves behind
    assert prebuilt.build_under_lock().returncode == 0
    assert not any(baton.exists() for baton in batons)


def test_a_build_held_by_another_process_too_long_fails_by_name(extensions, monkeypatch):
    monkeypatch.setattr(prebuilt, "LOCK_WAIT_S", 1)
    with open(prebuilt.lock_path(), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="was held for 1 s by another build"):
            prebuilt.build_under_lock()
