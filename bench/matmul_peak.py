"""Measured peak matmul FLOP/s: the denominator that makes CPU MFU mean something.

On CPU: fp32 square matmuls (1024 and 2048) with threads = cores and with one thread, best and median
rate over a time budget each; bf16 at 512 for reference (CPU training here runs fp32 because bf16 matmuls
are slow on CPUs without AVX512-BF16/AMX). On a GPU: bf16 8192 and 4096 (and fp32 4096).

    python -m bench.matmul_peak [--seconds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bench.report import fmt, table

MODULE = "bench.matmul_peak"


def time_matmul(size: int, dtype: torch.dtype, device: str, seconds: float) -> dict:
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: thread pool start, kernel selection
    sync()
    flop = 2.0 * size**3
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(rates) < 3 or time.perf_counter() < deadline:
        reps = 1 if device == "cpu" else 20
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        rates.append(reps * flop / (time.perf_counter() - start))
        if len(rates) >= 10_000:
            break
    return {
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "threads": torch.get_num_threads() if device == "cpu" else None,
        "best_flops": max(rates),
        "median_flops": statistics.median(rates),
        "samples": len(rates),
    }


def measure(seconds: float = 2.0, quick: bool = False) -> dict:
    cores = os.cpu_count() or 1
    seconds = min(seconds, 0.5) if quick else seconds
    rows = []
    saved = torch.get_num_threads()
    try:
        for threads in sorted({cores, 1}, reverse=True):
            torch.set_num_threads(threads)
            for size in (1024, 2048):
                rows.append(time_matmul(size, torch.float32, "cpu", seconds))
        torch.set_num_threads(cores)
        rows.append(time_matmul(512, torch.bfloat16, "cpu", min(seconds, 1.0)))
    finally:
        torch.set_num_threads(saved)
    if torch.cuda.is_available():
        for size, dtype in ((8192, torch.bfloat16), (4096, torch.bfloat16), (4096, torch.float32)):
            rows.append(time_matmul(size, dtype, "cuda", seconds))
    cpu_fp32 = [r for r in rows if r["device"] == "cpu" and r["dtype"] == "float32" and r["threads"] == cores]
    gpu_bf16 = [r for r in rows if r["device"] == "cuda" and r["dtype"] == "bfloat16"]
    args = [] if not quick else ["--quick"]
    return {
        "command": " ".join(["python -m", MODULE, f"--seconds {seconds:g}", *args]),
        "cores": cores,
        "rows": rows,
        "cpu_peak_flops": max(r["best_flops"] for r in cpu_fp32),
        "gpu_peak_flops": max((r["best_flops"] for r in gpu_bf16), default=None),
    }


def render(result: dict) -> str:
    rows = [
        (
            r["device"],
            r["dtype"],
            f"{r['size']}²",
            r["threads"] if r["threads"] is not None else "–",
            fmt(r["best_flops"] / 1e9),
            fmt(r["median_flops"] / 1e9),
            r["samples"],
        )
        for r in result["rows"]
    ]
    out = "## Peak matmul FLOP/s\n\n"
    out += f"Command: `{result['command']}`\n\n"
    out += table(["device", "dtype", "size", "threads", "best GFLOP/s", "median GFLOP/s", "samples"], rows)
    out += (
        f"\nThe CPU MFU figures on this page divide by the best fp32 rate with threads = cores "
        f"({fmt(result['cpu_peak_flops'] / 1e9)} GFLOP/s), measured in the same run. The trainer measures "
        "its own peak at start-up the same way (1024², 0.3 s, "
        "`relaytrain.monitor.mfu.measure_cpu_peak_flops`) "
        "unless `metrics.peak_flops` is set.\n"
    )
    bf16 = [r for r in result["rows"] if r["device"] == "cpu" and r["dtype"] == "bfloat16"]
    if bf16:
        ratio = bf16[0]["best_flops"] / result["cpu_peak_flops"]
        out += (
            f"\nbf16 (512²) on this CPU runs at {ratio:.2f}x the fp32 peak; "
            + ("that is why " if ratio < 0.5 else "for reference: ")
            + '`parallel.param_dtype = "auto"` trains in fp32 on CPU.\n'
        )
    if result.get("gpu_peak_flops"):
        out += f"\nGPU bf16 peak measured: {fmt(result['gpu_peak_flops'] / 1e12)} TFLOP/s.\n"
    else:
        out += (
            "\nGPU bf16 matmul peak: **not measured** (no GPU on the machine that ran this). "
            "`python -m bench.matmul_peak` measures it whenever CUDA is available; see the GPU section.\n"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="time budget per matmul shape")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args(argv)
    result = measure(args.seconds, args.quick)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
