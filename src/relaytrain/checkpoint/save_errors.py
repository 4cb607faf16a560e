"""What a failed checkpoint save leaves behind and tells the user.

A save that fails half-way (most often a full disk) must not lose anything that was saved: the previous
complete checkpoint stays where `latest` points, and the partial step directory is deleted at once, so
that the space it took is free again for the run's own records (run_state.json, the logs) and for the
next attempt. A full disk is a condition the user fixes, not a crash to retry: it becomes one UserError
line (the CLI exits 2, which crash recovery never requeues); other failures stay RuntimeErrors.
"""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

from relaytrain.checkpoint.files import read_latest, remove_step_dir
from relaytrain.errors import UserError

log = logging.getLogger(__name__)

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full_error(exc: BaseException | None) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind a save failure, via causes, contexts, DCP's rank failures."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            return err
        todo += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)  # torch's CheckpointException: {rank: exception}
        if isinstance(failures, dict):  # values: the exception, or (exception, traceback summary)
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) and failure else failure)
    return None


def save_failure(
    step: int, step_dir: Path, exc: BaseException | None, is_rank0: bool, disk_full: bool
) -> Exception:
    """Remove the partial `step_dir` (rank 0); the error every rank raises (`disk_full`: agreed by all)."""
    ckpt_dir = step_dir.parent
    if is_rank0:
        remove_step_dir(step_dir)
    latest = read_latest(ckpt_dir)
    kept = f"the last complete checkpoint ({latest.name}) is intact" if latest else "no earlier checkpoint"
    if not disk_full:
        return RuntimeError(
            f"checkpoint save of step {step} failed on at least one rank (this rank: {exc!r}); "
            f"the incomplete {step_dir.name} was removed and {kept}"
        )
    try:
        free = f", {shutil.disk_usage(ckpt_dir).free / 2**20:.0f} MiB free now"
    except OSError:
        free = ""
    return UserError(
        f"checkpoint save of step {step} failed: no space left under {ckpt_dir}{free} "
        f"(the incomplete {step_dir.name} was removed; {kept}); free space (or lower checkpoint.keep_last, "
        "or set checkpoint.dir to a larger filesystem) and submit the run again to continue from it"
    )
