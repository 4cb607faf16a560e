"""parallel.compile keeps the run's compiled code (parallel/compile_cache.py): a restarted process on a node
whose compile caches are empty (another node, a fresh /tmp) loads the rank's file and compiles no graph
from scratch; a file it cannot load costs its artefacts, never the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relaytrain import torch_private
from relaytrain.job.rundir import RunDir
from relaytrain.parallel.compile_cache import CompileCache

from conftest import TINY, run_cli


def _compile_events(run: RunDir) -> list[dict]:
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    return [r for r in rows if r.get("event") == "compile"]


@pytest.mark.slow
def test_a_restart_on_an_empty_compile_cache_compiles_nothing_from_scratch(tmp_path):
    """Run 1 compiles (cold > 0) and writes the file; run 2 resumes it with an empty Inductor cache folder,
    as a process on another node would, and takes every graph from the file (cold == 0)."""
    args = ["train", *TINY, f"--run.dir={tmp_path / 'runs'}", "--run.name=r", "--parallel.compile=true"]
    args += ["--checkpoint.interval=2"]
    run = RunDir(tmp_path / "runs" / "r")
    first = run_cli(
        [*args, "--train.max_steps=2"], tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "node_a")
    )
    assert first.returncode == 0, first.stderr[-3000:]
    (event,) = _compile_events(run)[:1]
    assert event["cold"] > 0 and event["saved"] and event["loaded"] == 0, event
    assert run.compile_cache(0).stat().st_size > 0

    second = run_cli(
        [*args, "--train.max_steps=4"], tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "node_b")
    )
    assert second.returncode == 0, second.stderr[-3000:]
    restarted = _compile_events(run)[1:]
    assert restarted, "the restart reported no compile"
    assert restarted[0]["loaded"] > 0 and restarted[0]["cached"] > 0, restarted
    assert all(e["cold"] == 0 for e in restarted), restarted


def test_a_damaged_file_costs_its_artefacts_not_the_run(tmp_path, caplog):
    run = RunDir(tmp_path)
    run.compile_cache(0).parent.mkdir(parents=True)
    run.compile_cache(0).write_bytes(b"not a cache")
    cache = CompileCache.open(run, 0, lambda *a, **k: None)
    assert cache.loaded == 0
    assert "not loaded" in caplog.text


class _Counts:
    """The process's compile counts and the artefacts it would save, set by the test."""

    def __init__(self, monkeypatch):
        self.now = {"cold": 0, "cached": 0}
        self.writes = 0
        monkeypatch.setattr(torch_private, "compile_cache_counts", lambda: dict(self.now))
        monkeypatch.setattr(torch.compiler, "save_cache_artifacts", self._save)

    def _save(self):
        self.writes += 1
        return (b"artefacts", None)


def test_the_file_is_written_after_each_step_that_compiled_from_scratch(tmp_path, monkeypatch):
    counts, events = _Counts(monkeypatch), []
    cache = CompileCache(RunDir(tmp_path).compile_cache(0), lambda event, step, **f: events.append((step, f)))
    cache.step_done(1)  # nothing compiled yet: no event, no file
    assert not events and counts.writes == 0
    counts.now = {"cold": 3, "cached": 0}
    cache.step_done(2)
    counts.now = {"cold": 3, "cached": 1}  # a graph taken from the cache: reported, not written again
    cache.step_done(3)
    counts.now = {"cold": 4, "cached": 1}  # a new shape compiled: written again
    cache.step_done(4)
    assert [(s, f["cold"], f["saved"]) for s, f in events] == [(2, 3, True), (3, 3, False), (4, 4, True)]
    assert counts.writes == 2 and RunDir(tmp_path).compile_cache(0).read_bytes() == b"artefacts"


def test_a_node_warm_cache_is_kept_once_when_no_file_was_loaded(tmp_path, monkeypatch):
    counts, events = _Counts(monkeypatch), []
    cache = CompileCache(RunDir(tmp_path).compile_cache(0), lambda event, step, **f: events.append(f))
    counts.now = {"cold": 0, "cached": 2}
    cache.step_done(1)
    counts.now = {"cold": 0, "cached": 4}
    cache.step_done(2)
    assert [e["saved"] for e in events] == [True, False] and counts.writes == 1


def test_counts_are_the_process_s_since_the_cache_opened(monkeypatch):
    counts = _Counts(monkeypatch)
    counts.now = {"cold": 5, "cached": 2}  # an earlier run in this process
    cache = CompileCache(Path("unused"), lambda *a, **k: None)
    counts.now = {"cold": 6, "cached": 2}
    assert cache.counts() == {"cold": 1, "cached": 0}
