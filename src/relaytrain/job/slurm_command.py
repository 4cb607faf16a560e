"""Running one Slurm client command (scontrol, squeue, sacct, sinfo, sbatch, scancel, sacctmgr, a short
srun): the one place in the package that starts one (tests/test_slurm_command.py proves it).

Every call has a timeout and gives a typed `SlurmResult` instead of raising: the tool missing (inside a
container), not answering in time, failing to start, exiting nonzero, or answering. Callers decide what
a failure means (the CLI: one line and exit 2, `relaytrain.slurm.client`; a job: carry on without the
answer, `relaytrain.job.slurmctld`; a requeue: record it pending, `relaytrain.resilience.requeue`).
"""

from __future__ import annotations

import contextlib
import enum
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

TIMEOUT_S = 15.0  # a query of slurmctld; the callers that wait longer say so

# `scontrol requeuehold` ends the running job at once: Slurm sends SIGTERM to every process of the batch
# step, the `scontrol update` and `scontrol release` that follow it included, which would then die
# half-way and leave the job held for good, or requeued without its ExcNodeList. Such a command is started
# with SIGTERM blocked (from the fork on) through this interpreter, which ignores SIGTERM and execs it: a
# SIGTERM that comes before the ignore is set stays pending and is then dropped. (A shell's `trap "" TERM`
# left a window: dash clears the blocked signals at its start; seen: an `update` killed, exit -15.)
# SIGKILL after KillWait still ends it, and each takes a fraction of a second.
_SIGTERM_IGNORED = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "os.execvp(sys.argv[1], sys.argv[1:])",
)


class Outcome(enum.Enum):
    ANSWERED = "answered"  # exit 0
    FAILED = "failed"  # exit nonzero ("invalid job id" is an answer to some callers)
    MISSING = "missing"  # not on PATH
    TIMED_OUT = "timed out"
    NOT_STARTED = "not started"  # an OSError starting it


@dataclass(frozen=True)
class SlurmResult:
    args: tuple[str, ...]
    outcome: Outcome
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: str = ""  # why it did not run or did not finish
    timeout: float | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.ANSWERED

    @property
    def ran(self) -> bool:
        """It ran to its end (its exit code and output are an answer, a failure included)."""
        return self.outcome in (Outcome.ANSWERED, Outcome.FAILED)

    @property
    def command(self) -> str:
        return " ".join(self.args)

    def why(self) -> str:
        """One line: what went wrong (empty when it answered)."""
        if self.outcome is Outcome.MISSING:
            return f"{self.args[0]} is not on PATH"
        if self.outcome is Outcome.TIMED_OUT:
            return f"{self.command} did not answer within {self.timeout:g}s"
        if self.outcome is Outcome.NOT_STARTED:
            return f"{self.command} failed: {self.error}"
        if self.outcome is Outcome.FAILED:
            return f"{self.command} exited {self.returncode}: {self.stderr.strip()[:300]}"
        return ""


def run_slurm_command(
    args: Sequence[str],
    timeout: float | None = TIMEOUT_S,
    *,
    env: Mapping[str, str] | None = None,
    capture: bool = True,
    ignore_sigterm: bool = False,
) -> SlurmResult:
    """Run ``args`` and return what happened. ``timeout=None`` only for a command that must not be killed
    half-way (sbatch: the job may be queued before it prints its id). ``capture=False`` lets the output go
    where this process's goes (a job's log). ``env``: the command's environment (its PATH finds the tool)."""
    args = tuple(args)
    path = None if env is None else env.get("PATH")
    if shutil.which(args[0], path=path) is None:
        return SlurmResult(args, Outcome.MISSING, timeout=timeout)
    argv = [*_SIGTERM_IGNORED, *args] if ignore_sigterm else list(args)
    pipe = subprocess.PIPE if capture else None
    try:
        # the child inherits the blocked SIGTERM from its first instruction; this thread's mask comes back
        with _sigterm_blocked(ignore_sigterm):
            process = subprocess.Popen(
                argv, stdout=pipe, stderr=pipe, text=True, env=None if env is None else dict(env)
            )
        with process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                return SlurmResult(args, Outcome.TIMED_OUT, timeout=timeout)
    except OSError as err:
        return SlurmResult(args, Outcome.NOT_STARTED, error=err.strerror or str(err), timeout=timeout)
    outcome = Outcome.ANSWERED if process.returncode == 0 else Outcome.FAILED
    return SlurmResult(args, outcome, process.returncode, stdout or "", stderr or "", timeout=timeout)


@contextlib.contextmanager
def _sigterm_blocked(block: bool) -> Iterator[None]:
    if not block:
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
