"""Throughput and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / peak FLOP/s per device, where

    achieved model FLOP/s per device = tokens_per_s_per_device * flops_per_token

``flops_per_token`` is the training cost of one token (forward + backward, from
``relaytrain.model.flops.flops_per_token``); recomputation from activation checkpointing is not
counted, so MFU measures useful work only. Peak FLOP/s are the vendors' dense (no sparsity)
bf16 tensor-core figures for GPUs; on CPU they are measured once per process with fp32 matmuls,
because CPU training runs in fp32 and no table can know the laptop's CPU.
"""

from __future__ import annotations

import logging
import math
import time

import torch

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per torch device, from vendor datasheets. Matched in order against
# torch.cuda.get_device_name(): the first entry whose every keyword occurs in the name wins, so
# specific variants come before the generic name. An MI250X/MI250 module holds two GCDs and
# torch sees each GCD as one device, hence half the per-module figure (383 / 362 TFLOP/s).
PEAK_FLOPS_TABLE: list[tuple[tuple[str, ...], float]] = [
    (("H100", "PCIE"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H100",), 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (("H800", "PCIE"), 756e12),
    (("H800",), 989e12),
    (("GH200",), 989e12),  # before H200: "GH200" contains "H200"
    (("H200", "NVL"), 835e12),
    (("H200",), 989e12),  # SXM
    (("A100",), 312e12),  # SXM and PCIe
    (("A800",), 312e12),
    (("L40S",), 362e12),
    (("MI300X",), 1307e12),
    (("MI250X",), 191.5e12),
    (("MI250",), 181e12),
]

_cpu_peak_cache: dict[int, float] = {}


def lookup_gpu_peak_flops(device_name: str) -> float:
    """Peak dense bf16 FLOP/s for a GPU name, or 0.0 when the table does not know it."""
    upper = device_name.upper()
    for keywords, peak in PEAK_FLOPS_TABLE:
        if all(k in upper for k in keywords):
            return peak
    return 0.0


def measure_cpu_peak_flops(size: int = 1024, seconds: float = 0.3) -> float:
    """Best fp32 matmul rate of this process (FLOP/s), timed over ~``seconds``; cached."""
    threads = torch.get_num_threads()
    if threads in _cpu_peak_cache:
        return _cpu_peak_cache[threads]
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool start and kernel selection
    flops_per_mm = 2.0 * size**3
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, flops_per_mm / max(elapsed, 1e-9))
        if time.perf_counter() >= deadline:
            break
    _cpu_peak_cache[threads] = best
    log.info(
        "measured CPU peak: %.1f GFLOP/s (fp32 %dx%d matmul, %d threads)", best / 1e9, size, size, threads
    )
    return best


def peak_flops_per_device(device: torch.device, override: float = 0.0) -> float:
    """Peak FLOP/s of one device: ``override`` when > 0, the GPU table, or a CPU measurement.

    Returns 0.0 for a GPU the table does not know (MFU is then not reported); set
    ``metrics.peak_flops`` for such GPUs.
    """
    if override > 0:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = lookup_gpu_peak_flops(name)
        if peak == 0.0:
            log.warning("no peak FLOP/s known for GPU %r: MFU is not reported; set metrics.peak_flops", name)
        return peak
    if device.type == "cpu":
        return measure_cpu_peak_flops()
    log.warning("no peak FLOP/s known for device type %r: set metrics.peak_flops", device.type)
    return 0.0


def throughput(tokens: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(tokens/s over all devices, tokens/s per device) for ``tokens`` processed in ``seconds``."""
    if seconds <= 0:
        return math.nan, math.nan
    total = tokens / seconds
    return total, total / max(world_size, 1)


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float) -> float:
    """Fraction (0..1) of the device's peak spent on model FLOPs; NaN when peak is unknown."""
    if peak <= 0 or flops_per_token <= 0:
        return math.nan
    return tokens_per_s_per_device * flops_per_token / peak
