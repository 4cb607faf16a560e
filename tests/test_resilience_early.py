"""A stop signal during start-up (while torch imports) still ends in a checkpoint, not a dead rank."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from relaytrain.resilience import EXIT_RESUME

from conftest import TINY, child_env


def _catches(pid: int, signum: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_sigusr2_while_importing_torch_stops_with_a_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relaytrain.cli",
            "train",
            *TINY,
            f"--run.dir={tmp_path}",
            "--train.max_steps=50",
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not _catches(proc.pid, signal.SIGUSR2) and time.monotonic() < deadline:
        time.sleep(0.005)
    sent_at_step_files = list(tmp_path.glob("debug/metrics.jsonl"))
    proc.send_signal(signal.SIGUSR2)  # the early handler is in place; the trainer's is not yet
    out, _ = proc.communicate(timeout=300)
    assert not sent_at_step_files, "the signal must arrive before training starts"
    assert proc.returncode == EXIT_RESUME, out[-3000:]
    state = json.loads((tmp_path / "debug" / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["step"] == 1
    assert (tmp_path / "debug" / "checkpoints" / "step_1" / "COMPLETE").exists()
    assert "arrived during start-up" in out


def _import_cli_as(argv: list[str]) -> subprocess.CompletedProcess:
    """Import relaytrain.cli the way `relaytrain ARGV...` does, then send SIGUSR2 before main() runs."""
    code = (
        f"import os, signal, sys; sys.argv = {argv!r}; import relaytrain.cli; "
        "os.kill(os.getpid(), signal.SIGUSR2); "
        "from relaytrain.resilience.rank.early_signals import drain_early_signals; "
        "print(drain_early_signals())"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())


def test_the_recorder_is_in_place_as_soon_as_the_cli_module_is_imported():
    # Before the argument parser and the command modules: a signal then is recorded, not fatal.
    for argv in (["relaytrain", "train", "c.toml"], ["relaytrain"]):
        proc = _import_cli_as(argv)
        assert (proc.returncode, proc.stdout.strip()) == (0, f"[{int(signal.SIGUSR2)}]"), proc.stderr
    for argv in (["relaytrain", "status"], ["pytest", "train"]):  # other commands keep the default action
        assert _import_cli_as(argv).returncode == -signal.SIGUSR2
