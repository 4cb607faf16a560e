"""`parallelize`: build the model for this rank's place in the mesh, and run its steps.

Order of application (as torchtitan): meta-device model -> pipeline split -> TP -> AC -> compile -> FSDP
-> allocate -> init. Weights are initialised after sharding by `Transformer.init_weights`, which draws
every parameter as a full tensor from a per-name generator and keeps this rank's shard, so every layout
starts from the weights of the one-process run, and no rank ever holds the whole model.

Gradient scaling: each micro batch's loss is a mean over its tokens; accumulation divides by the number
of micro batches (the pipeline schedule by its microbatch count), and FSDP averages over the data-parallel
(and context-parallel) ranks. The result is the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend

from relaytrain.config.schema import ModelConfig, ParallelConfig, TrainConfig
from relaytrain.job.progress import ProgressBoard
from relaytrain.model.transformer import Transformer
from relaytrain.parallel.activation import apply_ac, apply_compile
from relaytrain.parallel.dims import ParallelDims
from relaytrain.parallel.fsdp import apply_fsdp, param_dtype
from relaytrain.parallel.layout import batch_split_note, validate_layout
from relaytrain.parallel.mesh import build_mesh, fsdp_mesh, submesh
from relaytrain.parallel.work import own_work_modules

log = logging.getLogger(__name__)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A detached fp32 plain tensor (loss parallel returns the loss as a replicated DTensor)."""
    value = value.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.float()


# The SDPA kernels context parallel supports (as torchtitan pins them); the math kernel is left out.
CP_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
]


