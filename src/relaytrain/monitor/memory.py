"""Memory use of this process: the CUDA caching allocator on GPUs, the resident set on CPU."""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from relaytrain.job.progress import ProgressBoard

GIB = 1024**3


def _proc_status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (Linux), or None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def memory_stats(device: torch.device, reset_peak: bool = False) -> dict[str, float]:
    """Memory in GiB.

    CUDA: ``mem_allocated_gib`` (live tensors), ``mem_reserved_gib`` (held by the caching
    allocator), ``mem_peak_gib`` (max allocated since the last ``reset_peak=True`` call: the log
    window's peak, as the trainer calls it once per log line) and ``mem_alloc_retries`` (how often the
    allocator had to free its cache and retry a cudaMalloc since the process started: above zero, the
    run is at the edge of the device's memory and slows down).
    CPU: ``mem_rss_gib`` (resident set, Linux only) and ``mem_peak_gib`` (peak resident set).
    """
    if device.type == "cuda":
        stats = {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "mem_alloc_retries": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
        }
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return stats
    stats: dict[str, float] = {}
    rss_kib = _proc_status_kib("VmRSS")
    if rss_kib is not None:
        stats["mem_rss_gib"] = rss_kib * 1024 / GIB
    hwm_kib = _proc_status_kib("VmHWM")
    stats["mem_peak_gib"] = (hwm_kib * 1024 if hwm_kib is not None else _peak_rss_bytes()) / GIB
    return stats


def window_memory_stats(
    device: torch.device, group=None, board: ProgressBoard | None = None
) -> dict[str, float]:
    """``memory_stats`` for a log line, called on every rank at the same step: the peak is reset for the
    next window, and every figure is the maximum over the ranks of ``group`` (the default group) when
    several processes run (the rank closest to running out is the one to watch; one small all-reduce
    at log steps only, published on `board` as collective "memory_max")."""
    stats = memory_stats(device, reset_peak=True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        keys = sorted(stats)
        t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
        with board.collective("memory_max") if board is not None else contextlib.nullcontext():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        stats = dict(zip(keys, t.tolist(), strict=True))
    return stats
