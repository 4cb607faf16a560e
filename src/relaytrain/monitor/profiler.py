"""torch.profiler over a window of steps, and CUDA memory snapshots.

``metrics.profile_steps = [start, end)`` profiles steps start..end-1 on every rank, writes one
chrome trace per rank to ``<run_dir>/profile/trace_rank<R>_steps<start>-<end>.json`` (open it in
https://ui.perfetto.dev or chrome://tracing), and rank 0 logs where the time went: compute,
communication (collectives) and other. On CUDA the window also records allocator history and
dumps ``memory_rank<R>_steps<start>-<end>.pickle`` (drag it onto https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from relaytrain.config.schema import MetricsConfig
from relaytrain.errors import UserError
from relaytrain.job.rundir import RunDir
from relaytrain.torch_private import dump_cuda_memory_snapshot, record_cuda_memory_history

log = logging.getLogger(__name__)

COLLECTIVE_MARKERS = (
    "c10d::",
    "nccl",
    "gloo",
    "rccl",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "reducescatter",
    "all_to_all",
    "alltoall",
)
# Ops that are bookkeeping rather than math: step markers, user annotations, copies, allocation.
OTHER_PREFIXES = (
    "ProfilerStep",
    "Optimizer.",
    "## ",
    "cudaMemcpy",
    "Memcpy",
    "Memset",
    "cudaStream",
    "cudaEvent",
)
OTHER_OPS = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::empty", "aten::empty_strided", "aten::zero_")


def classify_op(name: str) -> str:
    """'communication', 'compute' or 'other' for one profiler op or kernel name."""
    lowered = name.lower()
    if any(marker in lowered for marker in COLLECTIVE_MARKERS):
        return "communication"
    if name.startswith(OTHER_PREFIXES) or name in OTHER_OPS:
        return "other"
    return "compute"


def summarize_profile(prof: profile) -> dict[str, float]:
    """Self time per category in seconds (device time when the trace has kernels, else CPU)."""
    averages = prof.key_averages()
    device_total = sum(getattr(evt, "self_device_time_total", 0.0) for evt in averages)
    use_device = device_total > 0
    totals = {"compute": 0.0, "communication": 0.0, "other": 0.0}
    for evt in averages:
        us = evt.self_device_time_total if use_device else evt.self_cpu_time_total
        totals[classify_op(evt.key)] += us / 1e6
    totals["basis_is_device"] = float(use_device)
    return totals


def format_summary(totals: dict[str, float], steps: int) -> str:
    spent = totals["compute"] + totals["communication"] + totals["other"]
    basis = "device" if totals.get("basis_is_device") else "CPU"
    parts = [
        f"{name} {totals[name] / max(steps, 1) * 1e3:.1f} ms/step ({100 * totals[name] / spent:.0f}%)"
        for name in ("compute", "communication", "other")
        if spent > 0
    ]
    return f"profile of {steps} steps, {basis} self time: " + ", ".join(parts)


def record_memory_history(device: torch.device, enabled: bool = True, max_entries: int = 100_000) -> bool:
    """Start (or stop) recording CUDA allocations for a later snapshot; False on CPU."""
    if device.type != "cuda":
        log.info("CUDA memory history is CUDA-only; nothing recorded on %s", device.type)
        return False
    record_cuda_memory_history(enabled, max_entries)
    return True


def dump_memory_snapshot(device: torch.device, path: Path) -> Path | None:
    """Write the CUDA allocator snapshot (with history, if recording) to ``path``."""
    if device.type != "cuda":
        log.info("CUDA memory snapshots are CUDA-only; none written on %s", device.type)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_cuda_memory_snapshot(path)
    log.info("CUDA memory snapshot written to %s", path)
    return path


class StepProfiler:
    """Profiles the steps in ``metrics.profile_steps = [start, end)``.

    Call ``step(n)`` whenever ``n`` steps are complete: once before the loop with the step the job
    starts from (so a window that begins at the first step is caught) and after every step. The
    profiler starts when step ``n + 1`` falls in the window and stops, writing its trace, once
    step ``end - 1`` is done. Outside the window ``step`` costs nothing. ``close()`` (also safe
    when nothing ran) writes what was captured if the run stops inside the window.
    """

    def __init__(self, mcfg: MetricsConfig, run: RunDir, rank: int, device: torch.device):
        window = list(mcfg.profile_steps)
        if window and (len(window) != 2 or not 0 <= window[0] < window[1]):
            raise UserError(f"metrics.profile_steps must be [start, end) with 0 <= start < end, got {window}")
        self.window = tuple(window)
        self.out_dir = run.profile
        self.rank = rank
        self.device = device
        self._prof: profile | None = None
        self._step_span: record_function | None = None
        self._first = self._last = 0
        self.trace_path: Path | None = None
        self.summary: dict[str, float] | None = None

    def step(self, done: int) -> None:
        if not self.window:
            return
        start, end = self.window
        if self._prof is not None:
            self._end_span()
            self._last = done
            if done + 1 >= end:
                self.close()
                return
        elif start <= done + 1 < end and self.trace_path is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
                record_memory_history(self.device)
            self._prof = profile(activities=activities, record_shapes=True)
            self._prof.start()
            self._first = self._last = done + 1
        if self._prof is not None:
            # Names the coming step by its training step number (profile.step() counts from 0).
            self._step_span = record_function(f"ProfilerStep#{done + 1}")
            self._step_span.__enter__()

    def _end_span(self) -> None:
        if self._step_span is not None:
            self._step_span.__exit__(None, None, None)
            self._step_span = None

    def close(self) -> None:
        if self._prof is None:
            return
        self._end_span()
        prof, self._prof = self._prof, None
        prof.stop()
        start, end = self.window
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.out_dir / f"trace_rank{self.rank}_steps{start}-{end}.json"
        prof.export_chrome_trace(str(self.trace_path))
        if self.device.type == "cuda":
            snapshot = self.out_dir / f"memory_rank{self.rank}_steps{start}-{end}.pickle"
            dump_memory_snapshot(self.device, snapshot)
            record_memory_history(self.device, enabled=False)
        self.summary = summarize_profile(prof)
        steps = max(self._last - self._first + 1, 1)
        if self.rank == 0:
            log.info("%s; traces in %s", format_summary(self.summary, steps), self.out_dir)
