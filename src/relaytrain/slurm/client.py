"""Running Slurm's client commands (squeue, sacct, scancel, sinfo, scontrol, sbatch) from the login node.

Every command of the CLI that asks Slurm goes through `run_slurm`, so that Slurm missing, unconfigured
or unreachable reads the same everywhere: one line naming the command and what to do, never a
traceback and never an empty answer that looks like "no jobs".
"""

from __future__ import annotations

import os
from pathlib import Path

from relaytrain.errors import UserError
from relaytrain.job.slurm_command import Outcome, SlurmResult, run_slurm_command

TIMEOUT_S = 60
# What Slurm's clients print when they cannot read the cluster's configuration ...
_NOT_CONFIGURED = (
    "Could not establish a configuration source",
    "Unable to process configuration file",
)
# ... or when the controller does not answer.
_UNREACHABLE = (
    "Unable to contact slurm controller",
    "Connection refused",
    "Zero Bytes were transmitted or received",
    "Socket timed out",
)
FIX = (
    "run relaytrain on a Slurm login node, or install Slurm's client commands and set SLURM_CONF to the "
    "cluster's slurm.conf"
)


class SlurmUnavailable(UserError):
    """Slurm cannot be asked from here: not installed, not configured, or its controller is down."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_slurm(cmd: list[str], timeout: float | None = TIMEOUT_S) -> SlurmResult:
    """Run a Slurm client command and return its result (a nonzero exit code included: "no such job" is
    an answer). Raises SlurmUnavailable when the command cannot ask Slurm at all. `timeout=None` for a
    command that must not be killed halfway (sbatch: the job may be queued before it prints its id)."""
    tool = cmd[0]
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        # The clients retry a missing file for a minute before they fail: say it at once.
        raise SlurmUnavailable(
            f"cannot run {tool}: SLURM_CONF={conf} is not a file; set SLURM_CONF to the cluster's slurm.conf "
            "or unset it"
        )
    result = run_slurm_command(cmd, timeout)
    if result.outcome is Outcome.MISSING:
        raise SlurmUnavailable(f"{tool} not found: Slurm's client commands are not installed here; {FIX}")
    if result.outcome is Outcome.TIMED_OUT:
        raise SlurmUnavailable(
            f"{tool} did not answer within {timeout:g}s: is the Slurm controller up? (scontrol ping)"
        )
    if result.outcome is Outcome.NOT_STARTED:
        raise SlurmUnavailable(f"cannot run {tool}: {result.error}; {FIX}")
    if result.returncode != 0:
        said, last = result.stderr + "\n" + result.stdout, slurm_error(result)
        if any(marker in said for marker in _NOT_CONFIGURED):
            raise SlurmUnavailable(f"{tool} cannot read Slurm's configuration ({last}); {FIX}")
        if any(marker in said for marker in _UNREACHABLE):
            raise SlurmUnavailable(
                f"{tool} cannot reach the Slurm controller ({last}); "
                "check that slurmctld is up (scontrol ping) and that SLURM_CONF names this cluster"
            )
    return result


def slurm_error(result: SlurmResult) -> str:
    """The line a failed Slurm command's answer ends with, or its exit code."""
    return _last_line(result.stderr or result.stdout) or f"exit code {result.returncode}"


def slurm_refusal(result: SlurmResult) -> str | None:
    """Why a Slurm command refused, or None: its failure, or an `error:` line of a command that exits 0
    with one (`scancel --verbose` of a job id it does not know)."""
    said = next((line for line in result.stderr.splitlines() if "error:" in line), None)
    if said:
        return said.split("error:", 1)[1].strip()
    return slurm_error(result) if result.returncode != 0 else None
