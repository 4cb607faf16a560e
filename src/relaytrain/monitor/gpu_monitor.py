"""Per-node GPU sampler: power, utilisation, memory and temperature to ``<out>/<host>.csv``.

    python -m relaytrain.monitor.gpu_monitor --out RUN_DIR/gpu --interval 5

One process per node (the sbatch script starts it on local rank 0 and kills it from its trap).
It reads NVML through ``pynvml`` (nvidia-ml-py); without NVML it parses ``nvidia-smi dmon``; on
a machine without NVIDIA GPUs it prints one line and exits 0. SIGTERM/SIGINT end it cleanly
with every sampled row already flushed. The file is appended to, so a requeued job on the same
node continues it. Deliberately free of torch: it starts in well under a second.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from relaytrain.job import JobFacts

COLUMNS = (
    "time",
    "datetime",
    "host",
    "job_id",
    "gpu",
    "power_w",
    "util_gpu_pct",
    "util_mem_pct",
    "mem_used_mib",
    "mem_total_mib",
    "temp_c",
)
MIB = 1024**2
# nvidia-smi dmon column names (``-s pumt``) mapped to ours; the rest are ignored.
DMON_COLUMNS = {
    "gpu": "gpu",
    "pwr": "power_w",
    "gtemp": "temp_c",
    "sm": "util_gpu_pct",
    "mem": "util_mem_pct",
    "fb": "mem_used_mib",
}


def host_name() -> str:
    return JobFacts.from_env().node_name or socket.gethostname().split(".")[0]


class GpuCsv:
    """Append-mode CSV with a header only when the file is new; flushed after every sample."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        new = not path.exists() or path.stat().st_size == 0
        self._file: TextIO = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS, restval="")
        if new:
            self._writer.writeheader()
            self._file.flush()

    def write(self, rows: list[dict[str, Any]]) -> None:
        now = time.time()
        stamp = datetime.datetime.fromtimestamp(now).isoformat(timespec="seconds")
        job_id = JobFacts.from_env().job_id
        for row in rows:
            self._writer.writerow(
                {"time": f"{now:.3f}", "datetime": stamp, "host": host_name(), "job_id": job_id, **row}
            )
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def _nvml_value(read, scale: float = 1.0) -> str:
    """One NVML reading; an unsupported metric (power on some boards) leaves the cell empty."""
    try:
        value = read()
    except Exception:  # pynvml.NVMLError subclasses, one per NVML return code
        return ""
    return f"{value / scale:.1f}" if scale != 1.0 else str(value)


def open_nvml() -> tuple[Any, list[Any], str]:
    """(pynvml module, device handles, reason): no handles when NVML or GPUs are missing."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as exc:  # ImportError, or NVMLError_LibraryNotFound / DriverNotLoaded
        return None, [], f"NVML unavailable ({exc})"
    count = nvml.nvmlDeviceGetCount()
    if count == 0:
        nvml.nvmlShutdown()
        return None, [], "NVML reports 0 GPUs"
    return nvml, [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)], ""


def sample_nvml(nvml: Any, handles: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for index, handle in enumerate(handles):
        rows.append(
            {
                "gpu": index,
                "power_w": _nvml_value(lambda h=handle: nvml.nvmlDeviceGetPowerUsage(h), scale=1000.0),
                "util_gpu_pct": _nvml_value(lambda h=handle: nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                "util_mem_pct": _nvml_value(lambda h=handle: nvml.nvmlDeviceGetUtilizationRates(h).memory),
                "mem_used_mib": _nvml_value(lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h).used, scale=MIB),
                "mem_total_mib": _nvml_value(
                    lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h).total, scale=MIB
                ),
                "temp_c": _nvml_value(
                    lambda h=handle: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
                ),
            }
        )
    return rows


def run_nvml(out: GpuCsv, interval: float, stop: threading.Event, nvml: Any, handles: list[Any]) -> int:
    """Sample until ``stop`` is set; returns the number of samples taken."""
    samples = 0
    try:
        while not stop.is_set():
            out.write(sample_nvml(nvml, handles))
            samples += 1
            stop.wait(interval)
    finally:
        nvml.nvmlShutdown()
    return samples


def parse_dmon_line(line: str, header: list[str] | None) -> tuple[list[str] | None, dict[str, Any] | None]:
    """(header, row) after one line of ``nvidia-smi dmon`` output; units lines are skipped."""
    stripped = line.strip()
    if not stripped:
        return header, None
    if stripped.startswith("#"):
        names = stripped[1:].split()
        return (names if "gpu" in names else header), None  # "# Idx W C ..." is the units line
    fields = stripped.split()
    if header is None or len(fields) != len(header):
        return header, None
    row = {}
    for name, value in zip(header, fields, strict=True):
        if name in DMON_COLUMNS:
            row[DMON_COLUMNS[name]] = "" if value == "-" else value
    return header, row


def run_dmon(out: GpuCsv, interval: float, stop: threading.Event, nvidia_smi: str) -> int:
    """Fallback without NVML bindings: stream ``nvidia-smi dmon`` into the same CSV columns."""
    cmd = [nvidia_smi, "dmon", "-d", str(max(1, round(interval))), "-s", "pumt"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    watcher = threading.Thread(target=lambda: (stop.wait(), proc.terminate()), daemon=True)
    watcher.start()
    header: list[str] | None = None
    batch: list[dict[str, Any]] = []
    samples = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        header, row = parse_dmon_line(line, header)
        if row is None:
            continue
        if batch and row["gpu"] == batch[0]["gpu"]:  # the first GPU again: a new sample begins
            out.write(batch)
            samples += 1
            batch = []
        batch.append(row)
    if batch:
        out.write(batch)
        samples += 1
    proc.wait()
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relaytrain.monitor.gpu_monitor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="directory for <host>.csv (e.g. RUN_DIR/gpu)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")

    nvml, handles, reason = open_nvml()
    nvidia_smi = shutil.which("nvidia-smi") if not handles else None
    if not handles and nvidia_smi is None:
        print(
            f"gpu_monitor: no NVIDIA GPU on {host_name()} ({reason}; no nvidia-smi): not sampling", flush=True
        )
        return 0

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    out = GpuCsv(args.out / f"{host_name()}.csv")
    source = f"NVML, {len(handles)} GPUs" if handles else "nvidia-smi dmon"
    print(f"gpu_monitor: sampling {source} every {args.interval:g}s into {out.path}", flush=True)
    try:
        if handles:
            run_nvml(out, args.interval, stop, nvml, handles)
        else:
            run_dmon(out, args.interval, stop, nvidia_smi)
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
