"""What one GPU holds in a training step, estimated from the config and layout (`relaytrain plan`).

Per-GPU memory (bytes; P parameters, s = train.seq_len, b = train.micro_batch_size, h = model.dim,
f = FFN width, L layers, a heads, k KV heads, V vocabulary, model-parallel degree m = tp * pp,
sharding degree z = dp_shard * cp):

* weights, gradients and AdamW: FSDP keeps fp32 master weights (4P), fp32 gradients (4P) and the two
  AdamW moments (8P), each split over m and z: 16 P / (m z); a pipeline's gradients are unsharded
  until the step's last backward (see below), 12 P / (m z) at its peak.
* gathered layers: at the step's peak (the start of backward, when every activation and the loss's
  gradients are held) FSDP holds one transformer block gathered in bf16, the last one, which it keeps
  gathered from forward into backward: 2 B / tp bytes (B the parameters of one block); with
  `parallel.reshard_after_forward = "never"` every layer stays gathered, 2 P / tp. (`plan --simulate`
  measures it.) A single
  process has no FSDP: autocast's bf16 copies of all weights, 2P, which the matmuls keep for backward.
* the other moment that can hold the most, inside a layer's backward (once the loss's buffers are gone,
  with the layer recomputed: all of it under full checkpointing, what selective checkpointing did not
  keep): FSDP then holds the root group (embedding, output projection, final norm: 2 R / tp, gathered
  again when the logits' gradient arrives, until the end of backward), the layer's block (2 B / tp), the
  next block it prefetches (2 B / tp) and the previous block's reduce-scatter input in
  `parallel.reduce_dtype` (4 B / tp); R the parameters of the root. plan takes the moment
  that holds more; the extra gathered bytes count as gathered layers (`MemoryEstimate.gathered`).
* activations and the loss: what the model keeps for backward per layer and micro batch, by activation
  checkpointing mode, and cross entropy's fp32 log-softmax and gradients (relaytrain.plan.activation_memory,
  measured by `--simulate`). Under full checkpointing the layer being recomputed in backward holds its
  activations once the loss's gradients are gone: the larger of the two counts. A pipeline holds more
  (relaytrain.plan.pipeline_memory): a stage's weights stay gathered and its gradients unsharded for the
  step, several micro-batches are in flight, and the schedule keeps a receive buffer per micro-batch.
* overhead: 3 GiB (CUDA context, NCCL buffers) plus 10% for allocator fragmentation.

With `parallel.cpu_offload` (FSDP2 CPUOffloadPolicy, ZeRO-3 offload) the sharded weights, gradients and
AdamW state live in host memory: the GPU holds only the working copies (always, since every layer is
copied in), activations and logits. Host memory per node is then 16 P / (m z) x 1.10 plus 4 GiB per
process (interpreter, torch, CUDA host side, data loader), for each process on the node, checked
against `slurm.mem` (`--mem`), else the node's memory as `sinfo` reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relaytrain.config import Config
from relaytrain.model import count_parameters
from relaytrain.plan.activation_memory import (
    activation_bytes_per_layer,
    loss_bytes,
    loss_parallel_extra_bytes,
)
from relaytrain.plan.pipeline_memory import DTYPE_BYTES, stage_memory

GIB = 1024**3
GB = 1e9
OVERHEAD_BYTES = 3 * GIB
FRAGMENTATION = 1.10
HOST_OVERHEAD_PER_PROCESS = 4 * GIB

# Memory per device in GB as the vendor sells it (one GCD for MI250X, as Slurm and torch count them).
GPU_MEMORY_GB = {
    "h100": 80,
    "h100-80gb": 80,
    "h100-94gb": 94,
    "h200": 141,
    "gh200": 96,
    "b200": 180,
    "a100": 80,
    "a100-80gb": 80,
    "a100-40gb": 40,
    "l40s": 48,
    "a10g": 24,
    "v100": 32,
    "mi250x": 64,
    "mi250": 64,
    "mi300x": 192,
    "mi300a": 128,
}


@dataclass
class MemoryEstimate:
    states: float  # weights + gradients + optimizer, sharded
    working: float  # gathered bf16 units and their gradients
    activations: dict[str, float]  # by activation_checkpointing mode
    logits: float
    offloaded: bool = False  # states live in host memory (parallel.cpu_offload)
    state_parts: dict[str, float] | None = None  # `states` as parameters, gradients, optimizer state
    gathered_extra: dict[str, float] = field(default_factory=dict)  # by mode, at an in-layer peak

    def gathered(self, mode: str) -> float:
        """Gathered layers at the peak of `mode`: `working`, more when a layer's backward holds the most."""
        return self.working + self.gathered_extra.get(mode, 0.0)

    def total(self, mode: str) -> float:
        """Bytes per GPU."""
        on_gpu = 0.0 if self.offloaded else self.states
        raw = on_gpu + self.gathered(mode) + self.activations[mode] + self.logits
        return raw * FRAGMENTATION + OVERHEAD_BYTES

    def host_per_process(self) -> float:
        """Host bytes per process: offloaded states plus the process's own share."""
        return (self.states if self.offloaded else 0.0) * FRAGMENTATION + HOST_OVERHEAD_PER_PROCESS


