"""Per-node GPU sampler: power, utilisation, memory and temperature to ``<out>/<host>.csv``.

    python -m relaytrain.monitor.gpu_monitor --out RUN_DIR/gpu --interval 5

One process per node (the sbatch script starts it on local rank 0 and kills it from its trap).
It reads NVML through ``pynvml`` (nvidia-ml-py); without NVML it parses ``nvidia-smi dmon``; on
a machine without NVIDIA GPUs it prints one line and exits 0. SIGTERM/SIGINT end it cleanly
with every sampled row already flushed. The file is appended to, so a requeued job on the same
node continues it (in the columns its header has). A GPU whose handle NVML refuses (hidden by the job's
cgroup, or lost) is skipped, not fatal. Each row names the GPU by NVML index, UUID and PCI bus id: the
index is neither CUDA's device number nor the local rank. Deliberately free of torch: it starts in well
under a second.
"""

from __future__ import annotations

import argparse
import contextlib
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from relaytrain.entry_points import GPU_MONITOR
from relaytrain.job import JobFacts

COLUMNS = (
    "time",
    "datetime",
    "host",
    "job_id",
    "gpu",  # NVML's (and nvidia-smi's) index: PCI order, not CUDA's order nor the local rank
    "gpu_uuid",  # what CUDA_VISIBLE_DEVICES and torch.cuda.get_device_properties(i).uuid name
    "pci_bus_id",
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
        columns = COLUMNS
        if not new:  # continue a file in its own columns (one written before a column was added)
            with open(path, newline="", encoding="utf-8") as f:
                columns = tuple(next(csv.reader(f), COLUMNS)) or COLUMNS
        self._file: TextIO = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=columns, restval="", extrasaction="ignore")
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


@dataclass(frozen=True)
class Gpu:
    """One GPU NVML gave a handle for."""

    index: int  # NVML's
    handle: Any
    uuid: str
    pci_bus_id: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)  # older pynvml returns bytes


def open_nvml() -> tuple[Any, list[Gpu], str]:
    """(pynvml module, GPUs, reason): no GPUs when NVML or every GPU is missing; `reason` also names
    the GPUs skipped because NVML refused their handle (a GPU of another job's cgroup, a lost GPU)."""
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as exc:  # ImportError, or NVMLError_LibraryNotFound / DriverNotLoaded
        return None, [], f"NVML unavailable ({exc})"
    gpus, skipped = [], []
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception as exc:
        count, skipped = 0, [f"no GPU count ({exc})"]
    for i in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
        except Exception as exc:  # NVMLError_NoPermission, _NotFound, _GpuIsLost, ...
            skipped.append(f"GPU {i} skipped ({exc})")
            continue
        uuid = _nvml_value(lambda h=handle: _text(nvml.nvmlDeviceGetUUID(h)))
        bus = _nvml_value(lambda h=handle: _text(nvml.nvmlDeviceGetPciInfo(h).busId))
        gpus.append(Gpu(i, handle, uuid, bus))
    if not gpus:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
        return None, [], "; ".join(skipped or ["NVML reports 0 GPUs"])
    return nvml, gpus, "; ".join(skipped)


def sample_nvml(nvml: Any, gpus: list[Gpu]) -> list[dict[str, Any]]:
    rows = []
    for gpu in gpus:
        handle = gpu.handle
        rows.append(
            {
                "gpu": gpu.index,
                "gpu_uuid": gpu.uuid,
                "pci_bus_id": gpu.pci_bus_id,
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


def run_nvml(out: GpuCsv, interval: float, stop: threading.Event, nvml: Any, gpus: list[Gpu]) -> int:
    """Sample until ``stop`` is set; returns the number of samples taken."""
    samples = 0
    try:
        while not stop.is_set():
            out.write(sample_nvml(nvml, gpus))
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


def smi_ids(nvidia_smi: str) -> dict[str, dict[str, str]]:
    """nvidia-smi index -> {"gpu_uuid", "pci_bus_id"} (empty when the query fails)."""
    query = [nvidia_smi, "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"]
    try:
        text = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    ids = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0].isdigit():
            ids[fields[0]] = {"gpu_uuid": fields[1], "pci_bus_id": fields[2]}
    return ids


def run_dmon(out: GpuCsv, interval: float, stop: threading.Event, nvidia_smi: str) -> int:
    """Fallback without NVML bindings: stream ``nvidia-smi dmon`` into the same CSV columns."""
    ids = smi_ids(nvidia_smi)
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
        row.update(ids.get(row["gpu"], {}))
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
    parser = argparse.ArgumentParser(prog=f"python -m {GPU_MONITOR}", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for <host>.csv (e.g. RUN_DIR/gpu)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")

    nvml, gpus, reason = open_nvml()
    nvidia_smi = shutil.which("nvidia-smi") if not gpus else None
    if not gpus and nvidia_smi is None:
        print(
            f"gpu_monitor: no NVIDIA GPU on {host_name()} ({reason}; no nvidia-smi): not sampling", flush=True
        )
        return 0

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    out = GpuCsv(args.out / f"{host_name()}.csv")
    source = f"NVML, {len(gpus)} GPUs" if gpus else "nvidia-smi dmon"
    note = f" ({reason})" if gpus and reason else ""
    print(f"gpu_monitor: sampling {source}{note} every {args.interval:g}s into {out.path}", flush=True)
    try:
        if gpus:
            run_nvml(out, args.interval, stop, nvml, gpus)
        else:
            run_dmon(out, args.interval, stop, nvidia_smi)
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
