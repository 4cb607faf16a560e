"""The on-disk format of a prepared dataset: flat token shards plus a ``meta.json`` sidecar.

A prepared directory holds ``train-00000.bin, ...`` and ``val-00000.bin, ...`` (raw little-endian
uint16 or uint32 token ids, documents each followed by EOS), ``meta.json`` describing them, and a copy of
``tokenizer.json`` when one was used. The dtype and vocabulary always come from ``meta.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from relaytrain.errors import UserError

META_NAME = "meta.json"
FORMAT_NAME = "relaytrain-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
PREPARE_HINT = "make one with: relaytrain prepare-data INPUT ... --out DIR"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


class ShardWriter:
    """Appends token arrays to ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.documents = 0
        self._file = None

    def _open_next(self) -> None:
        self._close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 - closed in _close
        self.shards.append({"file": name, "tokens": 0})

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None

    def write(self, tokens: np.ndarray, documents: int) -> None:
        self.documents += documents
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            piece, tokens = tokens[:room], tokens[room:]
            self._file.write(piece.tobytes())
            self.shards[-1]["tokens"] += len(piece)

    def finish(self) -> dict[str, Any]:
        self._close()
        total = sum(s["tokens"] for s in self.shards)
        return {"tokens": total, "documents": self.documents, "shards": self.shards}


class TokenStream:
    """One split's shards seen as a single concatenated array of token ids (memory-mapped)."""

    def __init__(self, directory: Path, shards: list[dict[str, Any]], dtype: np.dtype) -> None:
        self._arrays = [
            np.memmap(directory / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
            for s in shards
            if s["tokens"] > 0
        ]
        sizes = [len(a) for a in self._arrays]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)``; a read may span shard boundaries."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"read [{start}, {start + length}) outside a stream of {self.num_tokens} tokens")
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        offset = start - int(self._starts[shard])
        first = self._arrays[shard][offset : offset + length]
        if len(first) == length:
            return np.asarray(first)
        pieces, need = [first], length - len(first)
        while need > 0:
            shard += 1
            piece = self._arrays[shard][:need]
            pieces.append(piece)
            need -= len(piece)
        return np.concatenate(pieces)


class PreparedDataset:
    """A directory written by ``relaytrain prepare-data``, checked against its ``meta.json``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.meta = read_meta(self.path)
        self.dtype = np.dtype(self.meta["dtype"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.tokenizer_name = str(self.meta["tokenizer"])
        self.eos_id = int(self.meta["eos_id"])
        tok_file = self.meta.get("tokenizer_file")
        self.tokenizer_file = self.path / tok_file if tok_file else None
        self._streams: dict[str, TokenStream] = {}

    def split(self, name: str) -> TokenStream:
        if name not in self._streams:
            self._streams[name] = TokenStream(self.path, self.meta["splits"][name]["shards"], self.dtype)
        return self._streams[name]

    def num_tokens(self, split: str) -> int:
        return int(self.meta["splits"][split]["tokens"])


def read_meta(path: Path) -> dict[str, Any]:
    """Load and check ``<path>/meta.json``: format, dtype, and that every shard has the size it claims."""
    meta_path = path / META_NAME
    if not path.is_dir() or not meta_path.is_file():
        raise UserError(f"{path} is not a prepared dataset directory (no {META_NAME}); {PREPARE_HINT}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{meta_path} is unreadable ({exc}); prepare the data again") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise UserError(f"{meta_path} is not a relaytrain token dataset description; {PREPARE_HINT}")
    if meta.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{meta_path} has format version {meta.get('version')}, this relaytrain reads version "
            f"{FORMAT_VERSION}; prepare the data again"
        )
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in SPLITS:
            for shard in meta["splits"][split]["shards"]:
                expected = int(shard["tokens"]) * itemsize
                shard_path = path / shard["file"]
                actual = shard_path.stat().st_size if shard_path.is_file() else -1
                if actual != expected:
                    raise UserError(
                        f"shard {shard_path} has {actual if actual >= 0 else 'no'} bytes, meta.json says "
                        f"{expected}; the dataset is damaged, prepare it again"
                    )
        for key in ("vocab_size", "tokenizer", "eos_id"):
            meta[key]  # noqa: B018 - presence check
    except (KeyError, TypeError) as exc:
        raise UserError(f"{meta_path} lacks the field {exc}; prepare the data again") from exc
    return meta


def manifest_digest(path: str | Path) -> str:
    """xxh3_64 of a prepared directory's ``meta.json`` bytes: its shards, their token counts, dtype and
    tokenizer. The data fingerprint of a run's sample record names each source by it."""
    return xxhash.xxh3_64_hexdigest((Path(path).expanduser() / META_NAME).read_bytes())
