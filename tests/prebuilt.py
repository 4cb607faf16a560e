"""What tests need built on the machine before they run, built once by the test session itself.

DeepSpeed compiles its C++ ops (DeepSpeedCPUAdam, and on CPU the shared-memory all-reduce that every
rank loads at start-up) on first use, into torch's extension cache. Two ranks that build or load one at
the same moment race (one finds a half-written ``.so``), so the session builds them once, in one process
under a file lock, before any test starts ranks that use them: ``start_in_background`` at the session's
start (the build overlaps the first tests), and the ``deepspeed_ops`` fixture waits for it.

Run as a script, this module does the build under the lock (what the background process runs).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")
BUILD = (
    "from deepspeed.accelerator import get_accelerator as a\n"
    f"for op in {OPS!r}: a().create_op_builder(op).load()\n"
)


def lock_path() -> Path:
    """Beside torch's extension cache, which the lock guards."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    root.mkdir(parents=True, exist_ok=True)
    return root / "relaytrain-tests-prebuild.lock"


def build_under_lock() -> subprocess.CompletedProcess:
    """Build (or, when built, load) every op in a child process, one builder on the machine at a time."""
    with open(lock_path(), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=1500)


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def start_in_background() -> subprocess.Popen | None:
    """Start the build beside the first tests (the controller's session start); None without DeepSpeed."""
    if not deepspeed_installed():
        return None
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    return subprocess.Popen([sys.executable, __file__], start_new_session=True, **quiet)


if __name__ == "__main__":
    done = build_under_lock()
    sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
    sys.exit(done.returncode)
