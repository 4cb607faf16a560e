"""Activation and loss memory of relaytrain's transformer, as its step holds them (bytes per GPU).

Counted from what autograd keeps for backward in `model/transformer.py` under bf16 compute, and checked
against the fake-tensor step (`relaytrain plan --simulate`, docs/benchmarks.md "Simulated at scale").
Per token of a layer, with h = model.dim, f = FFN width, r = n_kv_heads / n_heads, t = tp, c = cp:

* none: the two RMSNorms keep their fp32 input (4h / tc each) and the matmuls their bf16 input, which
  sequence parallelism all-gathers to the full sequence (2h / c each); attention keeps q, k, v
  (2h (1 + 2r)), RoPE's fp32 copies of q and k and their rotated bf16 results (6h (1 + r)), the
  grouped-query repeat of k and v (4h, when r < 1), the attention output and its reshaped copy (4h);
  the MLP keeps the w1 and w3 outputs, the SiLU output and the product (8f); the attention and MLP
  terms split over tc.
* selective (every other matmul output, attention and the TP reduce-scatters kept): the layer input
  (2h), the wq, wv and w1 outputs (2h (1 + r) + 2f), the attention output (2h), all over tc; the w2
  output before its reduce-scatter (2h / c, a full-sequence partial sum under TP), and with TP the two
  reduce-scattered outputs (4h / tc).
* full: the layer input, 2h / tc.

The loss: cross entropy takes the logits in fp32; it keeps the fp32 log-softmax (4V per token) and its
backward holds two more fp32 [tokens, V] gradients at once: 12 V / t bytes per token (vocabulary-parallel
under TP with loss parallel, else 12 V). Vocabulary-parallel, the step also holds the bf16 logits shard and
its bf16 gradient beside them, and the output projection its sequence-gathered bf16 input: 4 V / t + 2h
more (`loss_parallel_extra_bytes`; a one-off, the same whatever the layer count, in the simulation).

CUDA flash attention and the CPU kernel the simulation runs (_scaled_dot_product_flash_attention_for_cpu)
keep the same for backward: the output and a log-sum-exp per head and position, never the s x s scores.
"""

from __future__ import annotations

from relaytrain.config import Config
from relaytrain.model.flops import ffn_hidden_dim


def activation_bytes_per_layer(cfg: Config, tp: int, cp: int, micro_batch: int = 0) -> dict[str, float]:
    """Bytes one layer keeps per micro batch, by activation checkpointing mode.

    `micro_batch`: the one the layout chose (ParallelDims.micro_batch_size); 0: train.micro_batch_size."""
    m, t = cfg.model, cfg.train
    tokens = t.seq_len * (micro_batch or t.micro_batch_size)
    h, f, r = m.dim, ffn_hidden_dim(m), m.n_kv_heads / m.n_heads
    split = tp * cp
    repeat = 4 * h if r < 1 else 0.0
    attention = 2 * h * (1 + 2 * r) + 6 * h * (1 + r) + repeat + 4 * h
    none = 2 * (4 * h / split + 2 * h / cp) + (attention + 8 * f) / split
    selective = (2 * h + 2 * h * (1 + r) + 2 * f + 2 * h) / split + 2 * h / cp
    if tp > 1:
        selective += 4 * h / split
    full = 2 * h / split
    return {"none": none * tokens, "selective": selective * tokens, "full": full * tokens}


def vocab_split(cfg: Config, tp: int) -> int:
    """How many ranks share the logits' vocabulary: tp under loss parallel, else none."""
    return tp if tp > 1 and cfg.parallel.loss_parallel else 1


def _tokens(cfg: Config, micro_batch: int) -> int:
    return cfg.train.seq_len * (micro_batch or cfg.train.micro_batch_size)


def loss_bytes(cfg: Config, tp: int, micro_batch: int = 0) -> float:
    """The fp32 log-softmax and the two fp32 gradients of the loss's backward (see the module doc)."""
    return 12.0 * _tokens(cfg, micro_batch) * cfg.model.vocab_size / vocab_split(cfg, tp)


def loss_parallel_extra_bytes(cfg: Config, tp: int, micro_batch: int = 0) -> float:
    """What a vocabulary-parallel loss holds beside its fp32 buffers (see the module doc); 0 without it."""
    split = vocab_split(cfg, tp)
    if split == 1:
        return 0.0
    return (4.0 * cfg.model.vocab_size / split + 2.0 * cfg.model.dim) * _tokens(cfg, micro_batch)
