"""`relaytrain export` (to Hugging Face Llama or one torch file) and `relaytrain import-hf`."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from relaytrain.atomic import replacing, write_atomic
from relaytrain.checkpoint import hf
from relaytrain.checkpoint.checksums import write_complete
from relaytrain.checkpoint.files import (
    CONFIG,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA,
    TOKENIZER,
    inside,
)
from relaytrain.checkpoint.sources import TORCH_EXPORT_NAME, TORCH_FORMAT, read_full_state
from relaytrain.config import config_to_toml
from relaytrain.config.loader import config_from_dict
from relaytrain.errors import UserError
from relaytrain.version import __version__

log = logging.getLogger("relaytrain.checkpoint")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BYTE_TOKENIZER_NOTE = (
    "This model uses relaytrain's byte tokenizer: token ids 0-255 are the bytes of the UTF-8 text, 256 is "
    "BOS and 257 is EOS. There is no Hugging Face tokenizer file; encode with "
    "`list(text.encode('utf-8'))` and decode the ids below 256 as UTF-8 bytes."
)


def _fresh_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output {out} already exists and is not empty; choose a new --out or delete it")
    out.mkdir(parents=True, exist_ok=True)


def _tokenizer_source(info: dict) -> tuple[str, Path | None]:
    """('byte' | 'file', path of the tokenizer.json) for the checkpoint that `info` describes.

    Only the copy inside the checkpoint counts: a path named in its metadata or config could point
    anywhere on this machine, and the export would publish that file.
    """
    meta = info.get("metadata") or {}
    spec = meta.get("tokenizer", "byte")
    if spec == "byte":
        return "byte", None
    path = info["path"]
    copied = inside(path if path.is_dir() else path.parent, TOKENIZER)
    if copied is not None and copied.is_file():
        return "file", copied
    log.warning(
        "checkpoint %s carries no %s copy of its tokenizer (%s); the export has no tokenizer files",
        path,
        TOKENIZER,
        spec,
    )
    return "file", None


def _special_ids(kind: str, tokenizer: Path | None) -> tuple[int, int, dict]:
    """(bos id, eos id, tokenizer_config.json contents) for the export."""
    if kind == "byte" or tokenizer is None:
        return 256, 257, {}
    from relaytrain.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer)
    rust = tok._tok
    bos, eos = rust.id_to_token(tok.bos_id), rust.id_to_token(tok.eos_id)
    return (
        tok.bos_id,
        tok.eos_id,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "clean_up_tokenization_spaces": False,
        },
    )


def export_checkpoint(
    src: str | Path, out: str | Path, fmt: str = "hf", max_shard_size: str = "5GB", dtype: str = "auto"
) -> Path:
    """Write the model of checkpoint `src` as a Hugging Face Llama directory or one torch file."""
    cfg, state, info = read_full_state(src)
    if dtype != "auto":
        state = {k: v.to(_DTYPES[dtype]) for k, v in state.items()}
    meta = info.get("metadata") or {}
    provenance = {
        "source": str(info["path"]),
        "step": meta.get("step"),
        "run_name": meta.get("run_name"),
        "config_hash": meta.get("config_hash"),
        "relaytrain_version": __version__,
    }
    out = Path(out).expanduser()
    if fmt == "torch":
        target = out if out.suffix == ".pt" else out / TORCH_EXPORT_NAME
        if target.exists():
            raise UserError(f"{target} already exists; choose a new --out or delete it")
        target.parent.mkdir(parents=True, exist_ok=True)
        kind, tokenizer = _tokenizer_source(info)
        blob = {
            "format": TORCH_FORMAT,
            "format_version": 1,
            "model_config": dataclasses.asdict(cfg),
            "state_dict": {k: v.contiguous() for k, v in state.items()},
            "metadata": provenance | {"tokenizer": "byte" if kind == "byte" else "tokenizer.json"},
        }
        with replacing(target, durable=False) as tmp:
            torch.save(blob, tmp)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, target.parent / TOKENIZER)
        return target  # the caller says where it went (relaytrain export prints one line)
    if fmt != "hf":
        raise UserError(f"export format {fmt!r} is unknown; use 'hf' or 'torch'")
    _fresh_dir(out)
    kind, tokenizer = _tokenizer_source(info)
    bos, eos, tok_config = _special_ids(kind, tokenizer)
    out_dtype = next(iter(state.values())).dtype
    config = hf.hf_config(cfg, out_dtype, bos, eos)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": True, "temperature": 1.0}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    files = hf.write_safetensors(hf.to_hf_state(state, cfg), out, hf.parse_size(max_shard_size))
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        tok_config["model_max_length"] = cfg.max_seq_len
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        (out / "special_tokens_map.json").write_text(
            json.dumps({"bos_token": tok_config["bos_token"], "eos_token": tok_config["eos_token"]}, indent=2)
        )
    tokenizer_note = (
        BYTE_TOKENIZER_NOTE
        if kind == "byte"
        else (
            "The tokenizer is the run's tokenizer.json (AutoTokenizer.from_pretrained(this dir) loads it)."
            if tokenizer is not None
            else "The run's tokenizer file was not found, so none is included."
        )
    )
    (out / "README.md").write_text(
        f"# relaytrain export\n\nLlama model exported by relaytrain {__version__} from "
        f"`{info['path']}` (step {meta.get('step')}, run `{meta.get('run_name')}`, config hash "
        f"`{meta.get('config_hash')}`) on {time.strftime('%Y-%m-%d')}.\n\n"
        "Load it with `transformers.LlamaForCausalLM.from_pretrained(this dir)` or with "
        "`relaytrain.load_model(this dir)`.\n\n"
        f"Weights: {', '.join(files)} ({str(out_dtype).removeprefix('torch.')}).\n\n{tokenizer_note}\n"
    )
    return out


def import_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Turn a Hugging Face Llama directory into a committed relaytrain step directory (weights only)."""
    hf_dir, out = Path(hf_dir).expanduser(), Path(out).expanduser()
    if not hf.is_hf_dir(hf_dir):
        raise UserError(f"{hf_dir} is not a Hugging Face model directory (config.json + safetensors weights)")
    model_cfg, state, _ = read_full_state(hf_dir)
    _fresh_dir(out)
    dcp.save(
        {"model": {k: v.contiguous() for k, v in state.items()}},
        storage_writer=dcp.FileSystemWriter(out),
        no_dist=True,
    )
    data = {}
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer.json", out / TOKENIZER)
        data["tokenizer"] = str(out / TOKENIZER)
    cfg = config_from_dict({"model": dataclasses.asdict(model_cfg), "data": data})
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": 0,
        "reason": "import-hf",
        "contents": ["model"],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unix_time": time.time(),
        "relaytrain_version": __version__,
        "torch_version": torch.__version__,
        "config_hash": "",
        "run_name": "",
        "world_size": 1,
        "parallel_dims": {},
        "save_mode": "sync",
        "resumed_from": "",
        "model": dataclasses.asdict(model_cfg),
        "tokenizer": cfg.data.tokenizer,
        "source": str(hf_dir),
    }
    write_atomic(out / METADATA, json.dumps(meta, indent=1), durable=True)
    write_atomic(out / CONFIG, config_to_toml(cfg), durable=True)
    write_complete(out)
    return out
