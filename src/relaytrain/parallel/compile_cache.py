"""The run's compiled code kept beside it: a restarted process, or one that takes a rank's place on another
node, compiles from scratch no graph that an earlier process of the run compiled.

With ``parallel.compile``, each rank loads its file (``RunDir.compile_cache(rank)``) before its first
compile (``torch.compiler.load_cache_artifacts`` fills this node's Inductor and AOTAutograd caches from
it), and after a step in which it compiled a graph from scratch it writes every artefact of the process
over the file (``torch.compiler.save_cache_artifacts``: the graphs it compiled and those it took from the
caches). A change in the counts is a ``compile`` event in metrics.jsonl (rank 0's): ``cold``, the graphs
Inductor compiled from scratch in this process (a miss or a bypass of its FX graph cache); ``cached``, those
it took from the cache; ``loaded``, the artefacts the file held; ``saved``, whether the file was written
then. A restart whose graphs the file holds reports ``cold=0``.

A file that cannot be read or loaded (another torch version, a damaged file) costs its artefacts, never
the run: one warning, and the process compiles as it would without it. So does a file that cannot be
written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relaytrain import torch_private
from relaytrain.atomic import write_atomic
from relaytrain.job.rundir import RunDir

log = logging.getLogger("relaytrain")


class CompileCache:
    """One rank's compiled code in the run directory; a step clock reader (``step_done``) once loaded."""

    def __init__(self, path: Path, on_event: Callable[..., Any]):
        self.path, self.on_event = path, on_event
        self.loaded = 0  # artefacts the file held when this process loaded it
        self._base = torch_private.compile_cache_counts()  # an earlier run in this process is not ours
        self._reported = {key: 0 for key in self._base}  # nothing compiled yet: nothing to report
        self._saved_cold = -1  # the cold count the file holds (-1: not written by this process)

    @classmethod
    def open(cls, run: RunDir, rank: int, on_event: Callable[..., Any]) -> CompileCache:
        """The rank's cache, its file loaded: call it before the first compile."""
        cache = cls(run.compile_cache(rank), on_event)
        cache.load()
        return cache

    def load(self) -> int:
        """Fill this node's compile caches from the file; the number of artefacts it held (0: none)."""
        if not self.path.is_file():
            return 0
        try:  # torch says None for a file it cannot read (a damaged one, another torch version)
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
            problem = "torch could not read it" if info is None else ""
        except Exception as exc:  # noqa: BLE001 - any failure here costs the artefacts, never the run
            info, problem = None, str(exc)
        if info is None:
            log.warning("compile cache %s not loaded (%s): compiling as without it", self.path, problem)
            return 0
        self.loaded = sum(len(keys) for keys in info.artifacts.values())
        log.info("compile cache: %d artefacts loaded from %s", self.loaded, self.path)
        return self.loaded

    def counts(self) -> dict[str, int]:
        """This process's graphs since it opened the cache: ``cold`` and ``cached`` (see the module)."""
        now = torch_private.compile_cache_counts()
        return {key: now[key] - self._base[key] for key in now}

    def save(self) -> bool:
        """Write every compile artefact of this process over the file; False when there was none to write
        or the write failed (said in one line)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        try:
            write_atomic(self.path, saved[0], durable=False)
        except OSError as exc:
            log.warning("compile cache %s not written (%s): a restart compiles again", self.path, exc)
            return False
        return True

    def step_done(self, step: int, _seconds: float | None = None) -> None:
        """After a step: when the counts changed, the ``compile`` event, and the file written when a graph
        was compiled from scratch since it was last written (or none was loaded: a node's warm cache)."""
        counts = self.counts()
        if counts == self._reported:
            return
        self._reported = counts
        fresh = counts["cold"] > max(self._saved_cold, 0) or (self._saved_cold < 0 and not self.loaded)
        saved = fresh and self.save()
        if saved:
            self._saved_cold = counts["cold"]
        self.on_event(
            "compile", step, cold=counts["cold"], cached=counts["cached"], loaded=self.loaded, saved=saved
        )
