"""Tokenize local text into a prepared dataset directory, in parallel, written atomically.

Documents are read in the main process, tokenized in chunks by a process pool (results come back in
input order, so the output is identical for any ``workers``), and appended to train/val shards. The
validation split is by document: document ``i`` (counting non-empty documents over all inputs in order)
goes to val when ``round((i + 1) * f)`` exceeds ``round(i * f)``, so exactly a fraction ``f`` of the
documents, spread evenly, lands there. Everything is written to a temporary sibling directory that is
renamed to ``--out`` only when complete, so a crash leaves nothing half-written at ``--out``.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import socket
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from relaytrain.data.readers import expand_inputs, input_size, read_documents
from relaytrain.data.shards import FORMAT_NAME, FORMAT_VERSION, META_NAME, ShardWriter, dtype_for_vocab
from relaytrain.data.tokenizer import build_tokenizer
from relaytrain.errors import UserError
from relaytrain.job import marks

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_FRACTION = 0.005
_CHUNK_CHARS = 1 << 20
_CHUNK_DOCS = 4096

_worker_tokenizer = None  # set per worker process by _init_worker


def is_val_document(index: int, val_fraction: float) -> bool:
    return math.floor((index + 1) * val_fraction + 0.5) > math.floor(index * val_fraction + 0.5)


def _init_worker(spec: str, quiet_rust_threads: bool) -> None:
    global _worker_tokenizer
    if quiet_rust_threads:
        # Each pool process is one CPU's worth of work; the Rust thread pool would oversubscribe.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = build_tokenizer(spec)


def _encode_documents(tokenizer, texts: list[str], dtype: np.dtype) -> np.ndarray:
    """Token ids of ``texts``, each document followed by EOS, as one flat array."""
    if not texts:
        return np.zeros(0, dtype=dtype)
    if tokenizer.name == "byte":
        encoded = [t.encode("utf-8") for t in texts]
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(dtype)
        ends = np.cumsum([len(b) for b in encoded])
        return np.insert(flat, ends, tokenizer.eos_id).astype(dtype, copy=False)
    ids = tokenizer.encode_batch(texts)
    total = sum(len(x) for x in ids) + len(ids)
    out = np.empty(total, dtype=dtype)
    pos = 0
    for doc in ids:
        out[pos : pos + len(doc)] = doc
        out[pos + len(doc)] = tokenizer.eos_id
        pos += len(doc) + 1
    return out


def _tokenize_chunk(job: tuple[int, list[str], float, str]) -> tuple[np.ndarray, int, np.ndarray, int]:
    first_index, texts, val_fraction, dtype_str = job
    dtype = np.dtype(dtype_str)
    train, val = [], []
    for i, text in enumerate(texts):
        (val if is_val_document(first_index + i, val_fraction) else train).append(text)
    return (
        _encode_documents(_worker_tokenizer, train, dtype),
        len(train),
        _encode_documents(_worker_tokenizer, val, dtype),
        len(val),
    )


def _chunks(entries, text_key: str) -> Iterator[tuple[list[str], float]]:
    texts: list[str] = []
    chars, disk = 0, 0.0
    for path, kind in entries:
        for text, size in read_documents(path, kind, text_key):
            disk += size
            if not text.strip():
                continue
            texts.append(text)
            chars += len(text)
            if chars >= _CHUNK_CHARS or len(texts) >= _CHUNK_DOCS:
                yield texts, disk
                texts, chars, disk = [], 0, 0.0
    if texts or disk:
        yield texts, disk


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("tokenizing"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[docs]:,} docs {task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


def _tokenized(
    spec: str, chunks: Iterator[tuple[list[str], float]], workers: int, val_fraction: float, dtype
):
    """Yield ``(tokenized chunk, its bytes on disk)`` in input order.

    With ``workers > 1`` the chunks go to a process pool through a window of at most ``2 * workers``
    chunks in flight, submitted and collected by this thread alone: no feeder thread iterates the
    input, so when the consumer fails the generator is closed here, queued chunks are cancelled and
    only the few running ones are waited for (``multiprocessing.Pool.terminate`` could deadlock on its
    task queue's lock when a worker sat idle holding it)."""
    if workers <= 1:
        _init_worker(spec, False)
        index = 0
        for texts, disk in chunks:
            yield _tokenize_chunk((index, texts, val_fraction, dtype.str)), disk
            index += len(texts)
        return
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # fork would copy Rust tokenizer threads and locks
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(spec, True))
    window: deque = deque()
    try:
        index = 0
        for texts, disk in chunks:
            window.append((pool.submit(_tokenize_chunk, (index, texts, val_fraction, dtype.str)), disk))
            index += len(texts)
            if len(window) >= 2 * workers:
                future, size = window.popleft()
                yield future.result(), size
        while window:
            future, size = window.popleft()
            yield future.result(), size
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _write_shards(tmp: Path, spec: str, entries, dtype: np.dtype, args: dict, progress: bool) -> dict:
    writers = {s: ShardWriter(tmp, s, dtype, args["shard_tokens"]) for s in ("train", "val")}
    total = sum(input_size(p, k) for p, k in entries)
    chunks = _chunks(entries, args["text_key"])
    jobs = _tokenized(spec, chunks, args["workers"], args["val_fraction"], dtype)
    try:
        with _progress(progress) as bar:
            task = bar.add_task("tokenize", total=total, docs=0, tokens=0)
            docs = tokens = 0
            for (train, n_train, val, n_val), disk in jobs:
                writers["train"].write(train, n_train)
                writers["val"].write(val, n_val)
                docs, tokens = docs + n_train + n_val, tokens + len(train) + len(val)
                bar.update(task, advance=disk, docs=docs, tokens=tokens)
                marks.mark()  # a corpus prepared at a run's set-up: progress for the hang monitor
    finally:
        jobs.close()  # a failed write: cancel what is queued, wait for what runs
    return {s: w.finish() for s, w in writers.items()}


