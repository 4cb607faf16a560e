"""A Llama-3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module names follow the torchtitan/Meta layout (tok_embeddings, layers.<i>.attention.wq, ...) so that
parallel plans, checkpoints and the Hugging Face export can address parameters by stable names.
`layers` is a ModuleDict keyed by the global layer index: a pipeline stage deletes the layers it does
not own and the remaining names stay the same as in the full model.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from relaytrain.config.schema import ModelConfig
from relaytrain.model.flops import ffn_hidden_dim


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... as Meta's Llama reference does."""
    seq_len = x.shape[1]
    cos = cos[:seq_len].view(1, seq_len, 1, -1)
    sin = sin[:seq_len].view(1, seq_len, 1, -1)
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = ffn_hidden_dim(cfg)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: derived from the config, so checkpoints and exports stay weights-only.
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings.weight.device.type != "meta":
            # On the meta device nothing exists yet: parallelize() initialises after sharding.
            self.init_weights(seed=0)

    def init_std_for(self, name: str) -> float | None:
        """Init std of a parameter by name; None for norm weights, which start at one."""
        cfg = self.cfg
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            # Depth scaling keeps the residual stream's variance flat as layers are added.
            return cfg.init_std / math.sqrt(2 * cfg.n_layers)
        if name == "output.weight" and not cfg.tie_embeddings:
            return cfg.dim**-0.5
        return cfg.init_std

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise parameters and RoPE tables; also used after meta-device construction.

        Each parameter is drawn from its own generator seeded by (seed, parameter name), as a full
        tensor, and each rank keeps its shard of it. The values are therefore the same whatever the
        sharding (FSDP, TP, pipeline split), which lets every layout reproduce the one-process run.
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        cfg = self.cfg
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        device = buffer_device or self.rope_cos.device
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        for name, param in self.named_parameters():
            std = self.init_std_for(name)
            is_dtensor = isinstance(param, DTensor)
            gen_device = param.device if param.device.type != "meta" else torch.device("cpu")
            if std is None:
                full = torch.ones(param.shape, device=gen_device, dtype=param.dtype)
            else:
                gen = torch.Generator(device=gen_device)
                gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
                full = torch.empty(param.shape, device=gen_device, dtype=torch.float32)
                full.normal_(0.0, std, generator=gen)
                full = full.to(param.dtype)
            if is_dtensor:
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab] (pipeline stages pass hidden states)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
