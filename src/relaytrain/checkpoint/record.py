"""The files of a step directory that are not DCP shards: what the run that wrote it was, and each
rank's train state (the training state's components: train state, data position, RNG, ...)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relaytrain.atomic import write_atomic
from relaytrain.checkpoint.checksums import bytes_checksum
from relaytrain.checkpoint.files import (
    CONFIG,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA,
    TOKENIZER,
    copy_durable,
    train_state_file,
)
from relaytrain.config.schema import ModelConfig
from relaytrain.version import __version__

log = logging.getLogger("relaytrain.checkpoint")


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint records about the run that wrote it (metadata.json, config.toml, tokenizer)."""

    name: str
    config_toml: str
    config_hash: str
    model: ModelConfig
    tokenizer: str  # "byte" or the tokenizer file / directory, copied into each checkpoint


def write_train_state(
    step_dir: Path, states: dict[str, Any], *, step: int, rank: int, world_size: int
) -> dict[str, str]:
    """Write this rank's train state file (`states`: the training state's "states", each component's
    state dict); its manifest checksum, computed from the bytes written."""
    payload = {
        "format_version": FORMAT_VERSION,
        "states": states,
        "step": step,
        "rank": rank,
        "world_size": world_size,
    }
    path = train_state_file(step_dir, rank)
    data = io.BytesIO()
    torch.save(payload, data)
    write_atomic(path, data.getvalue(), durable=True)
    return {str(path.relative_to(step_dir)): bytes_checksum(data.getbuffer())}


def write_run_record(
    step_dir: Path,
    record: RunRecord,
    *,
    step: int,
    reason: str,
    contents: list[str],
    world_size: int,
    parallel_dims: dict,
    save_mode: str,
    lineage: dict[str, Any],
) -> None:
    """metadata.json, config.toml and a copy of the tokenizer file (rank 0, before the commit)."""
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "reason": reason,
        "contents": contents,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unix_time": time.time(),
        "relaytrain_version": __version__,
        "torch_version": torch.__version__,
        "config_hash": record.config_hash,
        "run_name": record.name,
        "world_size": world_size,
        "parallel_dims": parallel_dims,
        "save_mode": save_mode,
        **lineage,
        "model": dataclasses.asdict(record.model),
        "tokenizer": record.tokenizer,
    }
    write_atomic(step_dir / METADATA, json.dumps(meta, indent=1), durable=True)
    write_atomic(step_dir / CONFIG, record.config_toml, durable=True)
    tokenizer = _tokenizer_file(record.tokenizer)
    if tokenizer is not None:
        copy_durable(tokenizer, step_dir / TOKENIZER)


def _tokenizer_file(spec: str) -> Path | None:
    if spec == "byte":
        return None
    path = Path(spec).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        log.warning("tokenizer file %s not found; checkpoints will not carry a copy of it", spec)
        return None
    return path
