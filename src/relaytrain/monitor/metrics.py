"""MetricsLogger: turns what the trainer measured into records for every enabled sink.

Record schema (metrics.jsonl, one object per line; docs/monitoring.md has the full table):

- every record: ``kind`` ("train" | "eval" | "event"), ``step``, ``time`` (unix seconds),
  ``job_id`` (SLURM_JOB_ID or null), ``restart`` (SLURM_RESTART_COUNT or 0)
- train: ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``tokens_per_s_per_device``, ``mfu``
  (and ``mfu_estimate: true`` when the peak was measured on this CPU rather than taken from a table),
  memory (``mem_*_gib``), step time split (``time_<section>_s``, ``time_step_s``) and whatever
  else the trainer passed
- eval: ``val_loss``, ``val_ppl``
- event: ``event`` ("start", "resume", "checkpoint", "stop", ...) plus the event's fields

Non-finite numbers (a NaN loss) are written as null so the file stays strict JSON.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from relaytrain.config.schema import MetricsConfig
from relaytrain.job.jsonl import event_record
from relaytrain.job.rundir import RunDir, metrics_record
from relaytrain.monitor.memory import memory_stats
from relaytrain.monitor.mfu import cpu_capability, mfu, peak_flops_per_device, raise_cpu_peak, throughput
from relaytrain.monitor.sinks import ConsoleSink, JsonlSink, TensorBoardSink, WandbSink

log = logging.getLogger("relaytrain")


def _json_value(value: Any) -> Any:
    """A JSON-safe copy: tensors and numpy scalars as numbers, NaN/inf as None, paths as text."""
    if isinstance(value, torch.Tensor) or (hasattr(value, "item") and hasattr(value, "dtype")):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return str(value)


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"


def format_train_line(step: int, total_steps: int, rec: dict[str, Any]) -> str:
    """One console line: step, loss, lr, grad norm, tokens/s, MFU, memory, step time."""

    def num(key: str, fmt: str) -> str:
        value = rec.get(key)
        return "nan" if value is None else format(value, fmt)

    parts = [f"step {step}/{total_steps}", f"loss {num('loss', '.4f')}", f"lr {num('lr', '.2e')}"]
    parts.append(f"grad {num('grad_norm', '.3f')}")
    if rec.get("tokens_per_s") is not None:
        parts.append(f"{_si(rec['tokens_per_s'])} tok/s ({_si(rec['tokens_per_s_per_device'])}/dev)")
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    if "mem_allocated_gib" in rec:
        parts.append(
            f"mem {rec['mem_allocated_gib']:.1f}/{rec['mem_reserved_gib']:.1f} GiB "
            f"(peak {rec['mem_peak_gib']:.1f})"
        )
        if rec.get("mem_alloc_retries"):
            parts.append(f"alloc retries {rec['mem_alloc_retries']:.0f}")
    elif "mem_rss_gib" in rec:
        parts.append(f"mem rss {rec['mem_rss_gib']:.2f} GiB (peak {rec['mem_peak_gib']:.2f})")
    elif "mem_peak_gib" in rec:
        parts.append(f"mem peak {rec['mem_peak_gib']:.2f} GiB")
    if rec.get("time_step_s") is not None:
        split = ", ".join(
            f"{label} {rec[key]:.3f}"
            for label, key in (
                ("data", "time_data_s"),
                ("fwd+bwd", "time_forward_backward_s"),
                ("opt", "time_optimizer_s"),
                ("ckpt", "time_checkpoint_s"),
            )
            if key in rec
        )
        parts.append(f"step {rec['time_step_s']:.3f}s" + (f" ({split})" if split else ""))
    return " | ".join(parts)


class MetricsLogger:
    """Sinks for one run. Every rank may build one; only ``is_main`` writes anything.

    ``log_train(step, metrics, tokens=, seconds=)`` expects ``loss`` (already averaged over
    data-parallel ranks), ``lr``, ``grad_norm`` and the ``StepTimer.window()`` values as
    ``time_<name>_s``, plus the raw counts: tokens processed over all ranks in ``seconds`` of wall
    time (default: one global batch in ``time_step_s``). This class alone derives tokens/s, tokens/s
    per device, MFU (against the peak it owns) and memory stats. It takes its own config section;
    ``run_config`` is the whole run's config as a dict, stored with the W&B run.
    """

    def __init__(
        self,
        mcfg: MetricsConfig,
        run: RunDir,
        is_main: bool,
        *,
        device: torch.device,
        world_size: int,
        total_steps: int,
        tokens_per_step: int,
        flops_per_token: float,
        run_name: str,
        run_config: dict[str, Any] | None = None,
        progress_bar: bool | None = None,
    ):
        self.run = run
        self.is_main = is_main
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.device = device
        self.world_size = world_size
        self._sinks: list[Any] = []
        self._console: ConsoleSink | None = None
        self.peak_flops, self.peak_source, self.peak_estimate = 0.0, "", False
        self.flops_per_token = 0.0
        self._mfu_warned = False
        if not is_main:
            return
        self.flops_per_token = float(flops_per_token)
        peak = peak_flops_per_device(self.device, mcfg.peak_flops)
        self.peak_flops, self.peak_source, self.peak_estimate = peak.flops, peak.source, peak.estimate
        log.info(
            "device %s (CPU capability %s, %d threads): peak %.4g GFLOP/s per device: %s",
            self.device,
            cpu_capability(),
            torch.get_num_threads(),
            peak.flops / 1e9,
            peak.source,
        )

        m = mcfg
        if m.jsonl:
            self._sinks.append(JsonlSink(run.metrics))
        if m.tensorboard:
            self._sinks.append(TensorBoardSink(run.tensorboard))
        if m.wandb:
            self._sinks.append(WandbSink(run, m.wandb_project, m.wandb_mode, run_name, run_config or {}))
        self._console = ConsoleSink(self.total_steps, progress_bar=progress_bar)

    def _record(self, kind: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
        return metrics_record(kind, step, {key: _json_value(value) for key, value in values.items()})

    def _emit(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.write(record)

    def derive(
        self, metrics: dict[str, Any], tokens: float | None = None, seconds: float | None = None
    ) -> dict[str, Any]:
        """The measurements plus tokens/s, tokens/s per device, MFU and memory."""
        out = {key: _json_value(value) for key, value in metrics.items()}
        if seconds is None:
            seconds = out.get("time_step_s")
            tokens = self.tokens_per_step if tokens is None else tokens
        if seconds and tokens is not None:
            out["tokens_per_s"], out["tokens_per_s_per_device"] = throughput(tokens, seconds, self.world_size)
            out["mfu"] = mfu(out["tokens_per_s_per_device"], self.flops_per_token, self.peak_flops)
            if self.peak_estimate:
                out["mfu_estimate"] = True
                if out["mfu"] > 1.0:  # the CPU peak was measured under load: what ran is the better figure
                    achieved = out["tokens_per_s_per_device"] * self.flops_per_token
                    peak = raise_cpu_peak(achieved)
                    log.info(
                        "this window ran at %.4g GFLOP/s, above the CPU peak of %.4g measured under "
                        "load: the peak is now %s",
                        achieved / 1e9,
                        self.peak_flops / 1e9,
                        peak.source,
                    )
                    self.peak_flops, self.peak_source = peak.flops, peak.source
                    out["mfu"] = 1.0
            if out["mfu"] > 1.0 and not self._mfu_warned:
                self._mfu_warned = True
                log.warning(
                    "MFU %.0f%% is above 100%%: the peak of %.4g GFLOP/s is too low (%s); set "
                    "metrics.peak_flops to this device's real peak",
                    100 * out["mfu"],
                    self.peak_flops / 1e9,
                    self.peak_source,
                )
        for key, value in memory_stats(self.device).items():
            out.setdefault(key, value)  # the trainer's window_memory_stats (max over ranks) come first
        return {key: _json_value(value) for key, value in out.items()}

    def log_train(
        self, step: int, metrics: dict[str, Any], *, tokens: float | None = None, seconds: float | None = None
    ) -> None:
        if not self.is_main:
            return
        record = self._record("train", step, self.derive(metrics, tokens, seconds))
        self._emit(record)
        if self._console is not None:
            line = format_train_line(step, self.total_steps, record)
            summary = f"loss {record['loss']:.4f}" if record.get("loss") is not None else ""
            self._console.write_line(line, step=step, summary=summary)

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """``metrics``: ``val_loss`` (``val_ppl`` is derived when missing) and any other values."""
        if not self.is_main:
            return
        values = dict(metrics)
        if "val_ppl" not in values and values.get("val_loss") is not None:
            loss = float(_json_value(values["val_loss"]))
            values["val_ppl"] = math.exp(loss) if loss < 700 else math.inf
        record = self._record("eval", step, values)
        self._emit(record)
        if self._console is not None:
            shown = ", ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in values.items()
                if record.get(k) is not None
            )
            self._console.write_line(f"eval step {step}: {shown}")

    def log_rank_times(self, step: int, values: dict[str, Any]) -> None:
        """A straggler window's per-rank medians (``rank<R>_<phase>_s``): a `rank_times` record, and
        TensorBoard scalars under ``rank_times/``; not on the console."""
        if self.is_main:
            self._emit(self._record("rank_times", step, values))

    def log_ledger(self, step: int, values: dict[str, Any]) -> None:
        """A time-ledger window (monitor/time_ledger.py): a `ledger` record, its ``goodput`` a TensorBoard
        scalar (``ledger/goodput``); not on the console."""
        if self.is_main:
            self._emit(self._record("ledger", step, values))

    def log_event(self, event: str, step: int, **fields: Any) -> None:
        if not self.is_main:
            return
        record = event_record(event, step, {key: _json_value(value) for key, value in fields.items()})
        self._emit(record)
        if self._console is not None:
            extra = ", ".join(f"{k}={v}" for k, v in fields.items())
            self._console.write_line(f"event {event} at step {step}" + (f" ({extra})" if extra else ""))

    def close(self) -> None:
        if self._console is not None:
            self._console.close()
            self._console = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []
