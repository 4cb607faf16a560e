"""Reading model weights from any checkpoint kind, in one process or into a sharded model.

Kinds: a relaytrain step directory (torch.distributed.checkpoint files; a run or checkpoints directory
stands for its ``latest``), a Hugging Face Llama directory (config.json + safetensors), and the
standalone torch file written by ``relaytrain export --format torch``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from relaytrain.checkpoint import dcp_io, hf
from relaytrain.checkpoint.checksums import damaged_problems
from relaytrain.checkpoint.choose import resolve_checkpoint
from relaytrain.checkpoint.files import COMPLETE, read_metadata
from relaytrain.checkpoint.state import (
    expected_model_shapes,
    model_state,
    raise_on_mismatch,
    set_model_state,
    shape_mismatches,
)
from relaytrain.config.schema import ModelConfig
from relaytrain.errors import UserError

log = logging.getLogger("relaytrain.checkpoint")

TORCH_EXPORT_NAME = "model.pt"
TORCH_FORMAT = "relaytrain-torch"


def _dcp_tensor_metadata(step_dir: Path) -> dict[str, Any]:
    """Model tensor name -> DCP TensorStorageMetadata (size, dtype), from the checkpoint's .metadata."""
    meta = dcp_io.read_metadata(step_dir)
    return {
        k.removeprefix("model."): v for k, v in meta.state_dict_metadata.items() if k.startswith("model.")
    }


def verify_model_fits(step_dir: Path, cfg: ModelConfig) -> None:
    """Raise a UserError listing every tensor whose name or shape differs from the configured model."""
    found = {k: tuple(v.size) for k, v in _dcp_tensor_metadata(step_dir).items()}
    raise_on_mismatch(step_dir, shape_mismatches(found, expected_model_shapes(cfg)))


def checkpoint_kind(path: Path) -> tuple[str, Path]:
    """('dcp' | 'hf' | 'torch', the concrete path) for any path a user may give."""
    path = Path(path).expanduser()
    if path.is_file():
        return "torch", path
    if hf.is_hf_dir(path):
        return "hf", path
    if (path / TORCH_EXPORT_NAME).is_file():
        return "torch", path / TORCH_EXPORT_NAME
    return "dcp", resolve_checkpoint(path)


def _committed(step_dir: Path) -> None:
    if not (step_dir / COMPLETE).is_file():
        raise UserError(f"checkpoint {step_dir} is incomplete (no {COMPLETE} marker); use a complete one")
    problems = damaged_problems(step_dir)
    if problems:
        raise UserError(f"checkpoint {step_dir} is damaged ({'; '.join(problems[:3])}); use an older one")


def read_full_state(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(model config, full unsharded state in relaytrain names, info) in this process, on CPU.

    info carries "kind", "path", and for relaytrain checkpoints "metadata".
    """
    kind, path = checkpoint_kind(Path(path))
    if kind == "hf":
        cfg = hf.model_config_from_hf(json.loads((path / "config.json").read_text()), path)
        state = hf.from_hf_state(hf.read_safetensors(path), cfg)
        found = {k: tuple(v.shape) for k, v in state.items()}
        raise_on_mismatch(path, shape_mismatches(found, expected_model_shapes(cfg)))
        return cfg, state, {"kind": kind, "path": path}
    if kind == "torch":
        try:
            blob = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise UserError(f"cannot load {path} as a relaytrain torch export ({exc})") from None
        if not isinstance(blob, dict) or blob.get("format") != TORCH_FORMAT:
            raise UserError(f"{path} is not a relaytrain torch export (relaytrain export --format torch)")
        cfg = ModelConfig(**blob["model_config"])
        return cfg, blob["state_dict"], {"kind": kind, "path": path, "metadata": blob.get("metadata", {})}
    _committed(path)
    meta = read_metadata(path)
    cfg = ModelConfig(**meta["model"])
    tensors = _dcp_tensor_metadata(path)
    raise_on_mismatch(
        path, shape_mismatches({k: tuple(v.size) for k, v in tensors.items()}, expected_model_shapes(cfg))
    )
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in tensors.items()}
    try:
        dcp_io.load({"model": state}, path)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"cannot read checkpoint {path} ({type(exc).__name__}: {exc}); it is damaged"
        ) from None
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return cfg, state, {"kind": kind, "path": path, "metadata": meta}


def init_model_from(path: Path, parts: list[nn.Module], cfg: ModelConfig, process_group=None) -> None:
    """Load only the weights of `path` into a (possibly sharded, possibly split) model."""
    kind, concrete = checkpoint_kind(path)
    if kind == "dcp":
        _committed(concrete)
        verify_model_fits(concrete, cfg)
        state = {"model": model_state(parts)}
        dcp_io.load(
            state,
            concrete,
            process_group=process_group,
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )
        set_model_state(parts, state["model"])
        return
    source_cfg, full, _ = read_full_state(concrete)
    found = {k: tuple(v.shape) for k, v in full.items()}
    raise_on_mismatch(concrete, shape_mismatches(found, expected_model_shapes(cfg)))
    dtypes = {k: v.dtype for part in parts for k, v in part.state_dict().items()}
    set_model_state(parts, {k: v.to(dtypes.get(k, v.dtype)) for k, v in full.items()}, full=True)
    if dataclasses.replace(source_cfg, preset="", init_std=0) != dataclasses.replace(
        cfg, preset="", init_std=0
    ):
        log.info(
            "init_from %s: shapes match; other model settings differ from its config (%s vs %s)",
            concrete,
            source_cfg,
            cfg,
        )


def load_model(path: str | Path):
    """The model of a checkpoint (step dir, run dir = its latest, HF dir, or torch export), eval mode, CPU.

    Call it on a LongTensor of token ids [batch, seq] to get logits [batch, seq, vocab].
    """
    from relaytrain.model.transformer import Transformer

    cfg, state, _ = read_full_state(path)
    model = Transformer(cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return model.eval()
