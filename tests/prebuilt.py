"""What tests need built on the machine before they run, built once by the test session itself.

DeepSpeed compiles its C++ ops (DeepSpeedCPUAdam, and on CPU the shared-memory all-reduce that every
rank loads at start-up) on first use, into torch's extension cache. Two ranks that build or load one at
the same moment race (one finds a half-written ``.so``), so the session builds them once, in one process
under a file lock, before any test starts ranks that use them: ``start_in_background`` once the session
knows it will run such a test (the build overlaps the first tests), and the ``deepspeed_ops`` fixture
waits for it.

torch guards each extension's build with a "baton" file in the build folder, and a builder that was
killed leaves it behind: every later build then waits for it for ever. Under this module's lock no other
test builds, so a baton found there is stale and is removed first.

Run as a script, this module does the build under the lock (what the background process runs).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
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


LOCK_WAIT_S = 1800  # another session's build, at most: 1-5 minutes on 2 cores, each op


def _stale_batons() -> list[Path]:
    """The batons torch's builds of these ops left behind, for this torch's extension folder."""
    from torch.utils.cpp_extension import _get_build_directory

    folders = {Path(_get_build_directory(name, verbose=False)) for name in ("cpu_adam", "deepspeed_shm_comm")}
    return [folder / "lock" for folder in folders if (folder / "lock").exists()]


def build_under_lock() -> subprocess.CompletedProcess:
    """Build (or, when built, load) every op in a child process, one builder on the machine at a time."""
    with open(lock_path(), "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{lock_path()} was held for {LOCK_WAIT_S} s by another build"
                    ) from None
                time.sleep(1)
        for baton in _stale_batons():
            baton.unlink(missing_ok=True)
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
