"""Per-task wrapper the generated scripts put in front of each srun task's command.

`python -m relaytrain.job.task [--map-env] [--gpu-monitor-dir DIR --gpu-monitor-interval S] -- CMD...`

* `--map-env` applies the SLURM -> torch mapping (`apply_slurm_env`) before CMD starts.
* On local rank 0 of each node it starts the per-node GPU monitor as a child that ignores the stop
  signals (monitoring continues through the emergency save) and is killed when CMD's process ends
  (PR_SET_PDEATHSIG), so no helper outlives the task.
* Then it execs CMD, so CMD keeps the task's pid and receives the signals srun forwards.
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

from relaytrain.job.env import apply_slurm_env

GPU_MONITOR_MODULE = "relaytrain.monitor.gpu_monitor"
_PR_SET_PDEATHSIG = 1


def _monitor_preexec() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_gpu_monitor(out_dir: str, interval: float, environ: dict[str, str]) -> subprocess.Popen | None:
    """Start the GPU monitor on local rank 0, or return None (other ranks, module not installed)."""
    if environ.get("SLURM_LOCALID", "0") != "0":
        return None
    if importlib.util.find_spec(GPU_MONITOR_MODULE) is None:
        print(
            f"relaytrain.job.task: {GPU_MONITOR_MODULE} is not installed; no GPU monitoring",
            file=sys.stderr,
        )
        return None
    cmd = [sys.executable, "-m", GPU_MONITOR_MODULE, "--out", out_dir, "--interval", str(interval)]
    return subprocess.Popen(cmd, env=environ, stdin=subprocess.DEVNULL, preexec_fn=_monitor_preexec)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m relaytrain.job.task [options] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m relaytrain.job.task")
    parser.add_argument("--map-env", action="store_true")
    parser.add_argument("--gpu-monitor-dir", default="")
    parser.add_argument("--gpu-monitor-interval", type=float, default=5.0)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        print("relaytrain.job.task: no command after --", file=sys.stderr)
        return 2
    if args.map_env:
        apply_slurm_env(os.environ)
    if args.gpu_monitor_dir and args.gpu_monitor_interval > 0:
        start_gpu_monitor(args.gpu_monitor_dir, args.gpu_monitor_interval, dict(os.environ))
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"relaytrain.job.task: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
