"""One job step run by the batch job's driver: launch it, pass Slurm's signals on, wait for its end.

Slurm sends the pre-timeout signal (``--signal=B:USR2@180``) to the batch process only, which is the
driver (``driver.py``; the batch script ``exec``s it). The driver passes it on to the running step,
whose ``srun``/torchrun forwards it to every training process, and keeps waiting while they save; a
signal that comes between two steps goes to the next one as soon as it can take it (below). SIGTERM (scancel,
preemption, the time limit) reaches the job step directly from Slurm: the driver only notes it and
keeps waiting, so the step's emergency save is not cut short by the batch job ending first.

srun takes the signal only once it blocks it (its signal thread then passes it on to the tasks): in
the milliseconds after its exec the signal's default action still holds and would kill srun, and with
it the step (exit 140 for SIGUSR2). Slurm sends the pre-timeout signal up to a minute early, so a short
job can get it just as its step starts. The driver therefore holds a signal until the step's process
blocks, catches or ignores it (``/proc/PID/status``), for at most ``STEP_READY_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

LOG_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"  # the batch script's `log` writes the same stamp


def log(message: str) -> None:
    """A line of the job log, stamped the way the batch script's own lines are."""
    print(f"[relaytrain {time.strftime(LOG_TIME_FORMAT)}] {message}", flush=True)


def exit_status(returncode: int) -> int:
    """A child's exit status the way bash reports it: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


STEP_READY_TIMEOUT_S = 10.0  # srun blocks its signals within milliseconds of its exec
STEP_READY_POLL_S = 0.01


def takes_signal(pid: int, signum: int) -> bool | None:
    """Whether process ``pid`` blocks, catches or ignores ``signum`` (so it does not die of it); None
    where /proc cannot tell (not Linux, the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        bit = 1 << (signum - 1)
        return any(int(fields[key], 16) & bit for key in ("SigBlk", "SigCgt", "SigIgn"))
    except (OSError, KeyError, ValueError):
        return None


class SignalForwarder:
    """Passes Slurm's pre-timeout signal on to the job step that runs, or to the next one to start."""

    def __init__(self, forwarded: str = "", pending: str = "", ready_timeout_s: float = STEP_READY_TIMEOUT_S):
        self.forwarded = "" if forwarded == "none" else forwarded  # `USR2`; none: Slurm sends none
        self.pending = pending  # a signal that came while no step could take it: it gets it once it can
        self.ready_timeout_s = ready_timeout_s
        self.step: subprocess.Popen | None = None
        self.step_ready = False  # the running step takes the forwarded signal without dying of it

    def install(self) -> None:
        if self.forwarded:
            signal.signal(signal.Signals[f"SIG{self.forwarded}"], self._forward)
        if self.forwarded != "TERM":
            signal.signal(signal.SIGTERM, self._note_term)

    def _forward(self, signum: int, _frame: object = None) -> None:
        self.forward(signal.Signals(signum).name.removeprefix("SIG"))

    def forward(self, name: str) -> None:
        log(f"received SIG{name}: forwarding it to the job step")
        step = self.step
        if step is not None and self.step_ready and step.poll() is None:
            step.send_signal(signal.Signals[f"SIG{name}"])  # a step that just ended is skipped
        else:
            self.pending = name  # no step, or one still starting: `run` hands it over

    @staticmethod
    def _note_term(_signum: int, _frame: object = None) -> None:
        log("received SIGTERM: Slurm signals the job step itself; waiting for it to finish")

    def abort(self) -> None:
        """End the running step and its tasks: two SIGINTs within a second make srun kill every task."""
        step = self.step
        for _ in range(2):
            if step is None or step.poll() is not None:
                return
            step.send_signal(signal.SIGINT)
            time.sleep(0.3)

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Start the step, hand it a pending signal once it can take it, wait for its end; its exit
        status."""
        self.step_ready = False
        self.step = subprocess.Popen(list(argv), env=env, stdout=sys.stdout, stderr=sys.stderr)
        try:
            self._wait_until_ready(self.step)
            # Ready first, then the pending check: a signal handled in between is sent by `forward`.
            self.step_ready = True
            if self.pending:
                name, self.pending = self.pending, ""
                self.forward(name)
            # A signal handler runs between two waits: waitpid is retried after it (PEP 475).
            return exit_status(self.step.wait())
        finally:
            if self.step.poll() is None:  # the driver itself failed: leave no step behind
                self.step.terminate()
            self.step = None
            self.step_ready = False

    def _wait_until_ready(self, step: subprocess.Popen) -> None:
        """Until the step's process takes the forwarded signal (or it ended, or the timeout passed)."""
        if not self.forwarded:
            return
        signum = signal.Signals[f"SIG{self.forwarded}"]
        deadline = time.monotonic() + self.ready_timeout_s
        while step.poll() is None and time.monotonic() < deadline:
            if takes_signal(step.pid, signum) is not False:
                return
            time.sleep(STEP_READY_POLL_S)
        if step.poll() is None:
            log(
                f"the job step does not take SIG{self.forwarded} after {self.ready_timeout_s:g} s; "
                "a signal goes to it all the same"
            )


class Heartbeat:
    """A timestamp every few minutes shows in the job log that the job is alive."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            log("alive")

    def __enter__(self) -> Heartbeat:
        if self.every_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()


def job_log_path() -> str:
    """The file this process's output goes to (the job's `slurm-%j.out`), or "" when it is not a file."""
    try:
        path = os.readlink("/proc/self/fd/1")
    except OSError:
        return ""
    return path if os.path.isfile(path) else ""
