"""Preemption safety for any training program: the Python side of the contract in docs/programs.md.

```python
from relaytrain import program
program.install()                 # first thing, before `import torch`: stop signals are recorded
import torch ...
for step in range(start, steps):
    train_step()
    if program.should_stop(step):  # agreed by every rank (one all-reduce when torch.distributed is up)
        with program.saving():     # measured: the time budget keeps room for the next save
            save(step)
        program.exit_for_requeue(step)   # records the stop, requeues when the policy says so, exits 75
program.finish(step)
```

Nothing here is a second signal handler or a second requeue path: ``install()`` is the early capture
of ``relaytrain.resilience.rank.early_signals``; the first ``should_stop()`` builds the rank's
supervision front as the trainer's loop has it (``Supervision.for_program``: the stop agreement's
handlers, time budget, hard deadline and agreement); ``exit_for_requeue()`` is its ``record()``, i.e.
``handle_stop``. The resilience settings come from the config the launcher
wrote (``RELAYTRAIN_CONFIG``), else from ``install(config=...)``, else the defaults; the run directory
(run_state.json) from ``install(run_dir=...)``, else ``RELAYTRAIN_RUN_DIR``, else ``runs/<program>``
under the working directory. torch is imported only when the controller is built.

When the step of ``relaytrain launch --command`` ended, the batch script's end-of-step decision
(``python -m relaytrain.resilience.batch.step_end --program``) turns an exit code 75 that the program did not
record through this API into a requeue (capped by resilience.max_requeues) with reason ``program_exit``.
``python -m relaytrain.program after-step RC`` is the same (batch scripts of earlier versions call it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from relaytrain.entry_points import PROGRAM as PROGRAM_MODULE
from relaytrain.job import JobFacts
from relaytrain.job.jsonl import append_event
from relaytrain.job.rundir import RunDir
from relaytrain.resilience.codes import (
    EXIT_RESTART_STEP,  # noqa: F401  (the API's exit 76)
    StopReason,
)
from relaytrain.resilience.rank.early_signals import capture_early_signals
from relaytrain.resilience.run_kind import PROGRAM, RunKind, claim_kind
from relaytrain.resilience.run_lock import RunLock
from relaytrain.resilience.run_state import RunStateFile, RunStatus

log = logging.getLogger(__name__)

RUN_DIR_ENV = "RELAYTRAIN_RUN_DIR"
CONFIG_ENV = "RELAYTRAIN_CONFIG"

_state: dict[str, Any] = {
    "installed": False,
    "run": None,  # the RunDir
    "config": None,
    "previous": None,  # run_state.json as it was when install() ran
    "supervision": None,  # resilience.rank.supervision.Supervision, built at the first should_stop()
    "save_s": 0.0,  # the longest measured save, for the time budget
    "reason": StopReason.NONE,
}


def _run_dir(run_dir: str | Path | None) -> RunDir:
    """`run_dir`, else RELAYTRAIN_RUN_DIR (a launch sets it), else `runs/<program>` of its own, said in
    one line: never the working directory, where every program would append to the same run."""
    chosen = run_dir or os.environ.get(RUN_DIR_ENV)
    if chosen:
        return RunDir(Path(chosen).absolute())
    own = (Path("runs") / program_name()).absolute()
    if _rank() == 0:
        print(
            f"relaytrain.program: run directory {own} (no {RUN_DIR_ENV}; set it, or install(run_dir=...), "
            "to choose another)",
            file=sys.stderr,
            flush=True,
        )
    return RunDir(own)


def program_name() -> str:
    """The running script's name (`examples/ddp_train.py` -> ddp_train; a package's __main__: the package)."""
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-") else None
    name = "" if main is None else main.parent.name if main.stem == "__main__" else main.stem
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "program"


def _load_config(config):
    """The Config whose [resilience] section applies: an object, a TOML path, RELAYTRAIN_CONFIG, defaults."""
    from relaytrain.config import Config, load_config

    if isinstance(config, Config):
        return config
    path = config or os.environ.get(CONFIG_ENV) or None
    return load_config(path) if path else Config()


def _rank() -> int:
    supervision = _state["supervision"]
    return supervision.env.rank if supervision is not None else int(os.environ.get("RANK", "0"))


def _log_event(event: str, step: int, **fields: Any) -> None:
    """Rank 0 appends ``event`` to <run_dir>/metrics.jsonl as the trainer's metrics logger does (one
    record per start, resume, stop and finish, with the job id and restart count), so that
    `relaytrain status` and `report` tell this program's restarts and stops like the trainer's."""
    if _rank() != 0:
        return
    run = _state["run"]  # the trainer's metrics log; a program writes events only
    try:
        append_event(run, event, step, **fields)
    except OSError as error:  # a full or read-only disk must not keep the program from its own work
        log.warning("could not record %s in %s: %s", event, run.metrics, error)


def install(run_dir: str | Path | None = None, config=None) -> None:
    """Record stop signals from now on (call it before importing torch); idempotent.

    ``run_dir``: where run_state.json lives (default RELAYTRAIN_RUN_DIR, else ``runs/<program>``).
    ``config``: a relaytrain Config or TOML path whose [resilience] section applies (default
    RELAYTRAIN_CONFIG, else the defaults).
    """
    if _state["installed"]:
        return
    capture_early_signals()
    _state["run"] = _run_dir(run_dir)
    if _rank() == 0:
        _take_run_lock(_state["run"])
    _state["config"] = config
    _state["previous"] = RunStateFile(_state["run"]).read()
    _state["installed"] = True
    previous = previous_stop()
    job = JobFacts.from_env()
    if previous is not None or job.restart_count:
        _log_event("resume", int((previous or {}).get("step", -1)), nodes=job.num_nodes or None)
    else:
        _log_event("start", 0, nodes=job.num_nodes or None)


def _take_run_lock(run: RunDir) -> None:
    """One writer per run directory (docs/resilience.md): held until the process exits."""
    from relaytrain.errors import USAGE_EXIT_CODE, UserError

    try:
        RunLock(run).acquire(PROGRAM_MODULE)  # released at exit
        claim_kind(run, RunKind(PROGRAM))  # never a trainer's run directory
    except UserError as error:
        print(f"relaytrain: error: {error}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)


def _supervision():
    """The rank's supervision front, built at the first call on every rank (a collective when distributed)."""
    if _state["supervision"] is not None:
        return _state["supervision"]
    install()
    import torch.distributed as dist

    from relaytrain.resilience.rank.supervision import Supervision

    cfg = _load_config(_state["config"])
    _state["config"] = cfg
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
    supervision = Supervision.for_program(cfg, rank, _collective_device(), _state["run"])
    supervision.starting()
    _state["supervision"] = supervision
    return supervision


