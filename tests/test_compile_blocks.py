"""parallel.compile: every block runs its compiled graph, also in a model deeper than Dynamo's recompile
limit (a block that fell back to eager would silently lose the compile; 8B has 32 blocks, 70B 80)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from relaytrain.config import ModelConfig
from relaytrain.model import Transformer
from relaytrain.parallel.activation import apply_ac, apply_compile

N_BLOCKS = 10  # more than the recompile limit below


class CountingBackend:
    """A Dynamo backend that runs the captured graph as it is and counts the calls of compiled code."""

    def __init__(self):
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm(*args)

        return run


@pytest.mark.parametrize("ac", ["none", "full"])
def test_every_block_runs_compiled_past_the_recompile_limit(monkeypatch, ac):
    backend = CountingBackend()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compile_(*a, **{**k, "backend": backend}))
    torch._dynamo.reset()
    cfg = ModelConfig(dim=32, n_layers=N_BLOCKS, n_heads=2, n_kv_heads=2, vocab_size=64, multiple_of=16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 64, (2, 16))
    expected = model(tokens)
    apply_ac(model, ac)
    apply_compile(model)
    with torch._dynamo.config.patch(recompile_limit=8):
        for _ in range(2):
            before = backend.calls
            out = model(tokens)
            out.float().sum().backward()
            assert backend.calls - before == N_BLOCKS, "a block ran eagerly"
    assert backend.graphs <= 2  # one graph serves every block: no recompile per block
    torch.testing.assert_close(out, expected)
    assert [name for name, _ in model.named_parameters()] == [
        name for name, _ in Transformer(cfg).named_parameters()
    ]  # compiled in place: the checkpoint keys and FSDP/TP plans keep their names
    torch._dynamo.reset()
