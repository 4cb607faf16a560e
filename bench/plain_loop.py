"""The reference for framework overhead: a minimal plain-PyTorch training loop of relaytrain's model.

Same model class (``relaytrain.model.Transformer``) and init, same config (the overrides given are read
with ``relaytrain.config.load_config``, so shapes, batch, micro-batching and optimizer settings match
``relaytrain train`` given the same overrides), AdamW with the same parameter groups and foreach kernels,
gradient clipping. Tokens: by default the trainer's own batches (read from relaytrain's loader before the
timed loop starts, so loading is not timed), or uniform random ones (``--data random``). No data loading in
the loop, no metrics, checkpointing, signal handling or watchdog.
Before training it measures this process's fp32 matmul peak (1024², 0.5 s), one more sample of the CPU peak
for the MFU denominator.

    python -m bench.plain_loop --steps 30 [--section.key=value ...]

Prints one JSON line: per-step wall times and their forward+backward / optimizer split.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from relaytrain.config import load_config
from relaytrain.model import Transformer

from bench.matmul_peak import time_matmul


def batches(cfg, steps: int, data: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's (inputs, targets), prepared before timing starts."""
    if data == "corpus":
        from relaytrain.data import build_train_loader

        loader = build_train_loader(
            cfg.data,
            0,
            1,
            cfg.train.global_batch_size,
            seq_len=cfg.train.seq_len,
            seed=cfg.run.seed,
            vocab_size=cfg.model.vocab_size,
            runs_dir=cfg.run.dir,
        )
        return [loader.next_batch() for _ in range(steps)]
    gen = torch.Generator().manual_seed(cfg.run.seed)
    shape = (steps, cfg.train.global_batch_size, cfg.train.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def run(steps: int, overrides: list[str], peak_seconds: float = 0.5, data: str = "corpus") -> dict:
    cfg = load_config(None, overrides)
    peak = time_matmul(1024, torch.float32, "cpu", peak_seconds)["best_flops"] if peak_seconds > 0 else None
    train, optim = cfg.train, cfg.optim
    torch.manual_seed(cfg.run.seed)
    model = Transformer(cfg.model)
    model.init_weights(cfg.run.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        foreach=True,
    )
    batch, mbs, seq = train.global_batch_size, train.micro_batch_size, train.seq_len
    n_micro = max(1, batch // mbs)
    prepared = batches(cfg, steps, data)
    step_s, fwd_bwd_s, opt_s, losses = [], [], [], []
    for step in range(steps):
        start = time.perf_counter()
        inputs, targets = prepared[step]
        total = 0.0
        for i in range(n_micro):
            x = inputs[i * mbs : (i + 1) * mbs].contiguous()
            y = targets[i * mbs : (i + 1) * mbs].contiguous()
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            (loss / n_micro).backward()
            total += loss.item()
        mid = time.perf_counter()
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, train.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = time.perf_counter()
        step_s.append(end - start)
        fwd_bwd_s.append(mid - start)
        opt_s.append(end - mid)
        losses.append(total / n_micro)
    return {
        "threads": torch.get_num_threads(),
        "data": data,
        "peak_flops": peak,
        "tokens_per_step": batch * seq,
        "step_s": step_s,
        "forward_backward_s": fwd_bwd_s,
        "optimizer_s": opt_s,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--data", choices=("corpus", "random"), default="corpus")
    args, overrides = parser.parse_known_args(argv)
    print(json.dumps(run(args.steps, overrides, data=args.data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