def _collective_device():
    """Where the default group's collectives take their tensors: the host when the group has a CPU
    backend (gloo, or "cpu:gloo,cuda:nccl"), else the current device of its accelerator (NCCL: this
    process's CUDA device, XCCL: its XPU); the host without a process group."""
    import torch
    import torch.distributed as dist

    from relaytrain.torch_private import object_collective_device

    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    kind = object_collective_device()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _barrier() -> None:
    """A barrier on the default group; on an accelerator on this process's device (NCCL guesses the
    device from the rank without `device_ids`, and hangs when the guess is wrong)."""
    import torch.distributed as dist

    device = _collective_device()
    dist.barrier(device_ids=None if device.type == "cpu" else [device.index])


def should_stop(step: int | None = None) -> bool:
    """True once every rank agreed to stop (a signal on any rank, or the time budget ran out).

    Call it at the same points on every rank (it is one MAX all-reduce when torch.distributed is
    initialized). Outside Slurm it is True only after a stop signal (SIGTERM, SIGUSR2, Ctrl-C).
    """
    supervision = _supervision()
    reason = supervision.agree_stop(supervision.last_step + 1 if step is None else step, _state["save_s"])
    _state["reason"] = reason
    return reason != StopReason.NONE


def stop_reason() -> str:
    """The agreed stop reason's label (``time_limit_signal``, ``preemption``, ...), or ``""``."""
    reason = _state["reason"]
    return reason.label if reason != StopReason.NONE else ""


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Measure a checkpoint save; the time budget keeps room for the longest one seen."""
    start = time.monotonic()
    try:
        yield
    finally:
        _state["save_s"] = max(_state["save_s"], time.monotonic() - start)


def time_left() -> float | None:
    """Seconds until the Slurm job's end time, or None (outside Slurm, or no end time known)."""
    if _state["supervision"] is not None:
        return _state["supervision"].time_left()
    end, _ = JobFacts.from_env().end_time()
    return None if end is None else end - time.time()


