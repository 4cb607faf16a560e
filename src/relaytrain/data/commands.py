"""`relaytrain prepare-data`: tokenize local text files into a prepared dataset directory."""

from __future__ import annotations

import argparse
import os

from relaytrain.data.prepare import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, prepare_dataset
from relaytrain.data.shards import PreparedDataset


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize .txt/.jsonl/.parquet files or a saved HF dataset into token shards",
        description=(
            "Tokenize local text into a prepared dataset directory (token shards + meta.json) that "
            "data.sources can name. .txt files hold documents separated by blank lines; .jsonl and "
            ".parquet rows and saved datasets take their text from --text-key. Documents are joined "
            "with EOS, and a deterministic fraction of them forms the validation split."
        ),
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".txt, .jsonl (also .gz), .parquet files, directories of them, or a save_to_disk dir",
    )
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--tokenizer", default="byte", help="'byte' or the path of a local tokenizer.json")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help="fraction of documents in the validation split (default %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="tokenizing processes (default %(default)s)",
    )
    p.add_argument("--text-key", default="text", help="JSON field / column holding the text")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help="tokens per shard file (default %(default)s)",
    )
    p.set_defaults(func=run_prepare_data)
    register_train_tokenizer(subparsers)


def register_train_tokenizer(subparsers) -> None:
    from relaytrain.data.bpe import DEFAULT_EOS

    p = subparsers.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE tokenizer.json on local text (for prepare-data --tokenizer)",
        description=(
            "Train a byte-level BPE with the tokenizers library on the same inputs prepare-data reads, "
            "and write a tokenizer.json whose end-of-text token separates documents when data is prepared."
        ),
    )
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="as for prepare-data: files, directories of them"
    )
    p.add_argument("--out", required=True, help="the tokenizer.json to write (or a directory to hold it)")
    p.add_argument(
        "--vocab-size", type=int, required=True, help="entries, with the 256 bytes and special tokens"
    )
    p.add_argument("--text-key", default="text", help="JSON field / column holding the text")
    p.add_argument("--eos-token", default=DEFAULT_EOS, help="the end-of-text token (default %(default)s)")
    p.add_argument("--bos-token", default=None, help="a begin-of-text token (default: none; BOS is then EOS)")
    p.add_argument(
        "--special-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="a further special token (repeatable)",
    )
    p.add_argument("--min-frequency", type=int, default=2, help="pairs seen fewer times are not merged")
    p.set_defaults(func=run_train_tokenizer)


def run_train_tokenizer(args: argparse.Namespace) -> int:
    from relaytrain.data.bpe import train_tokenizer
    from relaytrain.data.tokenizer import build_tokenizer

    path = train_tokenizer(
        args.inputs,
        args.out,
        args.vocab_size,
        text_key=args.text_key,
        eos_token=args.eos_token,
        bos_token=args.bos_token,
        special_tokens=args.special_token,
        min_frequency=args.min_frequency,
    )
    tok = build_tokenizer(str(path))
    print(f"trained {path}: vocab {tok.vocab_size}, end-of-text {args.eos_token} (id {tok.eos_id})")
    print(f"prepare data with: relaytrain prepare-data {' '.join(args.inputs)} --tokenizer {path} --out DIR")
    return 0


def run_prepare_data(args: argparse.Namespace) -> int:
    out = prepare_dataset(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        workers=args.workers,
        text_key=args.text_key,
        shard_tokens=args.shard_tokens,
        progress=True,
    )
    ds = PreparedDataset(out)
    train, val = ds.meta["splits"]["train"], ds.meta["splits"]["val"]
    print(
        f"prepared {out}: train {train['tokens']:,} tokens / {train['documents']:,} docs, "
        f"val {val['tokens']:,} tokens / {val['documents']:,} docs, "
        f"tokenizer {ds.tokenizer_name} (vocab {ds.vocab_size}, {ds.dtype.name})"
    )
    print(
        f"use it with: --data.sources='[\"{out}\"]'"
        + (f" --data.tokenizer={ds.tokenizer_file}" if ds.tokenizer_file else "")
        + f" --model.vocab_size={ds.vocab_size}"  # at least the tokenizer's; the model may have more
    )
    return 0
