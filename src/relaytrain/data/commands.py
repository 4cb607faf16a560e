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
