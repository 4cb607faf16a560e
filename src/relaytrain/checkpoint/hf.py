"""Hugging Face Llama format: parameter names, the RoPE row permutation, config.json and safetensors I/O.

relaytrain rotates interleaved pairs (x0, x1), (x2, x3), ... as Meta's reference does; HF's Llama
rotates the two halves of each head (``rotate_half``). The same model in HF layout therefore has the
rows of every head of wq and wk reordered: HF's ``convert_llama_weights_to_hf.py`` applies `permute`
below, and import applies its inverse.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from relaytrain.config.schema import ModelConfig
from relaytrain.errors import UserError
from relaytrain.model.transformer import ffn_hidden_dim

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows -> half-split rows, per head (HF's convert script's `permute`)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself (tie_word_embeddings)
        match = _LAYER_RE.match(name)
        if match:
            layer, rest = match.groups()
            if rest == "attention.wq.weight":
                tensor = permute_to_hf(tensor, cfg.n_heads)
            elif rest == "attention.wk.weight":
                tensor = permute_to_hf(tensor, cfg.n_kv_heads)
            out[f"model.layers.{layer}.{_LAYER_NAMES[rest]}"] = tensor.contiguous()
        else:
            out[_TOP_NAMES[name]] = tensor.contiguous()
    return out


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    top_names = {v: k for k, v in _TOP_NAMES.items()}
    out, unknown = {}, []
    for name, tensor in hf.items():
        match = _HF_LAYER_RE.match(name)
        if match and match.group(2) in layer_names:
            layer, rest = match.group(1), layer_names[match.group(2)]
            if rest == "attention.wq.weight":
                tensor = permute_from_hf(tensor, cfg.n_heads)
            elif rest == "attention.wk.weight":
                tensor = permute_from_hf(tensor, cfg.n_kv_heads)
            out[f"layers.{layer}.{rest}"] = tensor.contiguous()
        elif name in top_names:
            out[top_names[name]] = tensor
        elif not name.endswith("rotary_emb.inv_freq"):  # older exports saved this derived buffer
            unknown.append(name)
    if unknown:
        raise UserError(
            f"unexpected tensors in the Hugging Face weights: {', '.join(unknown[:5])}; only Llama "
            "models (LlamaForCausalLM) can be imported"
        )
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_dim(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers < 5 reads rope_theta, >= 5 reads rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "use_cache": True,
    }


def model_config_from_hf(config: dict, source: Path) -> ModelConfig:
    if config.get("model_type") != "llama":
        raise UserError(
            f"{source}/config.json has model_type {config.get('model_type')!r}; only 'llama' "
            "models can be imported"
        )
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        cfg = ModelConfig(
            preset="hf-import",
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab_size=int(config["vocab_size"]),
            ffn_dim=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            init_std=float(config.get("initializer_range", 0.02)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{source}/config.json lacks or has a bad Llama field ({exc})") from None
    unsupported = []
    if rope_type not in ("default", None):
        unsupported.append(f"rope scaling {rope_type!r}")
    if config.get("head_dim") not in (None, dim // heads):
        unsupported.append(f"head_dim {config['head_dim']} != hidden_size/num_attention_heads")
    if config.get("attention_bias") or config.get("mlp_bias"):
        unsupported.append("bias terms")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"activation {config['hidden_act']!r}")
    if unsupported:
        raise UserError(
            f"{source} uses {', '.join(unsupported)}, which relaytrain's model does not implement"
        )
    return cfg


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes (HF's convention)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise UserError(f"size {text!r} is not like '5GB', '500MB' or '2GiB'")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    powers = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    return int(number * powers[unit])


def _save_readable(save_file, tensors: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
    """safetensors writes through a private temporary file (mode 0600); an exported model is shared
    like any file the user writes, so it gets the mode ``open()`` would give it (0644 under umask 022)."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0o022)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_safetensors(state: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[str]:
    """One model.safetensors, or numbered shards plus model.safetensors.index.json above the limit."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        _save_readable(save_file, shards[0], out_dir / SAFETENSORS_SINGLE, metadata)
        return [SAFETENSORS_SINGLE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_readable(save_file, shard, out_dir / fname, metadata)
        names.append(fname)
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    return names + [SAFETENSORS_INDEX]


def read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()), key=str)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{index} is not a safetensors index with a weight_map ({exc})") from None
    elif (hf_dir / SAFETENSORS_SINGLE).is_file():
        files = [SAFETENSORS_SINGLE]
    else:
        raise UserError(
            f"{hf_dir} has no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}; only safetensors "
            "weights can be imported"
        )
    for name in files:
        # Hub snapshots link their files into a blob store, so links are fine; names leading out are not.
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise UserError(
                f"{index} maps weights to {name!r}, which is not a file inside {hf_dir}; refusing to read it"
            )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state |= load_file(str(hf_dir / name))
        except Exception as exc:  # safetensors raises its own error types for truncated headers
            raise UserError(
                f"cannot read {hf_dir / name} ({exc}); the download is incomplete or damaged"
            ) from None
    return state


def is_hf_dir(path: Path) -> bool:
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and ((path / SAFETENSORS_SINGLE).is_file() or (path / SAFETENSORS_INDEX).is_file())
    )
