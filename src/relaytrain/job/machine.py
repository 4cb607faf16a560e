"""Facts of the machine this process runs on that need no torch (the CPU's name for peak caches and
benchmark headers; when this process began, for the time ledger)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def process_start_time(pid: int | str = "self") -> float:
    """When the process began, in unix seconds: its start in clock ticks after boot (/proc/PID/stat, field
    22) plus the boot time (/proc/stat `btime`). Where /proc cannot tell (not Linux): now."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # after the command name, which may hold spaces
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
