"""Tokenizers behind one small interface: the built-in byte tokenizer and local HF tokenizer.json files.

A tokenizer's ``name`` is stable and content-addressed ("byte" or "file:<sha256[:16]>"), so a prepared
dataset records which tokenizer produced its ids and a config naming another one is caught.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from relaytrain.errors import UserError

BYTE_SPEC = "byte"

# Special-token spellings tried, in order, when a tokenizer.json does not say which is which.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[BOS]", "<|startoftext|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    bos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256 and EOS=257 (vocab_size 258)."""

    name = BYTE_SPEC
    vocab_size = 258
    bos_id = 256
    eos_id = 257
    file: Path | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library.

    ``encode`` adds no special tokens: documents are separated by EOS when data is prepared, so a
    post-processor that prepends BOS would only duplicate that.
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self.file = path
        self.name = tokenizer_name(str(path))
        try:
            self._tok = _RustTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises plain Exceptions for malformed JSON
            raise UserError(f"cannot load tokenizer file {path}: {exc}") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise UserError(
                f"tokenizer {path} has no end-of-text token (one of {', '.join(_EOS_CANDIDATES)}); "
                "add one as a special token so documents can be separated"
            )
        self.eos_id = eos
        self.bos_id = next((vocab[t] for t in _BOS_CANDIDATES if t in vocab), eos)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"tokenizer file {spec!r} does not exist; give 'byte' or the path of a local tokenizer.json"
        )
    return path


def tokenizer_name(spec: str) -> str:
    """The stable name ``build_tokenizer(spec).name`` would have, without loading the tokenizer."""
    if spec == BYTE_SPEC:
        return BYTE_SPEC
    return "file:" + _file_digest(_tokenizer_path(spec))[:16]


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` for the built-in byte tokenizer, else a path to a tokenizer.json (or its directory)."""
    if spec == BYTE_SPEC:
        return ByteTokenizer()
    return HFTokenizer(_tokenizer_path(spec))