def estimate_memory(cfg: Config, dims) -> MemoryEstimate:
    from relaytrain.parallel.fsdp import reshard_after_forward  # torch: only once a config is valid

    m, p = cfg.model, cfg.parallel
    params = count_parameters(m)
    model_parallel = dims.tp * dims.pp
    shard = dims.dp_shard * dims.cp
    # A pipeline's gradients stay unsharded until the step's last backward (stage_memory): at the peak
    # the states are the weights and AdamW's moments, 12 P / (m z).
    per_param = params / (model_parallel * shard)
    grads = 0 if dims.pp > 1 and not p.cpu_offload else 4
    parts = {"parameters": 4 * per_param, "gradients": grads * per_param, "optimizer state": 8 * per_param}
    states = sum(parts.values())
    root = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim  # embedding, output, final norm
    layer = (params - root) / max(m.n_layers, 1)  # one transformer block, without a share of the root
    offloaded = p.cpu_offload
    working = 2 * layer / dims.tp if shard > 1 or offloaded else 0.0
    if working and not reshard_after_forward(p, dims.pp > 1):
        # reshard_after_forward="never": every layer stays gathered from its forward into its backward.
        working = 2 * params / dims.tp
    if dims.world_size == 1 and p.param_dtype != "float32":
        # One process, no FSDP: autocast's bf16 copy of every weight, kept by the matmuls for backward.
        working = 2 * params
    micro = getattr(dims, "micro_batch_size", 0) or cfg.train.micro_batch_size
    per_layer = activation_bytes_per_layer(cfg, dims.tp, dims.cp, micro)
    layers_per_stage = -(-m.n_layers // dims.pp)
    in_flight = dims.pp if p.pp_schedule != "gpipe" else (p.pp_microbatches or dims.pp)
    logits = loss_bytes(cfg, dims.tp, micro)
    if dims.pp == 1:  # a pipeline's last stage counts its kept logits itself (stage_memory)
        logits += loss_parallel_extra_bytes(cfg, dims.tp, micro)
    in_layer = _in_layer_gathered(cfg, dims, root, layer, working) if dims.pp == 1 else working
    activations, extra = {}, {}
    for mode, value in per_layer.items():
        recompute = per_layer["none"] if mode == "full" else 0.0  # the layer recomputed in backward
        held = value * layers_per_stage * in_flight
        if dims.pp > 1:  # the first stage and the last (which adds the loss): the larger
            stage = stage_memory(cfg, dims, value, layer * layers_per_stage + m.vocab_size * m.dim)
            held = max(stage.first + recompute - logits, stage.last + max(0.0, recompute - logits))
            held, working = held + stage.buffers, stage.gathered
        else:  # the start of backward (the loss) or a layer's backward (its recomputation): the larger
            redo = {"none": 0.0, "selective": per_layer["none"] - value}.get(mode, recompute)
            if in_layer + redo > working + logits:
                held, extra[mode] = held + redo - logits, in_layer - working
        activations[mode] = held
    return MemoryEstimate(
        states=states,
        working=working,
        activations=activations,
        logits=logits,
        offloaded=offloaded,
        state_parts=parts,
        gathered_extra=extra,
    )


def _in_layer_gathered(cfg: Config, dims, root: float, block: float, working: float) -> float:
    """What FSDP holds gathered inside a layer's backward (module doc); `working` without per-block FSDP."""
    from relaytrain.parallel.fsdp import reshard_after_forward

    p = cfg.parallel
    if not working or dims.world_size == 1:
        return working
    reduce_scatter = DTYPE_BYTES.get(p.reduce_dtype, 4) * block / dims.tp
    if not reshard_after_forward(p, False):  # every layer stays gathered: no prefetch to add
        return working + reduce_scatter
    return (2 * root + 4 * block) / dims.tp + reduce_scatter


def gpu_memory_bytes(gpu: str) -> float | None:
    key = gpu.strip().lower()
    return GPU_MEMORY_GB[key] * GB if key in GPU_MEMORY_GB else None
