"""Parameter and FLOP counting from the config alone (no model needs to exist).

FLOPs per token for training (forward + backward), the formula MFU uses (PaLM appendix B, as in
torchtitan and Megatron):

    flops_per_token = 6 * N + 12 * L * D * T

N is the number of parameters that take part in matrix multiplications (every Linear, the output
projection included; the input embedding lookup is not a matmul), L the number of layers, D the model
width (n_heads * head_dim) and T the sequence length. 6N counts a multiply-add (2) for the forward and
twice that for the backward; 12*L*D*T counts the attention score and value matmuls (QK^T and AV, 2 each
forward, x3 with backward, over T keys), without discounting the causal mask.
"""

from __future__ import annotations

import math

from relaytrain.config.schema import ModelConfig


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    """Llama's rule: 2/3 of 4*dim, scaled by a multiplier, rounded up to `multiple_of`."""
    if cfg.ffn_dim > 0:
        return cfg.ffn_dim
    hidden = int(cfg.ffn_dim_multiplier * int(2 * 4 * cfg.dim / 3))
    return cfg.multiple_of * math.ceil(hidden / cfg.multiple_of)


def count_parameters(cfg: ModelConfig, include_embedding: bool = True) -> int:
    head_dim = cfg.dim // cfg.n_heads
    q = cfg.dim * cfg.n_heads * head_dim
    kv = 2 * cfg.dim * cfg.n_kv_heads * head_dim
    o = cfg.n_heads * head_dim * cfg.dim
    ffn = 3 * cfg.dim * ffn_hidden_dim(cfg)
    per_layer = q + kv + o + ffn + 2 * cfg.dim
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    total = cfg.n_layers * per_layer + cfg.dim + output
    return total + (embedding if include_embedding else 0)


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters used in matmuls: everything but norms and the embedding lookup."""
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    n = count_parameters(cfg, include_embedding=False) - norms
    if cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.dim  # the tied matrix still does the output matmul
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * matmul_parameters(cfg) + 12.0 * cfg.n_layers * cfg.dim * seq_len
