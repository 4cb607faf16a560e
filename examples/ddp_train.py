"""A plain PyTorch DDP script that survives time limits and preemption (docs/programs.md).

    relaytrain launch --command "python examples/ddp_train.py --out runs/ddp/out" --name ddp \\
        --nodes 2 --tasks-per-node 2 --signal USR2@180

Also runs under torchrun, under srun, or as one process. On an agreed stop every rank leaves the loop
at the same step, rank 0 saves, and the job is requeued; the next job resumes from that checkpoint.
Data and initialisation depend only on the step and the seed, so an interrupted run logs exactly the
losses of an uninterrupted one with the same world size.
"""

from relaytrain import program

program.install()  # before torch is imported: a stop signal during start-up is kept, not fatal

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def batch(step: int, rank: int, world: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step``: the same numbers whatever the run's history."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size * world, 32, generator=g)
    y = (x[:, :8].sum(dim=1, keepdim=True) > 0).float()
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="checkpoint and loss log directory")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step")
    args = parser.parse_args()
    out = Path(args.out)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    checkpoint = out / "checkpoint.pt"
    if checkpoint.exists():  # weights_only: loading a checkpoint never runs code from it
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if rank == 0:
            print(f"resuming at step {start} (restart {program.restart_count()}, "
                  f"previous stop: {program.previous_stop()})", flush=True)  # fmt: skip
    ddp = DistributedDataParallel(model) if distributed else model
    if distributed:
        # DDP reduces the first backward's gradients in one bucket in parameter order and rebuilds its
        # buckets in backward order after it, which changes the order of the sums: the first step of a
        # resumed job would differ from an uninterrupted run in the last bits. A throw-away backward
        # (no optimizer step) fixes the layout before the first real step of every job.
        ddp(torch.zeros(1, 32)).sum().backward()
        optimizer.zero_grad(set_to_none=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    step = start
    while step < args.steps:
        x, y = batch(step, rank, world)
        loss = loss_fn(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        mean = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean)
            mean /= world
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "losses.jsonl", "a") as f:
                f.write(
                    json.dumps({"step": step, "loss": mean.item(), "restart": program.restart_count()}) + "\n"
                )
        time.sleep(args.step_delay)
        if program.should_stop(step):  # the same answer on every rank (one all-reduce)
            with program.saving():  # measured, so the time budget leaves room for the next save
                if rank == 0:
                    tmp = out / "checkpoint.pt.tmp"
                    torch.save(
                        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp
                    )
                    os.replace(tmp, checkpoint)
                if distributed:
                    dist.barrier()
            if rank == 0:
                print(f"stopping at step {step}: {program.stop_reason()}", flush=True)
            program.exit_for_requeue(step)  # records the stop, requeues if allowed, exits 75
    program.finish(step)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
