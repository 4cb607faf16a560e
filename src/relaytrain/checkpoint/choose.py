"""Which committed step directory to resume from, and which one a checkpoint path argument names.

``latest`` wins when it is committed; otherwise the newest committed step. A step directory that was
not committed, or whose files do not match its COMPLETE manifest, is never chosen: the one before it is.
"""

from __future__ import annotations

import logging
from pathlib import Path

from relaytrain.checkpoint.checksums import damaged_problems
from relaytrain.checkpoint.files import COMPLETE, DCP_METADATA, LATEST, list_steps, read_latest, step_number
from relaytrain.config import Config
from relaytrain.errors import UserError
from relaytrain.job.rundir import RunDir

log = logging.getLogger("relaytrain.checkpoint")


def choose_resume(
    ckpt_dir: Path, verify: bool = True, data: bool = True, skip: frozenset[Path] = frozenset()
) -> tuple[Path | None, str]:
    """The step dir to resume from and a sentence saying why; (None, why) when there is none.

    ``latest`` wins when it is committed; otherwise the newest committed step. Incomplete step
    directories (a save that was killed) are never chosen, and a committed one whose files do not match
    its manifest (sizes; content checksums with `verify`, of shard files too with `data`) is skipped for
    the one before it, with a warning naming the file; so are the step dirs in `skip` (resolved paths: a
    load found them damaged).
    """
    entries = list_steps(ckpt_dir)
    complete = [e for e in entries if e.complete]
    skipped = [e for e in entries if not e.complete and (not complete or e.step > complete[-1].step)]
    for entry in skipped:
        log.warning(
            "skipping incomplete checkpoint %s (no %s marker: its save was interrupted)", entry.path, COMPLETE
        )
    latest = read_latest(ckpt_dir)
    candidates: list[tuple[Path, str]] = []
    if latest is not None and (latest / COMPLETE).is_file():
        newest = complete[-1].path if complete else latest
        if newest.resolve() != latest.resolve():
            log.warning(
                "latest points to %s but %s is newer and complete; using latest", latest.name, newest.name
            )
        candidates.append((latest, f"'latest' points to {latest.name}"))
        latest_step = step_number(latest.name)
        older = [e for e in complete if e.step < latest_step]
    else:
        why = "no 'latest' link" if latest is None else f"'latest' points to {latest.name}, not complete"
        older = complete
    for entry in reversed(older):
        reason = why if not candidates else "the checkpoints after it are damaged"
        candidates.append((entry.path, f"{reason}; using the newest complete checkpoint {entry.path.name}"))
    for path, reason in candidates:
        if path.resolve() in skip:
            continue
        problems = damaged_problems(path, verify, data)
        if not problems:
            return path, reason
        log.warning("skipping damaged checkpoint %s: %s", path, "; ".join(problems[:3]))
    if not complete:
        return None, f"no complete checkpoint in {ckpt_dir}"
    return None, f"every complete checkpoint in {ckpt_dir} is damaged"


def resolve_checkpoint(path: str | Path) -> Path:
    """A step dir, a checkpoints dir (its ``latest``) or a run dir (``checkpoints/latest``) -> step dir."""
    path = Path(path).expanduser()
    if (path / COMPLETE).is_file() or (path / DCP_METADATA).is_file():
        return path
    for ckpt_dir in (path, RunDir(path).checkpoints):
        if (ckpt_dir / LATEST).is_symlink() or list_steps(ckpt_dir):
            chosen, _ = choose_resume(ckpt_dir)
            if chosen is None:
                raise UserError(f"{ckpt_dir} holds no complete checkpoint")
            return chosen
    if not path.exists():
        raise UserError(f"checkpoint path {path} does not exist")
    raise UserError(
        f"{path} is not a checkpoint: give a step_<N> directory, a checkpoints directory or a run directory"
    )


def check_resume(cfg: Config) -> None:
    """An explicit `checkpoint.resume` path must name a checkpoint when the run has none of its own yet:
    checked with the config, before torch starts or the run directory is created. (Once the run saved,
    its own checkpoints win over the path, which retention may have deleted since.)"""
    ck = cfg.checkpoint
    if not ck.enabled or ck.resume in ("auto", "none"):
        return
    own = Path(ck.dir) if ck.dir else RunDir.of(cfg.run.dir, cfg.run.name).checkpoints
    if any(entry.complete for entry in list_steps(own)):
        return
    try:
        resolve_checkpoint(ck.resume)
    except UserError as exc:
        raise UserError(f"checkpoint.resume={ck.resume}: {exc}") from None
