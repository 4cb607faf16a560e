"""What a pipeline stage holds beyond states: its gathered weights, gradients, activations in flight.

Checked against the fake-tensor step of the real build (`relaytrain plan --simulate`,
docs/benchmarks.md "Simulated at scale"). With h = model.dim, t = tp, c = cp, n = pp_microbatches,
v = pp_virtual_stages, a microbatch of mb sequences of s tokens:

* gathered layers: FSDP does not reshard a pipeline stage after forward (parallel.reshard_after_forward
  'default'), and torch's PipelineStage holds FSDP's gradient reduction and resharding until the last
  microbatch's backward: every weight of the stage stays gathered in bf16 (2 bytes) and every gradient
  unsharded in `parallel.reduce_dtype` for the whole step, (2 + 4) P_stage / t with fp32 reduction.
* activations in flight: torch's 1F1B runs pp forwards on the first stage before its first backward
  (one on the last); the interleaved schedule (v stages of L / (pp v) layers per rank) runs
  (v - 1) pp + 2 (pp - 1 - rank) warm-up forwards, then a forward before each backward; GPipe all n.
  The first stage's figure and the last one's (which adds the loss) are both counted; the larger
  stands, since a GPU must fit either. The last stage keeps its output, the bf16 logits, for the stage's
  backward, and that backward adds their bf16 gradients beside the loss's fp32 ones: 6 V / t bytes per
  token more than the loss (measured by the simulation inside the output projection at its peak).
* receive buffers: the schedule allocates, once per microbatch and for the whole step, a buffer for
  every activation a stage receives and every gradient it receives back: n x mb s h / (t c) x 2 bytes
  per direction, up to 2v directions per rank (2v - 1 with pp = 2, where each rank holds an end stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from relaytrain.config import Config
from relaytrain.plan.activation_memory import vocab_split

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class StageMemory:
    gathered: float  # bf16 weights and unsharded gradients of the stage
    first: float  # the first stage's activations in flight (the loss excluded)
    last: float  # the last stage's activations in flight and its kept logits (the loss excluded)
    buffers: float  # receive buffers


def microbatches_in_flight(schedule: str, pp: int, virtual: int, n: int, rank: int) -> float:
    """Microbatches whose activations a pipeline rank holds at its first steady backward (in stages of
    L / pp layers: an interleaved chunk is 1 / v of one)."""
    if schedule == "gpipe":
        return n
    if schedule == "interleaved_1f1b":
        warmup = (virtual - 1) * pp + 2 * (pp - 1 - rank)
        return min(warmup + 1, n * virtual) / virtual
    return min(pp - rank, n)


def stage_memory(cfg: Config, dims, per_layer: float, stage_params: float) -> StageMemory:
    """Pipeline terms for one activation checkpointing mode (`per_layer`: bytes a layer keeps per
    microbatch); `stage_params`: parameters of the largest stage, before TP."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    n = dims.grad_accum  # the layout's pipeline micro batches (relaytrain.parallel.layout.pp_microbatches)
    layers = -(-m.n_layers // dims.pp)
    fsdp = dims.dp_shard * dims.cp > 1 or p.cpu_offload
    grad_bytes = DTYPE_BYTES.get(p.reduce_dtype, 4)
    gathered = (2 + grad_bytes) * stage_params / dims.tp if fsdp else 0.0
    first = microbatches_in_flight(p.pp_schedule, dims.pp, p.pp_virtual_stages, n, 0) * layers * per_layer
    last = microbatches_in_flight(p.pp_schedule, dims.pp, p.pp_virtual_stages, n, dims.pp - 1)
    hidden = dims.micro_batch_size * t.seq_len * m.dim * 2 / (dims.tp * dims.cp)
    directions = 2 * p.pp_virtual_stages - (1 if dims.pp == 2 else 0)
    kept_logits = 6.0 * dims.micro_batch_size * t.seq_len * m.vocab_size / vocab_split(cfg, dims.tp)
    return StageMemory(gathered, first, last * layers * per_layer + kept_logits, n * hidden * directions)
