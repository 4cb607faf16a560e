"""Single-process scenarios for tests/test_resilience.py that must end in os._exit (run as subprocesses).

    python tests/resilience_cases.py CASE RUN_DIR

hang       the watchdog (timeout 1 s) fires while the main thread sleeps in `stuck_in_collective`
gil_hang   the main thread holds the GIL in a catastrophic regex: only faulthandler's backstop can fire
beating    beats keep the watchdog quiet for 3x its timeout, then the process exits 0
deadline   a SIGTERM triggers the hard deadline (1 s) while the "save" hangs
blocked    a SIGTERM arrives while the main thread is blocked in C++ (a store wait, like a collective)
finished   the stop completes (finish), then teardown outlasts the hard deadline (1 s): no second record
unlisted   SIGTERM arrives during start-up but resilience.signals does not list it: it kills the process
sigint     waits for SIGINTs: a second one (>= 1 s after the first) exits at once
load_fails the checkpoint load raises: run_state.json says failed, not the previous job's `stopped`
eval_stop  SIGUSR2 arrives during the evaluation of step 2: the evaluation still logs val_loss
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from relaytrain.config.loader import load_config
from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.resilience import HangWatchdog, RunStateFile, ShutdownController
from relaytrain.resilience.rank.early_signals import capture_early_signals
from relaytrain.resilience.run_state import RunState

from conftest import TINY


def stuck_in_collective() -> None:
    time.sleep(600)


def trainer_case(case: str, run_dir: Path) -> int:
    from relaytrain.parallel.distributed import init_distributed
    from relaytrain.trainer import Trainer, prepare_run_dir

    cfg = load_config(
        None,
        [*TINY, f"--run.dir={run_dir.parent}", f"--run.name={run_dir.name}", "--train.max_steps=6"]
        + (["--train.eval_every=2"] if case == "eval_stop" else []),
    )
    env = init_distributed(cfg)
    prepare_run_dir(cfg, env.is_main)
    trainer = Trainer(cfg, env)
    if case == "load_fails":
        RunStateFile(RunDir(run_dir)).write(
            RunState.of("stopped", "preemption", 4, saved=True)
        )  # the previous job's record

        def load(*_args):
            raise UserError("checkpoint step_4 is unreadable")

        trainer.persistence.checkpoints.load = load  # the DCP load the front's restore runs
    else:
        eval_loss = trainer.model.eval_loss

        def eval_loss_then_signal(*args):
            os.kill(os.getpid(), signal.SIGUSR2)  # the time-limit signal, in the middle of an evaluation
            return eval_loss(*args)

        trainer.model.eval_loss = eval_loss_then_signal
    try:
        code = trainer.run()
    except UserError as exc:
        print("error:", exc, flush=True)
        code = 2
    print("state:", RunStateFile(RunDir(run_dir)).read().status, flush=True)
    return code


def main(case: str, run_dir: Path) -> int:
    if case in ("load_fails", "eval_stop"):
        return trainer_case(case, run_dir)
    if case == "unlisted":
        capture_early_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # during start-up: recorded, not acted on yet
    if case in ("hang", "gil_hang", "beating"):
        watchdog = HangWatchdog(1.0, rank=0, dump_file=RunDir(run_dir).hang_dump(0), backstop_s=1.0)
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
            f"--resilience.hard_deadline_s={1 if case in ('deadline', 'blocked', 'finished') else 100}",
            *(['--resilience.signals=["SIGUSR2", "SIGINT"]'] if case == "unlisted" else []),
        ],
    )
    controller = ShutdownController(cfg.resilience, rank=0, device=torch.device("cpu"), run=RunDir(run_dir))
    controller.install()
    print("ready", flush=True)
    if case == "deadline":
        os.kill(os.getpid(), 15)
        print("agreed:", controller.agree(7).label, flush=True)
        stuck_in_collective()  # the emergency save that never ends
        return 3
    if case == "blocked":
        controller.last_step = 5
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
        store.get("a key no rank ever sets")  # C++ wait: the Python signal handler cannot run meanwhile
        return 3
    if case == "finished":
        os.kill(os.getpid(), 15)
        reason = controller.agree(7)
        print("exit code:", controller.finish(reason, 7), flush=True)
        time.sleep(3)  # a slow teardown, longer than the hard deadline
        return 0
    if case == "unlisted":
        return 3  # install() above must have delivered the early SIGTERM with its default action
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
