"""`relaytrain plan`'s step-time and time-to-train estimates, labelled as estimates.

FLOPs per step are exact for the model (relaytrain.model.flops: 6 N + attention per token, times
train.global_batch_size x train.seq_len tokens); the time is those FLOPs over the GPUs' peak bf16 FLOP/s
(relaytrain.monitor.mfu's table, or metrics.peak_flops) at an assumed MFU, which only a run can measure
(it logs its own MFU). Recomputation by activation checkpointing is not counted, as for MFU.
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

    @property
    def seconds(self) -> float:
        """Estimated seconds per optimizer step; 0.0 when the GPU's peak is unknown."""
        return self.step_flops / (self.gpus * self.peak_flops * self.mfu) if self.peak_flops else 0.0


def estimate_step(cfg: Config, gpus: int, gpu: str, mfu: float = DEFAULT_MFU) -> StepEstimate:
    from relaytrain.monitor.mfu import lookup_gpu_peak_flops

    t = cfg.train
    return StepEstimate(
        step_flops=flops_per_token(cfg.model, t.seq_len) * t.global_batch_size * t.seq_len,
        peak_flops=cfg.metrics.peak_flops or (lookup_gpu_peak_flops(gpu) if gpu else 0.0),
        gpus=gpus,
        mfu=mfu,
        max_steps=t.max_steps,
    )


def human_duration(seconds: float) -> str:
    for scale, unit in ((86400, "days"), (3600, "hours"), (60, "minutes")):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s"


def estimate_rows(est: StepEstimate | None, gpu: str) -> list[tuple[str, str]]:
    """Rows for the plan table: FLOPs per step, step time and time to train, or why there is none."""
    if est is None:
        return [("step time (estimate)", "not estimated on CPU-only nodes")]
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
    return rows + [
        ("step time (estimate)", f"{est.seconds:.1f} s, {assumed}"),
        (
            "time to train (estimate)",
            f"{human_duration(est.seconds * est.max_steps)} for train.max_steps={est.max_steps}",
        ),
    ]
