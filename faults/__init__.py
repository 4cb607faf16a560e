"""Fault injection for tests and benchmarks, from outside relaytrain's code (its loop has no fault hooks).

A training process gets faults through its environment: ``env(...)`` for a process started here, or
``setup_line(...)`` for a Slurm job's ``slurm.setup``. Both put ``faults/pythonpath`` first on PYTHONPATH
(its ``sitecustomize.py`` arms the faults; ``relaytrain_faults.py`` there says what each one does) and
set the fault's variable. ``landed(output)`` lists the faults a process reported as done, so that a test
can tell "the fault did not land" apart from "the code under test did the wrong thing"; ``landed_at``
adds the Unix time each one landed at (a benchmark measures from it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from faults.pythonpath.relaytrain_faults import (
    BREAK_SURVIVORS_ENV,
    FAULT_RANK_ENV,
    FIFO_AT_STEP_ENV,
    IMPORT_MODULE_ENV,
    LANDED,
    LAYER_DELAY_ENV,
    NAN_AT_STEPS_ENV,
    NAN_RANK_ENV,
    SAVE_ERROR_DELAY_ENV,
    SHAPE_ERROR_AT_STEP_ENV,
    SKIP_COLLECTIVE_AT_STEP_ENV,
    SLOW_FACTOR_ENV,
    SLOW_FROM_STEP_ENV,
    STALL_AT_STEP_ENV,
    STEP_DELAY_ENV,
    STOP_IN_JOB_STEP_ENV,
    STOP_IN_PHASE_ENV,
)

PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"


# variables()'s keyword for each hang fault (faults/pythonpath/relaytrain_faults.py: HangFaults)
HANG_FAULTS = {
    "rank": FAULT_RANK_ENV,
    "fifo_at_step": FIFO_AT_STEP_ENV,
    "stall_at_step": STALL_AT_STEP_ENV,
    "skip_collective_at_step": SKIP_COLLECTIVE_AT_STEP_ENV,
    "slow_factor": SLOW_FACTOR_ENV,
    "slow_from_step": SLOW_FROM_STEP_ENV,
    "stop_in_phase": STOP_IN_PHASE_ENV,
    "stop_in_job_step": STOP_IN_JOB_STEP_ENV,
}


def variables(
    nan_at_steps: tuple[int, ...] = (),
    nan_rank: int | None = None,
    step_delay_s: float = 0.0,
    layer_delay_s: float = 0.0,
    shape_error_at_step: int | None = None,
    import_module: str = "",
    break_survivors: bool = False,
    save_error_delay_s: float = 0.0,
    **hang,
) -> dict[str, str]:
    """The fault variables alone (empty when no fault is asked for); `hang`: HANG_FAULTS' keywords."""
    unknown = sorted(set(hang) - set(HANG_FAULTS))
    if unknown:
        raise TypeError(f"no fault named {', '.join(unknown)}; the hang faults: {', '.join(HANG_FAULTS)}")
    out = {}
    if nan_at_steps:
        out[NAN_AT_STEPS_ENV] = ",".join(str(s) for s in nan_at_steps)
    if nan_rank is not None:
        out[NAN_RANK_ENV] = str(nan_rank)
    if step_delay_s:
        out[STEP_DELAY_ENV] = f"{step_delay_s:g}"
    if layer_delay_s:
        out[LAYER_DELAY_ENV] = f"{layer_delay_s:g}"
    if shape_error_at_step is not None:
        out[SHAPE_ERROR_AT_STEP_ENV] = str(shape_error_at_step)
    if import_module:
        out[IMPORT_MODULE_ENV] = import_module
    if break_survivors:
        out[BREAK_SURVIVORS_ENV] = "1"
    if save_error_delay_s:
        out[SAVE_ERROR_DELAY_ENV] = f"{save_error_delay_s:g}"
    out |= {HANG_FAULTS[k]: v if isinstance(v, str) else f"{v:g}" for k, v in hang.items() if v is not None}
    return out


def env(**faults) -> dict[str, str]:
    """The variables to add to a child process's environment (this process's PYTHONPATH kept after
    faults/pythonpath) to arm the faults in it."""
    path = [str(PYTHONPATH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)} | variables(**faults)


def setup_line(**faults) -> str:
    """A shell line (no single quotes: it goes into TOML literal strings) that arms the faults for the
    rest of a Slurm batch script and its job steps (srun passes the environment on)."""
    # a value with a space (a phase's label: `checkpoint save`) in double quotes
    exports = [f'{k}="{v}"' if " " in v else f"{k}={v}" for k, v in variables(**faults).items()]
    return f"export {' '.join(exports)} PYTHONPATH={PYTHONPATH_DIR}${{PYTHONPATH:+:$PYTHONPATH}}"


# The end of a landed line: the Unix time the fault landed at
LANDED_TIME = re.compile(r"\s*\[t=(\d+(?:\.\d*)?)\]\s*$")


def landed_at(output: str) -> list[tuple[str, float | None]]:
    """(what landed, the Unix time it landed at) for each fault that processes reported as landed in
    `output` (their stderr, or a job log), in order; None where the line carries no time."""
    found = []
    for line in output.splitlines():
        if LANDED in line:
            text = line.split(LANDED, 1)[1]
            stamp = LANDED_TIME.search(text)
            found.append((LANDED_TIME.sub("", text).strip(), float(stamp.group(1)) if stamp else None))
    return found


def landed(output: str) -> list[str]:
    """The faults that processes reported as landed in `output` (their stderr), in order."""
    return [text for text, _ in landed_at(output)]
