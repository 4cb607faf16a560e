"""The per-node measurements of preflight, each within a time budget.

Every function returns plain numbers (JSON-ready). The free-space readings take their reader as an
argument (`disk_usage`, `available_memory`), so tests pass a fake one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

GEMM_SIZE = 512  # a 512 x 512 x 512 matrix product: 0.27 GFLOP, milliseconds on a core
ALLREDUCE_BYTES = 4 * 1024 * 1024  # 4 MiB of fp32: bandwidth-bound on every fabric, still quick
PROBE_BYTES = 4 * 1024 * 1024  # the storage probe's file


def compute_rate(device, dtype, budget_s: float = 1.0) -> dict[str, float]:
    """GFLOP/s of repeated `GEMM_SIZE`^3 products on `device` in `dtype` for about `budget_s` (best of
    the timed rounds, after one warm-up)."""
    import torch

    n = GEMM_SIZE
    noise = torch.Generator(device=device).manual_seed(
        0
    )  # its own: the run's random streams stay as they are
    a = torch.randn(n, n, device=device, dtype=dtype, generator=noise)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=noise)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best, iterations, start = 0.0, 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or iterations < 3:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        sync()
        elapsed = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / elapsed / 1e9)
        iterations += 1
    return {"gflops": best, "rounds": iterations}


def allreduce_rounds(one_s: float, budget_s: float) -> int:
    """The timed all-reduce rounds for `budget_s` when one takes `one_s`: at least 3 (a median), at most 50
    (a fast fabric would otherwise run thousands of barriers)."""
    return max(3, min(50, int(budget_s / max(one_s, 1e-6))))


def allreduce_bandwidth(device, group=None, budget_s: float = 1.0) -> dict[str, float]:
    """Bus bandwidth in GB/s of `ALLREDUCE_BYTES` all-reduces over `group` (every rank runs as many
    rounds as rank 0 decides, so none waits on a missing one); the median round."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    x = torch.ones(ALLREDUCE_BYTES // 4, device=device, dtype=torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.all_reduce(x, group=group)  # warm-up: connections
    sync()
    t0 = time.perf_counter()
    dist.all_reduce(x, group=group)
    sync()
    one = time.perf_counter() - t0
    rounds = torch.tensor([allreduce_rounds(one, budget_s)], device=device)
    dist.broadcast(rounds, src=0, group=group)
    times = []
    for _ in range(int(rounds.item())):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    bus = 2 * (world - 1) / world * ALLREDUCE_BYTES / median / 1e9
    return {"gbps": bus, "median_ms": median * 1e3, "rounds": len(times)}


def available_memory() -> int:
    """Host memory available to new processes (MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available)


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest folder that exists (a checkpoint folder is made by the first save)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path, disk_usage: Callable = shutil.disk_usage) -> int:
    return int(disk_usage(existing_parent(path)).free)


def storage_probe(folder: Path, disk_usage: Callable = shutil.disk_usage) -> dict[str, object]:
    """Free space under `folder` and a `PROBE_BYTES` write, fsync, read back and compare there (the file is
    removed); `error` says what failed."""
    result: dict[str, object] = {"path": str(folder), "free_bytes": free_bytes(folder, disk_usage)}
    probe = folder / f".preflight-{os.uname().nodename}-{os.getpid()}"
    data = os.urandom(PROBE_BYTES)
    t0 = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        written = time.perf_counter() - t0
        if probe.read_bytes() != data:
            result["error"] = "the probe file read back differs from what was written"
        result["write_mb_s"] = PROBE_BYTES / max(written, 1e-9) / 1e6
    except OSError as exc:
        result["error"] = f"write-read-fsync failed: {exc.strerror or exc}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    result["seconds"] = time.perf_counter() - t0
    return result


def gpu_health(index: int) -> dict[str, object] | None:
    """NVML's view of GPU `index`: ECC errors, retired pages, clocks, temperature; None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        health: dict[str, object] = {
            "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
        }
        health["ecc_uncorrected"] = _nvml(
            lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
        )
        health["retired_pages"] = _nvml(
            lambda: len(
                pynvml.nvmlDeviceGetRetiredPages(
                    handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
                )
            )
        )
        health["retired_pages_pending"] = _nvml(
            lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == pynvml.NVML_FEATURE_ENABLED
        )
        return health
    finally:
        pynvml.nvmlShutdown()


def _nvml(read: Callable[[], object]) -> object:
    """A reading the GPU may not support (ECC off, no page retirement on this model): None then."""
    import pynvml

    try:
        return read()
    except pynvml.NVMLError:
        return None
