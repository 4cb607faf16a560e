"""torchrun worker: train a tiny model for a few steps under many layouts, print one JSON line per case.

Run as `torchrun --standalone --nproc_per_node=N tests/parallel_cases.py CASE [CASE ...]` (gloo, CPU);
`tests/test_parallel_parity.py` launches it and compares against the one-process reference computed by
`run_case(..., world_size=1)` in the test process itself.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from relaytrain.config.schema import Config
from relaytrain.model.transformer import Transformer
from relaytrain.parallel import parallelize
from relaytrain.parallel.mesh import submesh
from relaytrain.parallel.parallel_model import cross_entropy
from relaytrain.parallel.sim_comm import CollectiveCounter

STEPS = int(os.environ.get("PARALLEL_CASES_STEPS", "3"))  # bench/parallel_layouts.py runs more

# name -> ([parallel] overrides, [train] overrides). Same model and data for all; only the layout changes.
CASES: dict[str, tuple[dict, dict]] = {
    "single": ({}, {}),
    "ac_full": ({"activation_checkpointing": "full"}, {}),
    "ac_selective": ({"activation_checkpointing": "selective"}, {}),
    "autocast_bf16": ({"param_dtype": "bfloat16"}, {}),
    "fsdp": ({}, {}),
    "fsdp_reshard_never": ({"reshard_after_forward": "never"}, {"micro_batch_size": 1}),
    "fsdp_cpu_offload": ({"cpu_offload": True}, {}),
    "fsdp_ac_full": ({"activation_checkpointing": "full"}, {}),
    "fsdp_ac_selective": ({"activation_checkpointing": "selective"}, {}),
    "fsdp_compile": ({"compile": True}, {}),
    "fsdp_bf16": ({"param_dtype": "bfloat16"}, {}),
    "hsdp_2x1": ({"dp_replicate": 2, "dp_shard": 1}, {}),
    "tp": ({"tp": 2}, {}),
    "tp_no_loss_parallel": ({"tp": 2, "loss_parallel": False}, {}),
    "tp_ac_selective": ({"tp": 2, "activation_checkpointing": "selective"}, {}),
    "pp_gpipe": ({"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}, {}),
    "pp_1f1b": ({"pp": 2, "pp_schedule": "1f1b"}, {}),
    "pp_interleaved": (
        {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "pp_microbatches": 4},
        {},
    ),
    "hsdp_2x2": ({"dp_replicate": 2}, {}),
    "fsdp_tp": ({"tp": 2}, {}),
    "pp_fsdp_pp_outer_order": ({"pp": 2, "rank_order": "tp,cp,dp,pp"}, {}),
    "pp_fsdp": ({"pp": 2, "pp_schedule": "1f1b"}, {}),
    "pp_tp": ({"pp": 2, "tp": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}, {}),
    "pp_tp_interleaved": (
        {"pp": 2, "tp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "pp_microbatches": 4},
        {},
    ),
}


# Layouts run at each process count: the parity tests and bench/parallel_layouts.py both read this list.
# fsdp_compile is opt-in in the benchmark (inductor's cold compile dominates its time); pp_fsdp and
# pp_tp are benchmark-only (the parity test covers their schedules in pp_1f1b and pp_tp_interleaved).
LAYOUTS: dict[int, list[str]] = {
    1: ["single", "ac_full", "ac_selective", "autocast_bf16"],
    2: [
        "fsdp",
        "fsdp_reshard_never",
        "fsdp_cpu_offload",
        "fsdp_ac_full",
        "fsdp_ac_selective",
        "fsdp_bf16",
        "fsdp_compile",
        "hsdp_2x1",
        "tp",
        "tp_no_loss_parallel",
        "tp_ac_selective",
        "pp_gpipe",
        "pp_1f1b",
        "pp_interleaved",
    ],
    4: ["hsdp_2x2", "fsdp_tp", "pp_fsdp_pp_outer_order", "pp_fsdp", "pp_tp", "pp_tp_interleaved"],
}
BENCH_ONLY = {"pp_fsdp", "pp_tp"}
BENCH_OPT_IN = {"fsdp_compile"}


def tiny_config(parallel: dict, train: dict) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size, m.max_seq_len = 64, 4, 4, 2, 256, 64
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = 32, 8, 2
    cfg.run.seed = 7
    cfg.run.device = "cpu"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def batches(cfg: Config) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(
        0,
        cfg.model.vocab_size,
        (STEPS + 1, cfg.train.global_batch_size, cfg.train.seq_len + 1),
        generator=gen,
    )


def run_case(name: str, world_size: int, rank: int, gpus_per_node: int) -> dict:
    cfg = tiny_config(*CASES[name])
    started = time.perf_counter()
    pm = parallelize(
        cfg.parallel,
        cfg.model,
        cfg.train,
        torch.device("cpu"),
        world_size,
        rank,
        gpus_per_node,
        seed=cfg.run.seed,
    )
    params = [p for part in pm.model_parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    data = batches(cfg)
    local = cfg.train.global_batch_size // pm.dp_size
    rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
    losses, norms, step_times = [], [], []
    for step in range(STEPS):
        t0 = time.perf_counter()
        tokens = data[step, rows]
        loss = pm.train_step(tokens[:, :-1], tokens[:, 1:])
        norms.append(float(pm.clip_grad_norm_(1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(pm.reduce_mean(loss))
        step_times.append(time.perf_counter() - t0)
    eval_tokens = data[STEPS, rows]
    # Which groups a pipeline's evaluation sends on; a dispatch mode cannot run compiled blocks
    # (fullgraph=True refuses it), and only a pipeline sends anything.
    counting = CollectiveCounter() if pm.dims.pp > 1 else contextlib.nullcontext(None)
    with counting as counter:
        local_eval = pm.eval_loss(eval_tokens[:, :-1], eval_tokens[:, 1:])
    eval_loss = pm.reduce_mean(local_eval)
    names = {dist.group.WORLD.group_name: "default"} if dist.is_initialized() else {}
    if pm.dims.pp > 1:
        names[submesh(pm.mesh, "pp").get_group().group_name] = "pp"
    calls = counter.calls if counter is not None else {}
    p2p = {names.get(group, group) for (op, group, *_) in calls if op in ("send", "recv")}
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    steady = statistics.median(step_times[1:]) if len(step_times) > 1 else step_times[0]
    return {
        "case": name,
        "losses": losses,
        "grad_norms": norms,
        "eval_loss": eval_loss,
        "eval_p2p_groups": sorted(p2p),
        "master_dtypes": sorted({str(p.dtype) for p in params}),
        "total_s": time.perf_counter() - started,
        "steady_step_s": steady,
        "tokens_per_s": tokens_per_step / steady,
    }


def mixed_precision_reference(scheme: str) -> dict:
    """Textbook bf16 training in one process, written without relaytrain's step code.

    bf16 rounds differently on every CPU instruction set (AVX2, AVX-512, AVX-512-BF16/AMX), so a bf16
    layout is compared with this reference computed on the same CPU, not with the fp32 run.
    scheme "autocast": fp32 parameters, forward under torch.autocast (the one-process path).
    scheme "cast_params": what FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) does: a
    bf16 copy of the fp32 master weights computes forward and backward, each micro batch's gradient is
    accumulated in fp32 onto the master weights, the blocks' inputs are cast to bf16, and AdamW updates
    the fp32 masters.
    """
    cfg = tiny_config({}, {})
    with torch.device("meta"):
        master = Transformer(cfg.model)
    master.to_empty(device="cpu")
    master.init_weights(cfg.run.seed, buffer_device=torch.device("cpu"))
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    compute = master
    if scheme == "cast_params":
        # The RoPE tables are cast too: FSDP casts each block's floating-point inputs, and the
        # tables are passed to every block.
        compute = copy.deepcopy(master).to(torch.bfloat16)
    data = batches(cfg)
    mbs = cfg.train.micro_batch_size
    n_micro = cfg.train.global_batch_size // mbs

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if scheme == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return cross_entropy(compute(inputs), targets)
        return cross_entropy(compute(inputs), targets)

    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for i in range(n_micro):
            loss = loss_of(data[step, i * mbs : (i + 1) * mbs])
            (loss / n_micro).backward()
            total += float(loss.detach())
            if compute is not master:
                for m, c in zip(master.parameters(), compute.parameters(), strict=True):
                    m.grad = c.grad.float() if m.grad is None else m.grad + c.grad.float()
                    c.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0, foreach=True)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not master:
            with torch.no_grad():
                for m, c in zip(master.parameters(), compute.parameters(), strict=True):
                    c.copy_(m)
        losses.append(total / n_micro)
    with torch.no_grad():
        eval_loss = float(loss_of(data[STEPS]))
    return {
        "case": f"reference_{scheme}",
        "losses": losses,
        "grad_norms": norms,
        "eval_loss": eval_loss,
        "master_dtypes": sorted({str(p.dtype) for p in master.parameters()}),
    }


def main() -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = os.environ.get("PARALLEL_CASES_COMPILE_BACKEND")
    if backend:
        # Inductor's C++ compile takes minutes on 2 shared cores; a lighter backend still runs Dynamo
        # and AOTAutograd over the per-block forward with the FSDP hooks around it.
        torch.compile = functools.partial(torch.compile, backend=backend)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    for name in sys.argv[1:]:
        result = run_case(name, world, rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
