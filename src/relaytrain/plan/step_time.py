"""`relaytrain plan`'s step-time and time-to-train estimates, labelled as estimates.

FLOPs per step are exact for the model (relaytrain.model.flops: 6 N + attention per token, times
train.global_batch_size x train.seq_len tokens); the time is those FLOPs over the GPUs' peak bf16 FLOP/s
(relaytrain.monitor.mfu's table, or metrics.peak_flops) at an assumed MFU, which only a run can measure
(it logs its own MFU). Recomputation by activation checkpointing is not counted, as for MFU.

A pipeline idles while it fills and drains: with pp stages and n micro batches per step the step takes
(pp - 1) / n longer than its compute (1F1B and GPipe), (pp - 1) / (v n) with the interleaved schedule of v
virtual stages per rank; the estimate adds that bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.config import Config
from relaytrain.model.flops import flops_per_token

DEFAULT_MFU = 0.40  # assumed model FLOPs utilisation; `relaytrain plan --mfu` changes it


@dataclass(frozen=True)
class StepEstimate:
    step_flops: float
    peak_flops: float  # per GPU; 0: unknown, no time estimate
    gpus: int
    mfu: float
    max_steps: int
    bubble: float = 0.0  # the pipeline's idle time, as a share of the step's compute time

    @property
    def seconds(self) -> float:
        """Estimated seconds per optimizer step, bubble included; 0.0 when the GPU's peak is unknown."""
        if not self.peak_flops:
            return 0.0
        return self.step_flops / (self.gpus * self.peak_flops * self.mfu) * (1.0 + self.bubble)


def pipeline_bubble(cfg: Config, dims) -> float:
    """(pp - 1) / (v n): the share of idle time a pipeline adds to its step (0 without one)."""
    if dims is None or dims.pp == 1 or not dims.grad_accum:
        return 0.0
    virtual = cfg.parallel.pp_virtual_stages if cfg.parallel.pp_schedule == "interleaved_1f1b" else 1
    return (dims.pp - 1) / (virtual * dims.grad_accum)


def estimate_step(cfg: Config, gpus: int, gpu: str, mfu: float = DEFAULT_MFU, dims=None) -> StepEstimate:
    """`dims`: the layout (relaytrain.parallel.dims.ParallelDims), for the pipeline bubble."""
    from relaytrain.monitor.mfu import lookup_gpu_peak_flops

    t = cfg.train
    return StepEstimate(
        step_flops=flops_per_token(cfg.model, t.seq_len) * t.global_batch_size * t.seq_len,
        peak_flops=cfg.metrics.peak_flops or (lookup_gpu_peak_flops(gpu) if gpu else 0.0),
        gpus=gpus,
        mfu=mfu,
        max_steps=t.max_steps,
        bubble=pipeline_bubble(cfg, dims),
    )


def human_duration(seconds: float) -> str:
    for scale, unit in ((86400, "days"), (3600, "hours"), (60, "minutes")):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s"


def estimate_rows(est: StepEstimate | None, gpu: str, why_none: str = "") -> list[tuple[str, str]]:
    """Rows for the plan table: FLOPs per step, step time and time to train, or why there is none
    (`why_none`, for no estimate: the reason, by default CPU-only nodes)."""
    if est is None:
        return [("step time (estimate)", f"not estimated: {why_none or 'CPU-only nodes'}")]
    rows = [("FLOPs per step", f"{est.step_flops:.3g} (6 N + attention per token x global batch x seq_len)")]
    if not est.peak_flops:
        return rows + [
            (
                "step time (estimate)",
                f"not estimated: no peak FLOP/s known for GPU {gpu or '(not given)'}; pass --gpu "
                "(h100, h200, a100, mi250x, ...) or set metrics.peak_flops",
            )
        ]
    assumed = (
        f"assuming {est.mfu:.0%} MFU of {est.peak_flops / 1e12:.0f} TFLOP/s bf16 peak per GPU "
        "(--mfu to change; a run logs its measured MFU)"
    )
    if est.bubble:
        assumed += f", + {est.bubble:.1%} for the pipeline bubble"
    return rows + [
        ("step time (estimate)", f"{est.seconds:.1f} s, {assumed}"),
        (
            "time to train (estimate)",
            f"{human_duration(est.seconds * est.max_steps)} for train.max_steps={est.max_steps}",
        ),
    ]
