"""Throughput and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / peak FLOP/s per device, where

    achieved model FLOP/s per device = tokens_per_s_per_device * flops_per_token

``flops_per_token`` is the training cost of one token (forward + backward, from
``relaytrain.model.flops.flops_per_token``); recomputation from activation checkpointing is not
counted, so MFU measures useful work only. Peak FLOP/s are the vendors' dense (no sparsity)
bf16 tensor-core figures for GPUs. On CPU no table can know the machine, so the peak is measured with
fp32 matmuls (CPU training runs in fp32), once per machine (CPU model, instruction set, thread count),
and kept in ``$XDG_CACHE_HOME/relaytrain/cpu_peak.json`` (default ``~/.cache``): every later run and
every job of a requeued run divides by the same figure, so its MFU does not jump with the load of the
moment a job started. A figure measured on a busy machine is too low; the first training window that
beats it raises it to the rate achieved (``raise_cpu_peak``), so CPU MFU never exceeds 100 %. CPU MFU
stays an estimate (``Peak.estimate``; train records say ``mfu_estimate``). Every peak carries its
source, which the start log prints.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from relaytrain.atomic import write_atomic
from relaytrain.job.machine import cpu_model

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


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device (0.0: unknown, MFU not reported) and where the figure came from."""

    flops: float
    source: str
    estimate: bool = False  # measured on this CPU, not a datasheet figure: MFU is only an estimate


def lookup_gpu_peak_flops(device_name: str) -> float:
    """Peak dense bf16 FLOP/s for a GPU name, or 0.0 when the table does not know it."""
    upper = device_name.upper()
    for keywords, peak in PEAK_FLOPS_TABLE:
        if all(k in upper for k in keywords):
            return peak
    return 0.0


def cpu_capability() -> str:
    """The instruction set PyTorch's CPU kernels use (DEFAULT, AVX2, AVX512, ...): bf16 speed and rounding
    depend on it, so it is printed beside every CPU figure."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_peak_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "relaytrain" / "cpu_peak.json"


def measure_cpu_peak_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """Best fp32 matmul rate (FLOP/s) of this process over ~``seconds``: the best single matmul, so that
    load on the machine during part of the second does not lower it."""
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
            return best


def _cpu_key() -> str:
    return f"{cpu_model()} | {cpu_capability()} | {torch.get_num_threads()} threads"


def _read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache_entry(path: Path, key: str, entry: dict) -> str:
    """Store ``entry`` under ``key``; returns "" or why it could not be cached."""
    try:
        write_atomic(path, json.dumps(_read_cache(path) | {key: entry}, indent=1) + "\n", durable=False)
    except OSError as err:
        return str(err)
    return ""


def _describe(entry: dict, key: str, path: Path) -> str:
    how = "raised to a rate a run achieved" if entry.get("raised") else "measured"
    return f"{how} on this machine {entry.get('date', '?')} ({key}), cached in {path}; MFU is an estimate"


def cpu_peak(seconds: float = 0.5) -> Peak:
    """This CPU's peak: the cached figure, else measured now and cached. Never re-measured while cached,
    so every run and every job of a run on this machine reports MFU against the same figure."""
    path, key = cpu_peak_cache_path(), _cpu_key()
    entry = _read_cache(path).get(key)
    if isinstance(entry, dict) and float(entry.get("flops", 0.0)) > 0:
        return Peak(float(entry["flops"]), _describe(entry, key, path), estimate=True)
    entry = {"flops": measure_cpu_peak_flops(seconds=seconds), "date": date.today().isoformat()}
    failed = _write_cache_entry(path, key, entry)
    source = _describe(entry, key, path) if not failed else f"measured now ({key}), not cached: {failed}"
    return Peak(entry["flops"], source, estimate=True)


def raise_cpu_peak(achieved_flops: float) -> Peak:
    """A training window achieved more than the cached peak: the measurement was taken under load.
    The achieved rate becomes this CPU's peak (cached), so MFU stays at or below 100 %."""
    path, key = cpu_peak_cache_path(), _cpu_key()
    entry = {"flops": float(achieved_flops), "date": date.today().isoformat(), "raised": True}
    failed = _write_cache_entry(path, key, entry)
    source = (
        _describe(entry, key, path) if not failed else f"raised to an achieved rate, not cached: {failed}"
    )
    return Peak(entry["flops"], source, estimate=True)


def peak_flops_per_device(device: torch.device, override: float = 0.0) -> Peak:
    """Peak FLOP/s of one device: ``override`` when > 0, the GPU table, or this CPU's cached peak.

    Unknown GPUs get 0.0 (MFU is then not reported); set ``metrics.peak_flops`` for them.
    """
    if override > 0:
        return Peak(float(override), "from metrics.peak_flops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = lookup_gpu_peak_flops(name)
        if peak == 0.0:
            return Peak(0.0, f"no table entry for GPU {name!r}: set metrics.peak_flops to report MFU")
        return Peak(peak, f"dense bf16 table entry for {name!r}")
    if device.type == "cpu":
        return cpu_peak()
    return Peak(0.0, f"unknown for device type {device.type!r}: set metrics.peak_flops to report MFU")


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
