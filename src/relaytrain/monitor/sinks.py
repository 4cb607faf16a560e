"""Where metric records go: metrics.jsonl, TensorBoard, Weights & Biases, the console.

Every sink takes the same records: flat dicts with ``kind`` ("train", "eval" or "event"),
``step`` and JSON-safe values (see ``metrics.py`` for the schema).
"""

from __future__ import annotations

import importlib
import logging
import secrets
import sys
from pathlib import Path
from typing import Any

from relaytrain.errors import UserError
from relaytrain.job.jsonl import Appender
from relaytrain.job.rundir import RunDir

log = logging.getLogger("relaytrain.metrics")

# Record fields that identify a record rather than measure something.
META_FIELDS = ("kind", "step", "time", "job_id", "restart", "event")


class JsonlSink(Appender):
    """Appends one JSON object per line (`relaytrain.job.jsonl`); requeued jobs continue the same file,
    and a killed job keeps every line written before the kill."""


class TensorBoardSink:
    """Scalars under ``train/<key>`` and ``eval/<key>``, events as text under ``events``."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when enabled

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record["kind"], record["step"]
        if kind == "event":
            fields = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("kind", "step", "time"))
            self._writer.add_text("events", fields, step)
        else:
            for key, value in record.items():
                if key not in META_FIELDS and isinstance(value, int | float) and not isinstance(value, bool):
                    self._writer.add_scalar(f"{kind}/{key}", value, step, walltime=record.get("time"))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases run whose id lives in ``<run_dir>/wandb_id`` so requeued jobs resume it."""

    def __init__(self, run: RunDir, project: str, mode: str, run_name: str, config: dict[str, Any]):
        try:
            wandb = importlib.import_module("wandb")
        except ImportError:
            raise UserError(
                "metrics.wandb = true but the wandb package is not installed: "
                "pip install wandb (or set metrics.wandb = false)"
            ) from None
        id_file = run.wandb_id
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(8)
            run.root.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        self.run_id = run_id
        self._run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(run.root),
            config=config,
        )

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record["kind"], record["step"]
        if kind == "event":
            return  # W&B has no per-step text log; events stay in metrics.jsonl and TensorBoard
        values = {
            f"{kind}/{k}": v
            for k, v in record.items()
            if k not in META_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)
        }
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class ConsoleSink:
    """Plain log lines (SLURM output, pipes); on a terminal also a live rich progress bar.

    Lines go through the ``relaytrain.metrics`` logger so they carry the rank tag and land in
    the rank's log file; while the bar is live, rich redirects stdout to print above it.
    """

    def __init__(self, total_steps: int, progress_bar: bool | None = None, console=None):
        if progress_bar is None:
            progress_bar = sys.stdout.isatty()
        self._total = total_steps
        self._console = console
        self._progress = None
        self._task = None
        self._enabled_bar = progress_bar

    def _ensure_bar(self, step: int) -> None:
        if self._progress is not None or not self._enabled_bar:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[summary]}"),
            console=self._console,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self._total, completed=step, summary="")

    def write_line(self, line: str, step: int | None = None, summary: str = "") -> None:
        if step is not None:
            self._ensure_bar(step)
            if self._progress is not None:
                self._progress.update(self._task, completed=step, summary=summary)
        if logging.getLogger().handlers or log.handlers:
            log.info(line)
        else:  # no logging configured (a library user, a test): still show the line
            print(line, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
