"""The reference for framework overhead: a minimal plain-PyTorch training loop of relaytrain's model.

Same model class (``relaytrain.model.Transformer``) and init, same config (the overrides given are read
with ``relaytrain.config.load_config``, so shapes, batch, micro-batching and optimizer settings match
``relaytrain train`` given the same overrides), AdamW with the same parameter groups and foreach kernels,
gradient clipping. Tokens: by default the trainer's own batches (read from relaytrain's loader before the
timed loop starts, so loading is not timed), or uniform random ones (``--data random``). No data loading in
the loop, no metrics, checkpointing, signal handling or watchdog.
Same device and precision as ``relaytrain train`` on one process: the device ``run.device`` picks
(``auto``: CUDA when visible), parameters in fp32 and, where ``parallel.param_dtype`` is below fp32 (``auto``:
bf16 on CUDA), ``torch.autocast`` around the forward and the loss, as the trainer does without FSDP. The
loss is read once per step (after the optimizer, as the step's end on CUDA is a device synchronisation).
Before training it measures this process's matmul peak on that device in that dtype (1024² on CPU, 4096²
on CUDA, 0.5 s), one more sample of the peak for the MFU denominator.

    python -m bench.plain_loop --steps 30 [--section.key=value ...]

Prints one JSON line: per-step wall times and their forward+backward / optimizer split.
"""

from __future__ import annotations

import argparse
import contextlib
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


def device_and_precision(cfg):
    """What `relaytrain train` on one process runs with: (device, compute dtype, autocast context factory)."""
    from relaytrain.parallel.distributed import pick_device
    from relaytrain.parallel.fsdp import param_dtype

    device = pick_device(cfg.run.device, 0)
    dtype = param_dtype(cfg.parallel, device.type)
    if dtype == torch.float32:
        return device, dtype, contextlib.nullcontext
    return device, dtype, lambda: torch.autocast(device.type, dtype=dtype)


def run(steps: int, overrides: list[str], peak_seconds: float = 0.5, data: str = "corpus") -> dict:
    cfg = load_config(None, overrides)
    device, dtype, autocast = device_and_precision(cfg)
    cuda = device.type == "cuda"
    size = 4096 if cuda else 1024
    peak = time_matmul(size, dtype, device.type, peak_seconds)["best_flops"] if peak_seconds > 0 else None
    train, optim = cfg.train, cfg.optim
    torch.manual_seed(cfg.run.seed)
    with torch.device(device):
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
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch, mbs, seq = train.global_batch_size, train.micro_batch_size, train.seq_len
    n_micro = max(1, batch // mbs)
    prepared = [(x.to(device), y.to(device)) for x, y in batches(cfg, steps, data)]
    step_s, fwd_bwd_s, opt_s, losses = [], [], [], []
    sync()
    for step in range(steps):
        start = time.perf_counter()
        inputs, targets = prepared[step]
        total = torch.zeros((), device=device)
        for i in range(n_micro):
            x = inputs[i * mbs : (i + 1) * mbs].contiguous()
            y = targets[i * mbs : (i + 1) * mbs].contiguous()
            with autocast():
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            (loss / n_micro).backward()
            total += loss.detach()
        sync()  # on CUDA, charge the kernels to the forward+backward that launched them
        mid = time.perf_counter()
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, train.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total) / n_micro)  # the step's one read (a synchronisation on CUDA)
        end = time.perf_counter()
        step_s.append(end - start)
        fwd_bwd_s.append(mid - start)
        opt_s.append(end - mid)
    return {
        "threads": torch.get_num_threads(),
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
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
