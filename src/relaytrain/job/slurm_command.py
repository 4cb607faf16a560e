"""Running one Slurm client command (scontrol, squeue, sacct, sinfo, sbatch, scancel, sacctmgr, a short
srun): the one place in the package that starts one (tests/test_slurm_command.py proves it).

Every call has a timeout and gives a typed `SlurmResult` instead of raising: the tool missing (inside a
container), not answering in time, failing to start, exiting nonzero, or answering. Callers decide what
a failure means (the CLI: one line and exit 2, `relaytrain.slurm.client`; a job: carry on without the
answer, `relaytrain.job.slurmctld`; a requeue: record it pending, `relaytrain.resilience.requeue`).
"""

from __future__ import annotations

import enum
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TIMEOUT_S = 15.0  # a query of slurmctld; the callers that wait longer say so

# `scontrol requeuehold` ends the running job at once: Slurm sends SIGTERM to every process of the batch
# step, the `scontrol update` and `scontrol release` that follow it included, which would then die
# half-way and leave the job held for good. Such a command runs with SIGTERM ignored (inherited through
# exec); SIGKILL after KillWait still ends it, and each takes a fraction of a second.
_SIGTERM_IGNORED = ("sh", "-c", 'trap "" TERM; exec "$@"', "sh")


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
    try:
        done = subprocess.run(
            argv,
            capture_output=capture,
            text=True,
            timeout=timeout,
            check=False,
            env=None if env is None else dict(env),
        )
    except subprocess.TimeoutExpired:
        return SlurmResult(args, Outcome.TIMED_OUT, timeout=timeout)
    except OSError as err:
        return SlurmResult(args, Outcome.NOT_STARTED, error=err.strerror or str(err), timeout=timeout)
    outcome = Outcome.ANSWERED if done.returncode == 0 else Outcome.FAILED
    return SlurmResult(args, outcome, done.returncode, done.stdout or "", done.stderr or "", timeout=timeout)
