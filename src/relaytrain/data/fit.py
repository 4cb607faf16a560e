"""Whether a run's data can feed its model: checked with the config by `train`, `plan`, `launch` and
`doctor` before any work starts, so a preset never trains on the bundled toy corpus unnoticed.

Two refusals, each lifted by `data.allow_small = true`:
- the model's vocabulary is far larger than the tokenizer's: rows past the tokenizer's ids are never
  trained (a 128,256-entry Llama-3 model on the 258-id byte tokenizer);
- the planned tokens (train.max_steps x train.global_batch_size x train.seq_len) would read the
  training data more than MAX_EPOCHS times over.

Prepared sources tokenized by another tokenizer than data.tokenizer are refused too, as the ranks would
refuse them at their start (`sources.check_tokenizer`): a launch that leaves out data.tokenizer stops on
the login node, not in its job.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from relaytrain.config.schema import Config
from relaytrain.data.shards import META_NAME, PreparedDataset
from relaytrain.data.sources import BUNDLED_CORPUS, check_tokenizer
from relaytrain.data.tokenizer import BYTE_SPEC, build_tokenizer
from relaytrain.errors import ConfigError

# model.vocab_size may pad the tokenizer's vocabulary (to a multiple for tensor-parallel splits, or a
# small test model's round number), up to twice its size plus this; beyond, it is the wrong tokenizer.
VOCAB_PAD_IDS = 1024
MAX_EPOCHS = 100  # a run may read its training data at most this many times


def vocab_limit(tokenizer_vocab: int) -> int:
    """The largest model.vocab_size a tokenizer of `tokenizer_vocab` ids may fill."""
    return 2 * tokenizer_vocab + VOCAB_PAD_IDS


def planned_tokens(cfg: Config) -> int:
    t = cfg.train
    return t.max_steps * t.global_batch_size * t.seq_len


def _tokenizer_vocab(spec: str) -> int | None:
    if spec != BYTE_SPEC and not Path(spec).expanduser().exists():
        return None  # not here (a login node may not see it): the ranks check it where they start
    return build_tokenizer(spec).vocab_size


def _data_facts(cfg: Config) -> tuple[int | None, int | None, str, str]:
    """(the tokenizer's vocabulary, the training tokens, what the data is, which tokenizer), None where
    this machine cannot see it, without preparing anything.

    Prepared sources say both in their meta.json; the bundled corpus (tokenized on first use) holds at
    most one token per UTF-8 byte of its text. A source this machine cannot see (a login node, data only
    the nodes mount) is checked by `train` where the ranks start."""
    d = cfg.data
    tokenizer = f"data.tokenizer={d.tokenizer!r}"
    if d.sources:
        paths = [Path(s).expanduser() for s in d.sources]
        if not all((path / META_NAME).is_file() for path in paths):
            return _tokenizer_vocab(d.tokenizer), None, "data.sources", tokenizer
        datasets = [PreparedDataset(path) for path in paths]
        tokens = sum(ds.num_tokens("train") for ds in datasets)
        vocab = max(ds.vocab_size for ds in datasets)
        return vocab, tokens, "data.sources", "the tokenizer of data.sources"
    corpus_bytes = len(gzip.decompress(Path(BUNDLED_CORPUS).read_bytes()))
    return (
        _tokenizer_vocab(d.tokenizer),
        corpus_bytes,
        "the bundled corpus (data.sources is empty)",
        tokenizer,
    )


def _check_tokenizers(cfg: Config) -> None:
    """The ranks' tokenizer check on each prepared source, where this machine sees them and the tokenizer."""
    d = cfg.data
    paths = [Path(s).expanduser() for s in d.sources]
    if d.tokenizer != BYTE_SPEC and not Path(d.tokenizer).expanduser().exists():
        return
    for path in paths:
        if (path / META_NAME).is_file():
            check_tokenizer(d, path, PreparedDataset(path))


def check_data_fits(cfg: Config) -> None:
    """Raise a one-line ConfigError naming what does not fit and the fixes, unless data.allow_small."""
    _check_tokenizers(cfg)
    if cfg.data.allow_small:
        return
    vocab, tokens, what, tokenizer = _data_facts(cfg)
    problems = []
    limit = vocab_limit(vocab) if vocab is not None else None
    if limit is not None and cfg.model.vocab_size > limit:
        problems.append(
            f"model.vocab_size={cfg.model.vocab_size} but {tokenizer} has {vocab} "
            f"ids (at most 2 x {vocab} + {VOCAB_PAD_IDS} = {limit} allowed): set data.tokenizer to the "
            "model's tokenizer.json"
        )
    planned = planned_tokens(cfg)
    if tokens is not None and planned > MAX_EPOCHS * tokens:
        problems.append(
            f"the run plans {planned:,} tokens (train.max_steps x train.global_batch_size x train.seq_len) "
            f"but {what} holds about {tokens:,}: {planned / tokens:,.0f} epochs, over the {MAX_EPOCHS} "
            "allowed"
        )
    if problems:
        raise ConfigError(
            "; ".join(problems)
            + "; prepare your data with `relaytrain prepare-data INPUT --tokenizer TOKENIZER --out DIR` and "
            "set data.sources=[DIR] and data.tokenizer=TOKENIZER, or set data.allow_small=true for a toy run"
        )
