"""`relaytrain train-tokenizer`: a byte-level BPE trained with the `tokenizers` library on local text.

The sources are read as `relaytrain prepare-data` reads them (the same inputs, documents and
``--text-key``), and the file written is one that `prepare-data` and `data.tokenizer` accept: its
end-of-text token is one of the spellings `relaytrain.data.tokenizer` looks for (documents are separated
by it when data is prepared), and no other of those spellings is in the vocabulary to be taken for it.
Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from relaytrain.atomic import replacing
from relaytrain.data.readers import expand_inputs, read_documents
from relaytrain.data.tokenizer import _BOS_CANDIDATES, _EOS_CANDIDATES, build_tokenizer
from relaytrain.errors import UserError

DEFAULT_EOS = "<|endoftext|>"
BYTE_SYMBOLS = 256  # a byte-level BPE starts from one symbol per byte


def check_special_tokens(eos: str, bos: str | None, extra: list[str]) -> list[str]:
    """The special tokens in vocabulary order (EOS, BOS, the extra ones), or UserError."""
    if eos not in _EOS_CANDIDATES:
        raise UserError(
            f"--eos-token {eos!r} is not an end-of-text spelling; use one of {', '.join(_EOS_CANDIDATES)}"
        )
    if bos is not None and bos not in _BOS_CANDIDATES:
        raise UserError(
            f"--bos-token {bos!r} is not a begin-of-text spelling; use one of {', '.join(_BOS_CANDIDATES)}"
        )
    for token in extra:
        if token in _EOS_CANDIDATES or token in _BOS_CANDIDATES:
            raise UserError(
                f"--special-token {token!r} would be read as the end- or begin-of-text token; "
                "name it with --eos-token or --bos-token instead"
            )
        if not token.strip():
            raise UserError("--special-token must not be empty")
    tokens = [eos, *([bos] if bos else []), *extra]
    if len(set(tokens)) != len(tokens):
        raise UserError(f"special tokens given twice: {', '.join(tokens)}")
    return tokens


def minimum_vocab(special_tokens: list[str]) -> int:
    """The 256 byte symbols, the special tokens and at least one merge."""
    return BYTE_SYMBOLS + len(special_tokens) + 1


def _documents(entries, text_key: str) -> Iterator[str]:
    for path, kind in entries:
        for text, _ in read_documents(path, kind, text_key):
            if text:
                yield text


def train_tokenizer(
    inputs: list[str],
    out: str | Path,
    vocab_size: int,
    *,
    text_key: str = "text",
    eos_token: str = DEFAULT_EOS,
    bos_token: str | None = None,
    special_tokens: tuple[str, ...] | list[str] = (),
    min_frequency: int = 2,
) -> Path:
    """Train a byte-level BPE of at most ``vocab_size`` entries on ``inputs``; write it to ``out`` (a
    tokenizer.json path, or a directory to hold one) and return the file's path."""
    tokens = check_special_tokens(eos_token, bos_token, list(special_tokens))
    if vocab_size < minimum_vocab(tokens):
        raise UserError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE holds the {BYTE_SYMBOLS} byte symbols "
            f"and {len(tokens)} special token(s); use at least {minimum_vocab(tokens)}"
        )
    if min_frequency < 1:
        raise UserError(f"--min-frequency must be >= 1, got {min_frequency}")
    path = Path(out).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.exists():
        raise UserError(f"output {path} already exists; remove it or choose another --out")
    entries = expand_inputs(inputs)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = [0]

    def counted() -> Iterator[str]:
        for text in _documents(entries, text_key):
            seen[0] += 1
            yield text

    tok.train_from_iterator(counted(), trainer=trainer)
    if not seen[0]:
        raise UserError(f"no text in {', '.join(inputs)} (all documents empty); nothing to train on")
    with replacing(path, durable=False) as tmp:
        tok.save(str(tmp))
        build_tokenizer(str(tmp))  # the data pipeline reads it: an end-of-text token it recognises
    return path
