"""One process, alternating step by step: a plain forward+backward against relaytrain's ``train_step``.

Separate processes see the machine differently (other jobs, memory placement), so a cross-process
difference in forward+backward time may be the machine. Here both run in the same process on the same
batches, interleaved A/B/A/B: the plain side is ``Transformer`` + micro-batched cross entropy + backward;
the relaytrain side is the model that ``relaytrain.parallel.parallelize`` builds (meta device, then
initialised) and its ``ParallelModel.train_step``. Both on the device and in the precision of
``relaytrain train`` (``bench.plain_loop.device_and_precision``); each step ends with a read of its loss.
Gradients are zeroed after each; no optimizer step, so both keep their initial weights.

    python -m bench.step_ab --steps 20 [--section.key=value ...]
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
from relaytrain.parallel import parallelize

from bench.plain_loop import batches, device_and_precision


def run(steps: int, overrides: list[str], data: str = "corpus") -> dict:
    cfg = load_config(None, overrides)
    device, dtype, autocast = device_and_precision(cfg)  # both sides: the trainer's device and precision
    pm = parallelize(cfg.parallel, cfg.model, cfg.train, device, 1, 0, 1, seed=cfg.run.seed)
    with torch.device(device):
        plain = Transformer(cfg.model)
    plain.init_weights(cfg.run.seed)
    plain.train()
    mbs = cfg.train.micro_batch_size
    prepared = [(x.to(device), y.to(device)) for x, y in batches(cfg, steps, data)]

    def plain_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        n_micro = max(1, inputs.shape[0] // mbs)
        for i in range(n_micro):
            x = inputs[i * mbs : (i + 1) * mbs].contiguous()
            y = targets[i * mbs : (i + 1) * mbs].contiguous()
            with autocast():
                loss = F.cross_entropy(plain(x).flatten(0, 1).float(), y.flatten())
            (loss / n_micro).backward()
        loss.item()
        plain.zero_grad(set_to_none=True)

    def relaytrain_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        float(pm.train_step(inputs, targets))
        for part in pm.model_parts:
            part.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"plain": [], "relaytrain": []}
    for step, (inputs, targets) in enumerate(prepared):
        order = [("plain", plain_step), ("relaytrain", relaytrain_step)]
        for name, fn in order if step % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn(inputs, targets)
            times[name].append(time.perf_counter() - start)
    return {
        "threads": torch.get_num_threads(),
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "data": data,
        **times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", choices=("corpus", "random"), default="corpus")
    args, overrides = parser.parse_known_args(argv)
    print(json.dumps(run(args.steps, overrides, args.data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
