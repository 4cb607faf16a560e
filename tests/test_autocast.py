"""One device with parallel.param_dtype below fp32 (no FSDP to cast): autocast covers the forward and the
loss, not the backward (PyTorch's recipe; the backward runs in the dtypes the forward chose)."""

from __future__ import annotations

import torch

from relaytrain.config import load_config
from relaytrain.parallel import parallelize

from conftest import TINY


def test_autocast_covers_forward_and_loss_not_backward():
    cfg = load_config(None, [*TINY, "--parallel.param_dtype=bfloat16"])
    model = parallelize(cfg.parallel, cfg.model, cfg.train, torch.device("cpu"), 1, 0, 1, seed=0)
    forward, backward = [], []
    (part,) = model.model_parts
    part.register_forward_hook(lambda *_: forward.append(torch.is_autocast_enabled("cpu")))
    for p in part.parameters():
        p.register_hook(lambda g: backward.append(torch.is_autocast_enabled("cpu")))
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))
    loss = model.train_step(x, x)
    assert forward and all(forward), "the forward ran without autocast"
    assert backward and not any(backward), "the backward ran under autocast"
    assert torch.isfinite(loss) and not torch.is_autocast_enabled("cpu")
