"""A Megatron-core GPT with tensor parallelism, preemption-safe (docs/programs.md).

    relaytrain launch --command "python examples/megatron_gpt.py --out \\$RELAYTRAIN_RUN_DIR/out" \\
        --name gpt --nodes 2 --tasks-per-node 1 --signal USR2@180

One process per accelerator: started by srun (``relaytrain launch --command`` gives every task RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) or by torchrun, which sets the same variables.
The world is split into tensor-parallel groups of ``--tp`` ranks and data-parallel replicas of them.

On an agreed stop every rank saves: the model's sharded state dict with ``dist_checkpointing`` (one
checkpoint, readable by another tensor-parallel layout) and its own optimizer state (per rank, so a
resume uses the same layout), then the job is requeued; the next job loads both from the latest
checkpoint. The model is built from a ``TransformerConfig`` (nothing is downloaded) and each step's
batch depends only on the step, so an interrupted run logs exactly the losses of an uninterrupted one.
Without a GPU, examples/megatron_cpu.py redirects Megatron-core's CUDA-only calls to CPU.
"""

from relaytrain import program

# dist_checkpointing starts a spawn-mode multiprocessing Manager, whose processes import this file
# again (as __mp_main__): only the real program installs the handlers and takes the run's lock.
if __name__ == "__main__":
    program.install()  # before torch is imported: a stop signal during start-up is kept

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SEQ_LEN, VOCAB = 32, 320


def batch(step: int, replica: int, replicas: int, size: int = 2) -> torch.Tensor:
    """This data-parallel replica's share of the global batch of ``step``, whatever the run's history."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size * replicas, SEQ_LEN + 1), generator=g)
    return tokens[replica * size : (replica + 1) * size]


def build_model():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB, max_sequence_length=SEQ_LEN, position_embedding_type="rope",
    )  # fmt: skip


def save(model, optimizer, checkpoints: Path, step: int) -> None:
    """Every rank: the sharded model into ``step<N>/`` and its optimizer state; rank 0 then moves
    ``latest`` to it, so a stop during the save leaves the previous checkpoint the latest."""
    from megatron.core import dist_checkpointing

    target = checkpoints / f"step{step}"
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(target))
    optimizer_file = target / f"optim_rank{dist.get_rank()}.pt"
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, optimizer_file)
    dist.barrier()
    if dist.get_rank() == 0:
        (checkpoints / "latest.tmp").write_text(f"step{step}\n")
        os.replace(checkpoints / "latest.tmp", checkpoints / "latest")
    dist.barrier()


def load(model, optimizer, checkpoints: Path) -> int:
    """The step of the latest checkpoint after loading it, or 0 when there is none."""
    from megatron.core import dist_checkpointing

    if not (checkpoints / "latest").exists():
        return 0
    source = checkpoints / (checkpoints / "latest").read_text().strip()
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(source)))
    # weights_only: loading a checkpoint never runs code from it
    state = torch.load(source / f"optim_rank{dist.get_rank()}.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="checkpoint and loss log directory")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the world size)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step")
    args = parser.parse_args()
    out = Path(args.out)

    from megatron.core import parallel_state, tensor_parallel

    if not torch.cuda.is_available():
        import megatron_cpu  # examples/megatron_cpu.py, next to this file

        megatron_cpu.patch()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # env:// reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (srun via relaytrain and torchrun set them)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    rank = dist.get_rank()
    replica, replicas = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    model = build_model()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    checkpoints = out / "checkpoints"
    step = load(model, optimizer, checkpoints)
    if step and rank == 0:
        print(f"resuming at step {step} (restart {program.restart_count()}, "
              f"previous stop: {program.previous_stop()})", flush=True)  # fmt: skip
    causal = torch.triu(torch.ones(1, 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool, device=device), diagonal=1)
    positions = torch.arange(SEQ_LEN, device=device).unsqueeze(0)
    while step < args.steps:
        tokens = batch(step, replica, replicas).to(device)
        loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).float().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if replicas > 1:  # data parallel: average the gradients of the replicas of each shard
            for p in model.parameters():
                dist.all_reduce(p.grad, group=parallel_state.get_data_parallel_group())
                p.grad /= replicas
        optimizer.step()
        step += 1
        mean = loss.detach().clone()  # the same on the ranks of a tensor-parallel group
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "losses.jsonl", "a") as f:
                row = {"step": step, "loss": mean.item(), "restart": program.restart_count()}
                f.write(json.dumps(row) + "\n")
        time.sleep(args.step_delay)
        if program.should_stop(step):  # the same answer on every rank (one all-reduce)
            with program.saving():  # a collective: every rank writes its shards
                save(model, optimizer, checkpoints, step)
            if rank == 0:
                print(f"stopping at step {step}: {program.stop_reason()}", flush=True)
            program.exit_for_requeue(step)  # records the stop, requeues if allowed, exits 75
    program.finish(step)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
