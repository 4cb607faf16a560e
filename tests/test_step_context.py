"""What the step context wraps around a forward: autocast (one device, parallel.param_dtype below fp32)
around the forward and the loss only, not the backward (PyTorch's recipe); under context parallel, the
SDPA kernels it supports pinned."""

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


def test_context_parallel_pins_the_sdpa_kernels_it_supports(monkeypatch):
    """CP cannot run on CPU (no attention strategy for it): the wiring is checked with context_parallel
    replaced by a recorder; inside the step context the math kernel must be off."""
    import contextlib
    from types import SimpleNamespace

    import torch.distributed.tensor.experimental as experimental

    from relaytrain.parallel.parallel_model import ParallelModel

    seen = []

    @contextlib.contextmanager
    def fake_context_parallel(mesh, **kwargs):
        seen.append(mesh)
        yield

    monkeypatch.setattr(experimental, "context_parallel", fake_context_parallel)
    model = object.__new__(ParallelModel)
    model.use_loss_parallel, model.dims, model.mesh = False, SimpleNamespace(cp=2), {"cp": "cp mesh"}
    model.model_parts = [SimpleNamespace(rope_cos=torch.zeros(1), rope_sin=torch.zeros(1))]
    assert torch.backends.cuda.math_sdp_enabled()
    with model._step_context([torch.zeros(1, 4)]):
        assert seen == ["cp mesh"]
        assert not torch.backends.cuda.math_sdp_enabled(), "the math kernel can run under CP"
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()
