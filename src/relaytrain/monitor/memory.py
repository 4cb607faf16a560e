"""Memory use of this process: the CUDA caching allocator on GPUs, the resident set on CPU."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

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


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in GiB.

    CUDA: ``mem_allocated_gib`` (live tensors), ``mem_reserved_gib`` (held by the caching
    allocator) and ``mem_peak_gib`` (max allocated since the process started).
    CPU: ``mem_rss_gib`` (resident set, Linux only) and ``mem_peak_gib`` (peak resident set).
    """
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        }
    stats: dict[str, float] = {}
    rss_kib = _proc_status_kib("VmRSS")
    if rss_kib is not None:
        stats["mem_rss_gib"] = rss_kib * 1024 / GIB
    hwm_kib = _proc_status_kib("VmHWM")
    stats["mem_peak_gib"] = (hwm_kib * 1024 if hwm_kib is not None else _peak_rss_bytes()) / GIB
    return stats
