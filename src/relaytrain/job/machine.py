"""Facts of the machine this process runs on that need no torch (the CPU's name for peak caches and
benchmark headers)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
