"""Documents from local inputs: .txt, .jsonl (optionally .gz), .parquet, and `datasets.save_to_disk` dirs.

Every reader yields ``(text, disk_bytes)`` pairs; ``disk_bytes`` is the share of the input's size on disk
that the document accounts for, so one progress bar can span mixed formats.

Text files hold documents separated by one or more blank lines (a line with only whitespace). A plain
directory stands for every supported file below it, in sorted order.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

from relaytrain.errors import UserError

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
_MISSING_DATA_EXTRA = "install the data extra: pip install 'relaytrain[data]'"


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if path.is_dir():
        return "hf-dataset" if _is_saved_dataset(path) else "dir"
    for kind, suffixes in (("txt", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    return None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def expand_inputs(inputs: list[str]) -> list[tuple[Path, str]]:
    """Resolve each input to ``(path, kind)`` pairs; a plain directory expands to its supported files."""
    out: list[tuple[Path, str]] = []
    for spec in inputs:
        path = Path(spec).expanduser()
        if not path.exists():
            raise UserError(f"input {spec!r} does not exist")
        kind = _kind(path)
        if kind is None:
            raise UserError(
                f"input {spec!r} has an unsupported type; use {', '.join(SUPPORTED)} files, a directory "
                "of them, or a directory written by datasets' save_to_disk"
            )
        if kind != "dir":
            out.append((path, kind))
            continue
        found = [(p, _kind(p)) for p in sorted(path.rglob("*")) if p.is_file() and _kind(p) is not None]
        if not found:
            raise UserError(
                f"directory {spec!r} has no {', '.join(SUPPORTED)} files and is not a datasets save_to_disk "
                "directory (no state.json or dataset_dict.json)"
            )
        out.extend(found)  # type: ignore[arg-type]
    return out


def _open_text(path: Path) -> tuple[io.TextIOBase, io.BufferedReader]:
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller through the returned text stream
    stream = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
    return io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline=None), raw


def _read_txt(path: Path) -> Iterator[tuple[str, float]]:
    text_stream, raw = _open_text(path)
    size, reported = path.stat().st_size, 0
    with text_stream:
        pending: list[str] = []

        def flush() -> str:
            doc = "".join(pending).strip("\n")
            pending.clear()
            return doc

        try:
            for line in text_stream:
                if line.strip() == "":
                    if pending:
                        doc = flush()
                        pos = raw.tell()
                        yield doc, pos - reported
                        reported = pos
                    continue
                pending.append(line)
        except UnicodeDecodeError as exc:
            raise UserError(f"{path} is not valid UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        if pending:
            yield flush(), size - reported


def _read_jsonl(path: Path, text_key: str) -> Iterator[tuple[str, float]]:
    text_stream, raw = _open_text(path)
    size, reported = path.stat().st_size, 0
    with text_stream:
        try:
            for lineno, line in enumerate(text_stream, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
                if not isinstance(record, dict) or text_key not in record:
                    keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                    raise UserError(
                        f"{path}:{lineno}: no {text_key!r} field (found: {keys}); choose one with --text-key"
                    )
                text = record[text_key]
                if text is not None and not isinstance(text, str):
                    raise UserError(f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, not text")
                pos = raw.tell()
                yield text or "", pos - reported
                reported = pos
        except UnicodeDecodeError as exc:
            raise UserError(f"{path} is not valid UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if size > reported:
        yield "", size - reported


def _check_column(path: Path, names: list[str], text_key: str) -> None:
    if text_key not in names:
        raise UserError(f"{path} has no column {text_key!r} (columns: {', '.join(names)}); use --text-key")


def _read_parquet(path: Path, text_key: str) -> Iterator[tuple[str, float]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise UserError(f"reading {path} needs pyarrow; {_MISSING_DATA_EXTRA}") from exc
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for corrupt files
        raise UserError(f"cannot read parquet file {path}: {exc}") from exc
    _check_column(path, pf.schema_arrow.names, text_key)
    rows = max(1, pf.metadata.num_rows)
    per_row = path.stat().st_size / rows
    for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise UserError(f"{path}: column {text_key!r} holds {type(text).__name__}, not text")
            yield text or "", per_row


def _read_saved_dataset(path: Path, text_key: str) -> Iterator[tuple[str, float]]:
    try:
        import datasets
    except ImportError as exc:
        raise UserError(f"reading the saved dataset {path} needs datasets; {_MISSING_DATA_EXTRA}") from exc
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError/ValueError subclasses for bad dirs
        raise UserError(f"cannot load saved dataset {path}: {exc}") from exc
    # A DatasetDict contributes every split, in name order: relaytrain makes its own validation split.
    splits = [loaded[k] for k in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) else [loaded]
    disk = sum(p.stat().st_size for p in path.rglob("*.arrow"))
    rows = max(1, sum(len(s) for s in splits))
    for split in splits:
        _check_column(path, list(split.column_names), text_key)
        column = split.select_columns([text_key])
        for batch in column.iter(batch_size=1024):
            for text in batch[text_key]:
                if text is not None and not isinstance(text, str):
                    raise UserError(f"{path}: column {text_key!r} holds {type(text).__name__}, not text")
                yield text or "", disk / rows


def input_size(path: Path, kind: str) -> int:
    if kind == "hf-dataset":
        return sum(p.stat().st_size for p in path.rglob("*.arrow"))
    return path.stat().st_size


def read_documents(path: Path, kind: str, text_key: str) -> Iterator[tuple[str, float]]:
    """Yield ``(text, disk_bytes)`` for each document of one input; empty documents come as ``""``."""
    if kind == "txt":
        return _read_txt(path)
    if kind == "jsonl":
        return _read_jsonl(path, text_key)
    if kind == "parquet":
        return _read_parquet(path, text_key)
    return _read_saved_dataset(path, text_key)
