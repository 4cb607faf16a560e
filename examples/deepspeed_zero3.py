"""DeepSpeed ZeRO-3 with the optimizer and parameters offloaded to CPU, preemption-safe (docs/programs.md).

    relaytrain launch --command "python examples/deepspeed_zero3.py --out \\$RELAYTRAIN_RUN_DIR/out" \\
        --name zero3 --nodes 2 --tasks-per-node 1 --signal USR2@180

One process per accelerator: started by srun (``relaytrain launch --command`` gives every task RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), by torchrun or by the ``deepspeed`` launcher,
which set the same variables. ``--ds-config`` is a DeepSpeed JSON config: the default,
examples/deepspeed/zero3_offload.json, offloads optimizer and parameters to CPU and uses DeepSpeed's
AdamW (DeepSpeedCPUAdam, a C++ op built on first use). A config without an ``optimizer`` section
trains with ``torch.optim.AdamW`` instead (examples/deepspeed/zero3_offload_torch_adamw.json, which
sets ``zero_force_ds_cpu_optimizer`` false to allow it), which needs no op build.

On an agreed stop every rank saves its ZeRO shards with ``save_checkpoint`` and the job is requeued;
the next job's ``load_checkpoint`` restores parameters, optimizer, scheduler and step, and
``resume_cpu_adam`` the state DeepSpeedCPUAdam's C++ op keeps outside its state dict. The end of training
saves a last checkpoint the same way. The model is a tiny ``LlamaForCausalLM`` built from a config and
each step's batch depends only on the step, so an interrupted run logs exactly the losses of an
uninterrupted one with the same world size and ends with the same weights and optimizer state.
"""

from relaytrain import program

program.install()  # before torch/deepspeed are imported: a stop signal during start-up is kept

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "deepspeed" / "zero3_offload.json"


def batch(step: int, rank: int, world: int, size: int, seq_len: int = 32, vocab: int = 320) -> torch.Tensor:
    """This rank's share of the global batch of ``step``: the same tokens whatever the run's history."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (size * world, seq_len), generator=g)
    return tokens[rank * size : (rank + 1) * size]


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def resume_cpu_adam(engine) -> None:
    """Bring DeepSpeedCPUAdam's C++ op to the step count of the optimizer state just loaded.

    The op keeps beta1**t and beta2**t as float32 products, one multiplication per step, outside the
    optimizer's state dict. After ``load_checkpoint`` its first step at t > 1 takes ``pow(beta, t)``
    instead, which differs from the product in the last bits at many steps (for beta2 = 0.999 at every
    step from 19 to 47): the bias correction changes and the resumed run drifts from the uninterrupted
    one, in its bf16 losses some steps later. Replaying the op's step counter from 1 to t (on empty
    tensors: nothing else is updated) rebuilds the same products. Does nothing for other optimizers or
    before the first step.
    """
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    op = getattr(basic, "ds_opt_adam", None)
    steps = max((int(state.get("step", 0)) for state in basic.state.values()), default=0)
    if op is None or steps == 0:
        return
    group, empty = basic.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]  # one op per optimizer: every group steps it with the same t and betas
    for t in range(1, steps + 1):
        op.adam_update(basic.opt_id, t, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                       group["bias_correction"], empty, empty, empty, empty)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="checkpoint and loss log directory")
    parser.add_argument("--ds-config", default=str(DEFAULT_CONFIG), help="DeepSpeed JSON config")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step")
    args = parser.parse_args()
    out = Path(args.out)
    ds_config = json.loads(Path(args.ds_config).read_text())

    import deepspeed

    # Reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (srun via relaytrain, torchrun and
    # the deepspeed launcher all set them); gloo where there is no GPU.
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    optimizer = None
    if "optimizer" not in ds_config:  # the config's choice: a plain torch optimizer, no op to build
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=ds_config
    )
    if rank == 0:
        basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
        offload = [what for what, on in (("optimizer", engine.zero_offload_optimizer()),
                                         ("parameters", engine.zero_offload_param())) if on]  # fmt: skip
        print(f"ZeRO stage {engine.zero_optimization_stage()}, {type(basic).__name__}, "
              f"offloaded to CPU: {', '.join(offload) or 'nothing'}", flush=True)  # fmt: skip
    checkpoints = out / "checkpoints"
    step = 0
    if (checkpoints / "latest").exists():
        _, client_state = engine.load_checkpoint(str(checkpoints))
        step = client_state["step"]
        resume_cpu_adam(engine)
        if rank == 0:
            print(f"resuming at step {step} (restart {program.restart_count()}, "
                  f"previous stop: {program.previous_stop()})", flush=True)  # fmt: skip
    start, micro = step, engine.train_micro_batch_size_per_gpu()
    while step < args.steps:
        tokens = batch(step, rank, world, micro).to(engine.device)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        step += 1
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        mean /= world
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "losses.jsonl", "a") as f:
                row = {"step": step, "loss": mean.item(), "restart": program.restart_count()}
                f.write(json.dumps(row) + "\n")
        time.sleep(args.step_delay)
        if program.should_stop(step):  # the same answer on every rank (one all-reduce)
            with program.saving():  # a collective: every rank writes its own ZeRO shards
                engine.save_checkpoint(str(checkpoints), tag=f"step{step}", client_state={"step": step})
            if rank == 0:
                print(f"stopping at step {step}: {program.stop_reason()}", flush=True)
            program.exit_for_requeue(step)  # records the stop, requeues if allowed, exits 75
    if step > start:  # the trained model (a run started after the end keeps it)
        engine.save_checkpoint(str(checkpoints), tag=f"step{step}", client_state={"step": step})
    program.finish(step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
