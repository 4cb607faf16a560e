"""Fault injection for tests and benchmarks, from outside relaytrain's code (its loop has no fault hooks).

A training process gets faults through its environment: ``env(...)`` for a process started here, or
``setup_line(...)`` for a Slurm job's ``slurm.setup``. Both put ``faults/pythonpath`` first on PYTHONPATH
(its ``sitecustomize.py`` arms the faults; ``relaytrain_faults.py`` there says what each one does) and
set the fault's variable. ``landed(output)`` lists the faults a process reported as done, so that a test
can tell "the fault did not land" apart from "the code under test did the wrong thing".
"""

from __future__ import annotations

import os
from pathlib import Path

from faults.pythonpath.relaytrain_faults import LANDED, NAN_AT_STEPS_ENV, NAN_RANK_ENV, STEP_DELAY_ENV

PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"


def variables(
    nan_at_steps: tuple[int, ...] = (), nan_rank: int | None = None, step_delay_s: float = 0.0
) -> dict[str, str]:
    """The fault variables alone (empty when no fault is asked for)."""
    out = {}
    if nan_at_steps:
        out[NAN_AT_STEPS_ENV] = ",".join(str(s) for s in nan_at_steps)
    if nan_rank is not None:
        out[NAN_RANK_ENV] = str(nan_rank)
    if step_delay_s:
        out[STEP_DELAY_ENV] = f"{step_delay_s:g}"
    return out


def env(**faults) -> dict[str, str]:
    """The variables to add to a child process's environment (this process's PYTHONPATH kept after
    faults/pythonpath) to arm the faults in it."""
    path = [str(PYTHONPATH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)} | variables(**faults)


def setup_line(**faults) -> str:
    """A shell line (no single quotes: it goes into TOML literal strings) that arms the faults for the
    rest of a Slurm batch script and its job steps (srun passes the environment on)."""
    exports = [f"{k}={v}" for k, v in variables(**faults).items()]
    return f"export {' '.join(exports)} PYTHONPATH={PYTHONPATH_DIR}${{PYTHONPATH:+:$PYTHONPATH}}"


def landed(output: str) -> list[str]:
    """The faults that processes reported as landed in `output` (their stderr), in order."""
    return [line.split(LANDED, 1)[1].strip() for line in output.splitlines() if LANDED in line]
