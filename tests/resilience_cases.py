"""Single-process scenarios for tests/test_resilience.py that must end in os._exit (run as subprocesses).

    python tests/resilience_cases.py CASE RUN_DIR

hang       the watchdog (timeout 1 s) fires while the main thread sleeps in `stuck_in_collective`
gil_hang   the main thread holds the GIL in a catastrophic regex: only faulthandler's backstop can fire
beating    beats keep the watchdog quiet for 3x its timeout, then the process exits 0
deadline   a SIGTERM triggers the hard deadline (1 s) while the "save" hangs
sigint     waits for SIGINTs: a second one (>= 1 s after the first) exits at once
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import torch

from relaytrain.config.loader import load_config
from relaytrain.resilience import HangWatchdog, ShutdownController


def stuck_in_collective() -> None:
    time.sleep(600)


def main(case: str, run_dir: Path) -> int:
    if case in ("hang", "gil_hang", "beating"):
        watchdog = HangWatchdog(1.0, rank=0, log_dir=run_dir / "logs", backstop_s=1.0)
        watchdog.start()
        watchdog.beat(3)
        if case == "hang":
            stuck_in_collective()
        elif case == "gil_hang":
            re.match(r"(a+)+$", "a" * 40 + "b")
        else:
            for step in range(4, 34):
                time.sleep(0.1)
                watchdog.beat(step)
            watchdog.stop()
            return 0
        return 3
    cfg = load_config(
        None,
        [
            f"--run.dir={run_dir.parent}",
            f"--run.name={run_dir.name}",
            f"--resilience.hard_deadline_s={1 if case == 'deadline' else 100}",
        ],
    )
    controller = ShutdownController(cfg, rank=0, device=torch.device("cpu"))
    controller.install()
    print("ready", flush=True)
    if case == "deadline":
        os.kill(os.getpid(), 15)
        print("agreed:", controller.agree(7).label, flush=True)
        stuck_in_collective()  # the emergency save that never ends
        return 3
    if case == "sigint":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if controller.local_reason().label == "user_interrupt":
                print("first interrupt seen", flush=True)
                break
        time.sleep(60)
        return 3
    raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