def restart_count() -> int:
    """How often this job was requeued before (SLURM_RESTART_COUNT; 0 on a first run and outside Slurm)."""
    return JobFacts.from_env().restart_count


def previous_stop() -> dict[str, Any] | None:
    """The last recorded stop of this run (``step``, ``reason``, ``saved``, ``restart_count``, ...),
    as run_state.json held it when ``install()`` ran; None when the run never stopped before."""
    install()
    record = _state["previous"]
    if record is None or record.status is not RunStatus.STOPPED:
        return None
    return record.as_json()


def exit_for_requeue(step: int | None = None, *, saved: bool = True) -> NoReturn:
    """Record the stop and exit: every rank calls it after the checkpoint of ``step`` is complete.

    Rank 0 writes run_state.json and runs ``scontrol requeue`` when the policy allows (a time-limit
    stop while SLURM_RESTART_COUNT < resilience.max_requeues, a preemption); a cancel, Ctrl-C or a
    stop outside Slurm is recorded without a requeue. Called with no stop agreed, the stop is the
    program's own request to continue (``program_exit``, capped like a time-limit stop). The exit
    code is 75 for every resumable stop, 130 after a Ctrl-C (the user's stop, not a requeue request).
    """
    supervision = _supervision()
    agreed, agreed_at = supervision.stop_requested
    reason = agreed if agreed != StopReason.NONE else StopReason.PROGRAM_EXIT
    at = agreed_at if step is None and agreed_at >= 0 else step
    at = supervision.last_step if at is None else at
    code = supervision.record(reason, at, saved=saved)
    _log_stop(at)
    supervision.close(finished=False)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # No rank exits before rank 0 recorded the stop: srun --kill-on-bad-exit ends the step at the
        # first exit 75. If rank 0 requeued the job, Slurm ends everyone here.
        _barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _log_stop(step: int) -> None:
    """The stop as run_state.json recorded it (reason, saved, requeue), as a `stop` event."""
    record = RunStateFile(_state["run"]).read()
    state = record.as_json() if record is not None else {}
    fields = {
        key: state.get(key) for key in ("reason", "saved", "requeue_requested", "exit_code") if key in state
    }
    _log_event("stop", step, **fields)


def finish(step: int) -> None:
    """The program reached its end: run_state.json says finished (rank 0 writes it)."""
    from relaytrain.resilience.requeue import mark_finished

    install()
    supervision = _state["supervision"]
    mark_finished(_state["run"], _rank(), step)
    _log_event("finished", step)
    if supervision is not None:
        supervision.close(finished=True, exiting=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM_MODULE}")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("after-step", help="the end-of-step decision after a program's step")
    p.add_argument("exit_code", type=int)
    p.add_argument("--run-dir", default=os.environ.get(RUN_DIR_ENV, ""))
    p.add_argument("--config", default=os.environ.get(CONFIG_ENV, ""))
    args = parser.parse_args(argv)
    if not args.run_dir:
        parser.error(f"--run-dir (or {RUN_DIR_ENV}) is required")
    from relaytrain.resilience.batch.step_end import run

    return run(RunDir(Path(args.run_dir)), args.exit_code, args.config, program=True)


if __name__ == "__main__":
    sys.exit(main())