class ParallelModel:
    """This rank's model parts and the step functions that respect the layout."""

    def __init__(
        self,
        parallel: ParallelConfig,
        dims: ParallelDims,
        mesh: DeviceMesh | None,
        device: torch.device,
        model_parts: list[nn.Module],
        stage_ids: list[int],
    ):
        self.dims, self.mesh, self.device = dims, mesh, device
        self.model_parts = model_parts
        self.stage_ids = stage_ids
        self.n_stages = dims.pp * parallel.pp_virtual_stages
        self.dp_rank = submesh(mesh, "dp").get_local_rank() if mesh is not None else 0
        self.dp_size = dims.dp
        self.use_loss_parallel = dims.tp > 1 and parallel.loss_parallel
        self._autocast_dtype = None
        if mesh is None and param_dtype(parallel, device.type) != torch.float32:
            # No FSDP to cast parameters: mixed precision through autocast instead.
            self._autocast_dtype = param_dtype(parallel, device.type)
        self.schedule = self._build_schedule(parallel) if dims.pp > 1 else None
        self.compiled = parallel.compile

    # -- helpers ------------------------------------------------------------------------------------

    def _build_schedule(self, parallel: ParallelConfig):
        """The pipeline schedule over this rank's stages (the step simulation declares their shapes
        instead: relaytrain.parallel.sim_pipeline.DeclaredStagesModel)."""
        from relaytrain.parallel.pipeline import build_schedule  # see the split below

        return build_schedule(
            parallel.pp_schedule,
            self.model_parts,
            self.stage_ids,
            self.n_stages,
            self.device,
            self.mesh["pp"].get_group(),
            self.dims.grad_accum,
            self._loss_fn,
        )

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets)

    @contextlib.contextmanager
    def _step_context(self, buffers: list[torch.Tensor]) -> Iterator[None]:
        """Loss parallel and context parallel around a forward and its backward (autocast: `_autocast`)."""
        with contextlib.ExitStack() as stack:
            if self.use_loss_parallel:
                stack.enter_context(loss_parallel())
            if self.dims.cp > 1:
                from torch.distributed.tensor.experimental import context_parallel
                from torch.nn.attention import sdpa_kernel

                # The head-tail permuted sequence is only attended correctly by the kernels context
                # parallel dispatches (a math-kernel fallback would apply a plain causal mask): pin them.
                stack.enter_context(sdpa_kernel(CP_SDPA_BACKENDS))

                ropes = [t for part in self.model_parts for t in (part.rope_cos, part.rope_sin)]
                stack.enter_context(
                    context_parallel(
                        self.mesh["cp"],
                        buffers=buffers + ropes,
                        buffer_seq_dims=[1] * len(buffers) + [0] * len(ropes),
                        no_restore_buffers=set(buffers),
                    )
                )
            yield

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision without FSDP (one device): around the forward and the loss only, as PyTorch
        recommends; the backward runs in the dtypes autocast chose for the forward's ops."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _group(self, dim: str) -> dist.ProcessGroup:
        return submesh(self.mesh, dim).get_group()

    def _finish_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Local mean loss as every rank of a TP/PP/CP group should report it."""
        loss = _plain(loss).reshape(())
        if self.dims.pp > 1:
            pp_group = self._group("pp")
            dist.broadcast(loss, group=pp_group, group_src=self.dims.pp - 1)
        if self.dims.cp > 1:
            dist.all_reduce(loss, group=self._group("cp"))
            loss = loss / self.dims.cp
        return loss

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Between micro batches only the HSDP all-reduce across replica groups waits for the last one.

        The reduce-scatter runs after every micro batch: skipping it (set_requires_gradient_sync) would
        keep every layer's unsharded gradient until the last micro batch, the whole model's gradients
        per rank instead of a shard (the step simulation showed 32 GiB more for 8B on 4 x 8).
        """
        for part in self.model_parts:
            if isinstance(part, FSDPModule):
                part.set_requires_all_reduce(enabled)

    # -- the trainer's API --------------------------------------------------------------------------

    def work_modules(self) -> list[nn.Module]:
        """The modules whose forward is this rank's own computation, no collective inside
        (``work.own_work_modules``): the straggler watch times them."""
        return own_work_modules(self.model_parts, self.dims, self.compiled)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward + backward over this rank's local batch; returns its mean loss (detached fp32)."""
        if self.schedule is not None:
            return self._train_step_pipeline(inputs, targets)
        (model,) = self.model_parts
        mbs = self.dims.micro_batch_size
        n_micro = max(1, inputs.shape[0] // mbs)
        total = torch.zeros((), device=self.device)
        for i in range(n_micro):
            x = inputs[i * mbs : (i + 1) * mbs].contiguous()
            y = targets[i * mbs : (i + 1) * mbs].contiguous()
            self._set_gradient_sync(i == n_micro - 1)
            with self._step_context([x, y]):
                with self._autocast():
                    loss = cross_entropy(model(x), y)
                (loss / n_micro).backward()
            total += _plain(loss)
        return self._finish_loss(total / n_micro)

    def _train_step_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        first, last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        losses: list[torch.Tensor] = []
        inputs, targets = inputs.contiguous(), targets.contiguous()
        with self._step_context([inputs, targets]):
            args = (inputs,) if first else ()
            self.schedule.step(*args, target=targets if last else None, losses=losses, return_outputs=False)
        local = torch.stack([_plain(x) for x in losses]).mean() if last else torch.zeros(())
        return self._finish_loss(local.to(self.device))

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over this rank's batch without gradients (any batch size)."""
        inputs, targets = inputs.contiguous(), targets.contiguous()
        with self._step_context([inputs, targets]), self._autocast():
            if self.schedule is None:
                loss = cross_entropy(self.model_parts[0](inputs), targets)
            else:
                loss = self._eval_pipeline(inputs, targets)
        return self._finish_loss(loss)

    def _eval_pipeline(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One pass through the stages with point-to-point sends: no schedule, so any batch size works."""
        # on the pipeline group (stage sid runs on its pp rank sid % pp): a send on the default group
        # would make NCCL build another communicator, with the default group's timeout
        pp_group = self._group("pp")
        pp = self.dims.pp
        # Between stages the residual stream is a local tensor, sequence-sharded under TP.
        hidden_shape = (inputs.shape[0], inputs.shape[1] // self.dims.tp, self.model_parts[0].cfg.dim)
        h: torch.Tensor | None = None
        loss = torch.zeros((), device=self.device)
        for sid in range(self.n_stages):
            if sid not in self.stage_ids:
                continue
            part = self.model_parts[self.stage_ids.index(sid)]
            if sid == 0:
                h = inputs
            elif (sid - 1) % pp != sid % pp:
                h = torch.empty(hidden_shape, device=self.device)
                dist.recv(h, group=pp_group, group_src=(sid - 1) % pp)
            out = part(h)
            if sid == self.n_stages - 1:
                loss = cross_entropy(out, targets)
            elif (sid + 1) % pp != sid % pp:
                dist.send(out.float().contiguous(), group=pp_group, group_dst=(sid + 1) % pp)
            else:
                h = out
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Total gradient 2-norm over every parameter of the model (all mesh dims); clip if max_norm > 0."""
        params, seen = [], set()
        for part in self.model_parts:
            for p in part.parameters():
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        groups: dict[object, list[torch.Tensor]] = {}
        for p in params:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(g)
        sq = torch.zeros((), device=self.device)
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()  # sums the shards' partial norms over the mesh
            sq += norm.float().pow(2).to(self.device)
        if self.dims.pp > 1:
            dist.all_reduce(sq, group=self._group("pp"))
        total = sq.sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def reduce_mean(
        self, value: torch.Tensor, board: ProgressBoard | None = None, name: str = "mean"
    ) -> float:
        """Average a per-rank scalar over the data-parallel ranks (TP/PP/CP peers already agree); the
        all-reduce is published on `board` as collective `name`."""
        if self.mesh is None or self.dims.dp == 1:
            return float(value)
        t = value.detach().float().reshape(()).to(self.device).clone()
        with board.collective(name) if board is not None else contextlib.nullcontext():
            dist.all_reduce(t, group=self._group("dp"))
            return float(t) / self.dims.dp


def parallelize(
    parallel: ParallelConfig,
    model: ModelConfig,
    train: TrainConfig,
    device: torch.device,
    world_size: int,
    rank: int,
    gpus_per_node: int,
    *,
    seed: int,
) -> ParallelModel:
    """Validate the layout, build the mesh and this rank's sharded, initialised model parts.

    `train`: the batch the layout splits, and seq_len; `seed` (run.seed) draws the initial weights.
    """
    sharded = shard_on_meta(parallel, model, train, device, world_size, rank, gpus_per_node)
    return materialize(sharded, parallel, train, device, seed=seed)


@dataclasses.dataclass
class ShardedOnMeta:
    """This rank's model parts, split, TP/AC/compile/FSDP applied, still on the meta device."""

    dims: ParallelDims
    mesh: DeviceMesh | None
    stage_ids: list[int]
    parts: list[nn.Module]


def shard_on_meta(
    parallel: ParallelConfig,
    model: ModelConfig,
    train: TrainConfig,
    device: torch.device,
    world_size: int,
    rank: int,
    gpus_per_node: int,
) -> ShardedOnMeta:
    """The first half of `parallelize`: layout, mesh, pipeline split, TP -> AC -> compile -> FSDP.

    Nothing is allocated yet, so the simulation (relaytrain.parallel.simulate) runs this outside
    FakeTensorMode (the mesh's coordinate code needs real tensors) and `allocate` inside it.
    """
    dims = validate_layout(parallel, model, train, world_size, gpus_per_node, device.type)
    note = batch_split_note(train, dims)
    if note and rank == 0:
        log.info("%s", note)
    mesh = build_mesh(dims, device.type) if world_size > 1 else None
    with torch.device("meta"):
        whole = Transformer(model)
    if dims.pp > 1:
        # Imported only for a pipeline: torch.distributed.pipelining brings torch.export, about 0.9 CPU
        # seconds of every process's start-up (and of every restart's) where no pipeline runs.
        from relaytrain.parallel.pipeline import split_stage, stage_ids_of

        n_stages = dims.pp * parallel.pp_virtual_stages
        stage_ids = stage_ids_of(mesh["pp"].get_local_rank(), dims.pp, parallel.pp_virtual_stages)
        parts = [split_stage(whole, sid, n_stages) for sid in stage_ids]
    else:
        stage_ids, parts = [0], [whole]
    for part in parts:
        if dims.tp > 1:
            from relaytrain.parallel.tensor_parallel import apply_tp

            apply_tp(part, mesh["tp"], loss_parallel=parallel.loss_parallel)
        apply_ac(part, parallel.activation_checkpointing)
        if parallel.compile:
            apply_compile(part)
        if mesh is not None:
            apply_fsdp(part, fsdp_mesh(mesh, dims), parallel, device.type, pp_enabled=dims.pp > 1)
    return ShardedOnMeta(dims, mesh, stage_ids, parts)


def materialize(
    sharded: ShardedOnMeta, parallel: ParallelConfig, train: TrainConfig, device: torch.device, *, seed: int
) -> ParallelModel:
    """The second half of `parallelize`: allocate this rank's shards, initialise them, build the step."""
    allocate(sharded, parallel, train, device, seed=seed)
    return ParallelModel(parallel, sharded.dims, sharded.mesh, device, sharded.parts, sharded.stage_ids)


def allocate(
    sharded: ShardedOnMeta, parallel: ParallelConfig, train: TrainConfig, device: torch.device, *, seed: int
) -> None:
    """Allocate this rank's shards of the parts and initialise them (the step is built by the caller)."""
    init_device = torch.device("cpu") if parallel.cpu_offload else device
    for part in sharded.parts:
        part.to_empty(device=init_device)
        if part.cfg.tie_embeddings and part.tok_embeddings is not None and part.output is not None:
            # to_empty swaps in a new tensor per module: without FSDP (which keeps one sharded
            # parameter for both) the tie would be lost (found by the step simulation of 1B on 1 GPU).
            part.output.weight = part.tok_embeddings.weight
        part.init_weights(seed, buffer_device=device)
        if sharded.dims.cp > 1:
            # Context parallel shards the RoPE tables with the sequence: they must be exactly seq_len long.
            part.rope_cos = part.rope_cos[: train.seq_len].clone()
            part.rope_sin = part.rope_sin[: train.seq_len].clone()
        part.train()
