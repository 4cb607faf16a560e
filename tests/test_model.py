"""Model shape, presets' parameter counts, FLOP formula, init and schedules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relaytrain.config import ModelConfig, OptimConfig, load_config
from relaytrain.model import Transformer, count_parameters, flops_per_token, matmul_parameters
from relaytrain.optim import lr_at

REPO = Path(__file__).resolve().parents[1]

# Expected counts, computed by hand from the published shapes (Llama 3.2 1B/3B, Llama 2 7B, Llama 3 8B/70B).
PRESETS = {
    "debug": 3_115_264,
    "125m": 125_848_320,
    "350m": 316_720_128,
    "1b": 1_235_814_400,
    "3b": 3_212_749_824,
    "7b": 6_738_415_616,
    "8b": 8_030_261_248,
    "70b": 70_553_706_496,
}


@pytest.mark.parametrize(("name", "expected"), PRESETS.items())
def test_preset_parameter_counts(name, expected):
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    assert count_parameters(cfg.model) == expected


def test_analytic_count_matches_module():
    for tie in (False, True):
        cfg = ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=100, tie_embeddings=tie)
        with torch.device("meta"):
            model = Transformer(cfg)
        assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)


def test_flops_formula_by_hand():
    # dim 64, 1 layer, 4 heads (head 16), 2 kv heads, ffn 128, vocab 100, untied:
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_dim=128)
    matmul = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 100 * 64
    assert matmul_parameters(cfg) == matmul
    assert flops_per_token(cfg, seq_len=32) == 6 * matmul + 12 * 1 * 64 * 32


def test_forward_shapes_and_causality():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100)
    model = Transformer(cfg)
    tokens = torch.randint(0, 100, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 100)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 100
    # Positions before the change must not see it.
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)


def test_init_is_seeded_and_depth_scaled():
    cfg = ModelConfig(dim=128, n_layers=8, n_heads=4, n_kv_heads=4, vocab_size=64)
    a, b = Transformer(cfg), Transformer(cfg)
    b.init_weights(seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    b.init_weights(seed=1)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
    wq, wo = a.layers["0"].attention.wq.weight.std().item(), a.layers["0"].attention.wo.weight.std().item()
    assert wq == pytest.approx(0.02, rel=0.05) and wo == pytest.approx(0.02 / 4, rel=0.05)


def test_tied_embeddings_share_storage():
    model = Transformer(
        ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=50, tie_embeddings=True)
    )
    assert model.output.weight is model.tok_embeddings.weight


def test_schedules():
    cos = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(cos, 5, 100) == pytest.approx(0.5)
    assert lr_at(cos, 10, 100) == pytest.approx(1.0)
    assert lr_at(cos, 55, 100) == pytest.approx(0.55)
    assert lr_at(cos, 100, 100) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert lr_at(wsd, 50, 100) == 1.0 and lr_at(wsd, 80, 100) == 1.0
    assert lr_at(wsd, 90, 100) == pytest.approx(0.5) and lr_at(wsd, 100, 100) == pytest.approx(0.0)
    const = OptimConfig(lr=0.3, warmup_steps=0, schedule="constant")
    assert lr_at(const, 1, 10) == lr_at(const, 10, 10) == 0.3
