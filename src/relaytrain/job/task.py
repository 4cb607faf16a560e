"""Per-task wrapper the generated scripts put in front of each srun task's command.

`python -m relaytrain.job.task [--map-env] [--gpu-monitor-dir DIR --gpu-monitor-interval S] -- CMD...`

* `--map-env` applies the SLURM -> torch mapping (`apply_slurm_env`) before CMD starts.
* On local rank 0 of each node it starts the per-node GPU monitor as a child that ignores the stop
  signals (monitoring continues through the emergency save) and is killed when CMD's process ends
  (PR_SET_PDEATHSIG), so no helper outlives the task.
* With ``--hang-watch RUN_DIR`` every task gets ``RELAYTRAIN_PROGRESS_DIR``, the node's progress board
  for this job step (``relaytrain.job.progress``, on the node's tmpfs), and local rank 0 starts the node's
  hang watcher (``relaytrain.resilience.hangs.watch``) as such a child too. Each task that is one rank
  (``--map-env``) opens its rank's board first, in the start-up's ``launch`` phase (``job/startup.py``):
  the exec keeps the pid, so the watcher sees the rank, and its process state, from the wrapper's first
  instruction on.
* Then it execs CMD, so CMD keeps the task's pid and receives the signals srun forwards.

A stop signal that srun forwards while this wrapper starts (Slurm's pre-timeout signal of a job whose
start-up was slow, a scancel) would kill the task with the default action before CMD could handle it.
The wrapper records those signals instead and hands them to CMD in ``RELAYTRAIN_EARLY_SIGNALS``
(``SIGUSR2,SIGTERM``): relaytrain's trainer and ``relaytrain.program`` act on them as if they had
arrived after their own handlers were in place (``resilience.early_signals``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from relaytrain.entry_points import GPU_MONITOR, HANG_WATCH, TASK
from relaytrain.job.env import apply_slurm_env
from relaytrain.job.facts import STEP_RESTARTS_ENV
from relaytrain.job.netdetect import detect_interface, read_ip_brief
from relaytrain.job.progress import PROGRESS_DIR_ENV, Phase, ProgressBoard
from relaytrain.job.startup import env_ranks

NODE_MEMORY = Path("/dev/shm")  # the node's tmpfs: the board lives and dies with the node's memory
_PR_SET_PDEATHSIG = 1
EARLY_SIGNALS_ENV = "RELAYTRAIN_EARLY_SIGNALS"  # stop signals that arrived before CMD started
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
_received: list[str] = []


def _remember(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    if name not in _received:
        _received.append(name)


def capture_stop_signals() -> None:
    """Record the stop signals instead of dying on them while the wrapper starts."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), _remember)


def hand_over_stop_signals(environ: dict[str, str] | os._Environ) -> None:
    """Give the signals their default action back (CMD starts as srun would start it) and name the ones
    that arrived in ``RELAYTRAIN_EARLY_SIGNALS`` (with any an outer wrapper already named)."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    earlier = [n for n in environ.get(EARLY_SIGNALS_ENV, "").split(",") if n]
    names = earlier + [n for n in _received if n not in earlier]
    if names:
        environ[EARLY_SIGNALS_ENV] = ",".join(names)


def _monitor_preexec() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_gpu_monitor(out_dir: str, interval: float, environ: dict[str, str]) -> subprocess.Popen | None:
    """Start the GPU monitor on local rank 0, or return None (other ranks, module not installed)."""
    if environ.get("SLURM_LOCALID", "0") != "0":
        return None
    if importlib.util.find_spec(GPU_MONITOR) is None:
        print(
            f"relaytrain.job.task: {GPU_MONITOR} is not installed; no GPU monitoring",
            file=sys.stderr,
        )
        return None
    cmd = [sys.executable, "-m", GPU_MONITOR, "--out", out_dir, "--interval", str(interval)]
    return subprocess.Popen(cmd, env=environ, stdin=subprocess.DEVNULL, preexec_fn=_monitor_preexec)


def progress_dir(environ: dict[str, str] | os._Environ) -> Path:
    """The node's progress board of this job step: the same folder for every task of the node."""
    root = NODE_MEMORY if NODE_MEMORY.is_dir() else Path(tempfile.gettempdir())
    job, step = environ.get("SLURM_JOB_ID", "0"), environ.get("SLURM_STEP_ID", "0")
    return root / f"relaytrain-progress-{job}.{step}"


def start_hang_watch(run_dir: str, board: Path, environ: dict[str, str]) -> subprocess.Popen | None:
    """Start the node's hang watcher on local rank 0, or return None (other ranks)."""
    if environ.get("SLURM_LOCALID", "0") != "0":
        return None
    cmd = [
        sys.executable,
        "-m",
        HANG_WATCH,
        "--run-dir",
        run_dir,
        "--progress-dir",
        str(board),
        "--job-id",
        environ.get("SLURM_JOB_ID", "0"),
        "--step-restarts",
        environ.get(STEP_RESTARTS_ENV, "0") or "0",
        "--restart-count",
        environ.get("SLURM_RESTART_COUNT", "0") or "0",
    ]
    return subprocess.Popen(cmd, env=environ, stdin=subprocess.DEVNULL, preexec_fn=_monitor_preexec)


def main(argv: list[str] | None = None) -> int:
    capture_stop_signals()
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(f"usage: python -m {TASK} [options] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog=f"python -m {TASK}")
    parser.add_argument("--map-env", action="store_true")
    parser.add_argument("--gpu-monitor-dir", default="")
    parser.add_argument("--gpu-monitor-interval", type=float, default=5.0)
    parser.add_argument("--hang-watch", default="", metavar="RUN_DIR", help="watch the ranks for hangs")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        print("relaytrain.job.task: no command after --", file=sys.stderr)
        return 2
    if args.hang_watch:  # the rank's board first: a task stuck from here on is visible to the watcher
        board = progress_dir(os.environ)
        os.environ[PROGRESS_DIR_ENV] = str(board)
        if args.map_env:  # the task is one rank (under torchrun, its workers publish from their rendezvous)
            ProgressBoard.open_from_env(*env_ranks(os.environ), phase=Phase.LAUNCH)  # unmapped by the exec
    if args.map_env:
        apply_slurm_env(os.environ)
    if not os.environ.get("NCCL_SOCKET_IFNAME") and (name := detect_interface(read_ip_brief())):
        os.environ["NCCL_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = (
            name  # a step without the driver
        )
    if args.gpu_monitor_dir and args.gpu_monitor_interval > 0:
        start_gpu_monitor(args.gpu_monitor_dir, args.gpu_monitor_interval, dict(os.environ))
    if args.hang_watch:
        start_hang_watch(args.hang_watch, board, dict(os.environ))
    hand_over_stop_signals(os.environ)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"relaytrain.job.task: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
