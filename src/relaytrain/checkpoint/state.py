"""Model and optimizer state over pipeline parts, keyed by the full model's parameter names.

A pipeline stage keeps the global names of what it owns (``layers.5...`` stays ``layers.5...``), so
merging the parts' state dicts gives keys that do not depend on how the model was split: a checkpoint
written with pipeline parallelism loads without it, and the other way round. Optimizer state is
flattened the same way (``state.<param>.exp_avg``, ``param_groups.<param>.lr``).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from relaytrain.config.schema import ModelConfig
from relaytrain.errors import UserError
from relaytrain.model.transformer import ffn_hidden_dim

# DCP warns on every single-process save/load even when asked for one explicitly (no_dist=True).
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is .*assuming the intent is to (save|load) in a single"
)

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def expected_model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every persistent tensor of the full model and its shape, from the config alone."""
    head_dim = cfg.dim // cfg.n_heads
    hidden = ffn_hidden_dim(cfg)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attention_norm.weight": (cfg.dim,),
            p + "attention.wq.weight": (cfg.n_heads * head_dim, cfg.dim),
            p + "attention.wk.weight": (cfg.n_kv_heads * head_dim, cfg.dim),
            p + "attention.wv.weight": (cfg.n_kv_heads * head_dim, cfg.dim),
            p + "attention.wo.weight": (cfg.dim, cfg.n_heads * head_dim),
            p + "ffn_norm.weight": (cfg.dim,),
            p + "feed_forward.w1.weight": (hidden, cfg.dim),
            p + "feed_forward.w2.weight": (cfg.dim, hidden),
            p + "feed_forward.w3.weight": (hidden, cfg.dim),
        }
    shapes |= {"norm.weight": (cfg.dim,), "output.weight": (cfg.vocab_size, cfg.dim)}
    return shapes


def shape_mismatches(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Human-readable differences between a checkpoint's model tensors and the configured model's:
    shape differences first, then tensors the model needs but the checkpoint lacks, then extras."""
    differ = [
        f"{key}: checkpoint {list(found[key])} vs model {list(shape)}"
        for key, shape in expected.items()
        if key in found and tuple(found[key]) != tuple(shape)
    ]
    missing = [
        f"{key} missing (model needs {list(shape)})" for key, shape in expected.items() if key not in found
    ]
    extra = [f"{key} {list(found[key])} not in the model" for key in found if key not in expected]
    return differ + missing + extra


def raise_on_mismatch(source: Path | str, problems: list[str]) -> None:
    if problems:
        kinds = [[p for p in problems if ": checkpoint " in p], [p for p in problems if " missing (" in p]]
        kinds.append([p for p in problems if p.endswith("not in the model")])
        shown = [p for kind in kinds for p in kind[:4]]
        more = f"; ... ({len(problems)} differences in all)" if len(shown) < len(problems) else ""
        raise UserError(
            f"checkpoint {source} does not fit the configured model: {'; '.join(shown)}{more}. Use the model "
            "settings the checkpoint was written with (see its config.toml) or start from another checkpoint"
        )


def merged_view(parts: list[nn.Module]) -> nn.Module:
    """One module whose named parameters are the union of the parts', under their global names.

    Needed when one optimizer spans several pipeline parts: the state-dict helpers map optimizer
    parameters to names through a single module.
    """
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    for part in parts:
        for name, child in part.named_children():
            existing = getattr(view, name, None)
            if isinstance(child, nn.ModuleDict) and isinstance(existing, nn.ModuleDict):
                existing.update(child)
            elif isinstance(child, nn.ModuleDict):
                view.add_module(name, nn.ModuleDict(dict(child.items())))
            else:
                view.add_module(name, child)
    return view


def _optimizer_pairs(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
    if len(optimizers) == len(parts):
        return list(zip(parts, optimizers, strict=True))
    if len(optimizers) == 1:
        return [(merged_view(parts), optimizers[0])]
    raise ValueError(f"{len(optimizers)} optimizers for {len(parts)} model parts: give one or one per part")


def model_state(parts: list[nn.Module]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    return state


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Flattened optimizer state. On an optimizer that never stepped this creates zero state (step 1)."""
    state: dict[str, Any] = {}
    for module, opt in _optimizer_pairs(parts, optimizers):
        state.update(get_optimizer_state_dict(module, opt, options=_FLAT))
    return state


def create_adam_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Give never-stepped Adam/AdamW optimizers the state a load then overwrites entirely (DCP refuses a
    partial load): the entries their first step would create, with the same dtypes, shapes, devices and
    DTensor placements, but uninitialised moments (the load's reads fault the pages in once; zeros would
    be written twice). torch's state-dict helpers would otherwise run a zero-LR optimizer step."""
    from relaytrain.torch_private import optimizer_step_dtype

    for opt in optimizers:
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or opt.state:
            continue
        for group in opt.param_groups:
            on_device = group["capturable"] or group["fused"]
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                step_dtype = optimizer_step_dtype(is_fused=group["fused"])
                state = {
                    "step": torch.zeros((), dtype=step_dtype, device=p.device)
                    if on_device
                    else torch.tensor(0.0, dtype=optimizer_step_dtype(), device="cpu"),
                    "exp_avg": torch.empty_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.empty_like(p, memory_format=torch.preserve_format),
                }
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.empty_like(p, memory_format=torch.preserve_format)
                opt.state[p] = state


def optimizers_have_state(optimizers: list[torch.optim.Optimizer]) -> bool:
    return any(len(opt.state) > 0 for opt in optimizers)


def set_model_state(parts: list[nn.Module], state: dict[str, Any], *, full: bool = False) -> None:
    """Load merged state into each part (each takes its own keys); `full`: plain full tensors."""
    options = StateDictOptions(full_state_dict=full, strict=True)
    for part in parts:
        own = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: state[k] for k in own}, options=options)


def set_optimizer_state(
    parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], state: dict[str, Any]
):
    for module, opt in _optimizer_pairs(parts, optimizers):
        set_optimizer_state_dict(module, opt, optim_state_dict=state, options=_FLAT)


class TrainState:
    """The loop's own counters; the data position and the RNG streams are checkpointed beside it."""

    def __init__(self, run_id: str):
        self.step = 0
        self.tokens_seen = 0
        self.lr_scale = 1.0  # lowered by the NaN rollback policy
        self.run_id = run_id

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "lr_scale": self.lr_scale,
            "run_id": self.run_id,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.run_id = str(state["run_id"])


class RngState:
    """This rank's torch, CUDA, Python ``random`` and NumPy streams: their one owner in a checkpoint."""

    def __init__(self, seed: int):
        self.seed = seed

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)

    def reseed(self, step: int, rank: int) -> None:
        reseed_rng(self.seed, step, rank)


def capture_rng() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state()
        if torch.cuda.is_available()
        else torch.empty(0, dtype=torch.uint8),
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))


def reseed_rng(seed: int, step: int, rank: int) -> None:
    """Deterministic per-rank streams for a resume at a different world size (old streams do not map)."""
    value = (seed * 1_000_003 + step * 10_007 + rank) % (2**31)
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)