def prepare_dataset(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    workers: int = 1,
    text_key: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = False,
    exist_ok: bool = False,
) -> Path:
    """Tokenize ``inputs`` into the prepared dataset directory ``out`` and return its path.

    With ``exist_ok``, an ``out`` that already holds a prepared dataset (perhaps written concurrently
    by another process) is accepted as is; otherwise an existing non-empty ``out`` is an error.
    """
    out = Path(out).expanduser()
    if (out / META_NAME).is_file() and exist_ok:
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output {out} already exists; remove it or choose another --out")
    if not inputs:
        raise UserError("no inputs given; name .txt, .jsonl, .parquet files or dataset directories")
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if workers < 1 or shard_tokens < 1:
        raise UserError(f"--workers and --shard-tokens must be >= 1, got {workers} and {shard_tokens}")
    tok = build_tokenizer(tokenizer)
    entries = expand_inputs(inputs)
    dtype = dtype_for_vocab(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        args = {
            "workers": workers,
            "val_fraction": val_fraction,
            "text_key": text_key,
            "shard_tokens": shard_tokens,
        }
        splits = _write_shards(tmp, tokenizer, entries, dtype, args, progress)
        if splits["train"]["tokens"] == 0:
            raise UserError(
                f"no training text in {', '.join(inputs)} (all documents empty, or all went to the "
                f"validation split with --val-fraction {val_fraction})"
            )
        if tok.file is not None:
            shutil.copyfile(tok.file, tmp / "tokenizer.json")
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "tokenizer": tok.name,
            "tokenizer_file": "tokenizer.json" if tok.file is not None else None,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id,
            "splits": splits,
            "inputs": [str(p) for p, _ in entries],
            "text_key": text_key,
            "val_fraction": val_fraction,
            "document_separator": "eos",
        }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if exist_ok and (out / META_NAME).is_file():
                shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same work first
                return out
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
