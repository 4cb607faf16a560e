"""Which prepared datasets a run reads: the configured ones, or the bundled corpus prepared on first use."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from pathlib import Path

from relaytrain.config.schema import DataConfig
from relaytrain.data.prepare import prepare_dataset
from relaytrain.data.shards import FORMAT_VERSION, PreparedDataset
from relaytrain.data.tokenizer import tokenizer_name
from relaytrain.errors import UserError

CORPUS_DIR = Path(__file__).parent / "corpus"
BUNDLED_CORPUS = CORPUS_DIR / "stdlib_docs.txt.gz"
# 2% of ~7,200 paragraphs: ~20 kB of validation text, enough for stable evaluation of a small model.
BUNDLED_VAL_FRACTION = 0.02


def bundled_cache_dir(data: DataConfig, runs_dir: str | Path) -> Path:
    """Where the bundled corpus tokenized with `data.tokenizer` is cached: under `runs_dir` (run.dir)."""
    h = hashlib.sha256()
    h.update(BUNDLED_CORPUS.read_bytes())
    h.update(f"|{tokenizer_name(data.tokenizer)}|v{FORMAT_VERSION}".encode())
    return Path(runs_dir).expanduser() / ".cache" / f"bundled-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Serialize same-node preparers; where flock is unsupported the atomic rename still keeps it safe."""
    with open(lock_path, "a+") as f:
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def prepare_bundled(data: DataConfig, runs_dir: str | Path) -> Path:
    """The bundled corpus tokenized with ``data.tokenizer``, prepared once per cache directory.

    Safe when many ranks start at once: each either finds ``meta.json``, or prepares under a file lock
    into its own temporary directory that is renamed into place; losers of a rename race use the winner's.
    """
    out = bundled_cache_dir(data, runs_dir)
    if (out / "meta.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out.parent / f"{out.name}.lock"):
        return prepare_dataset(
            [str(BUNDLED_CORPUS)],
            out,
            tokenizer=data.tokenizer,
            val_fraction=BUNDLED_VAL_FRACTION,
            exist_ok=True,
        )


def resolve_sources(data: DataConfig, *, vocab_size: int, runs_dir: str | Path) -> list[Path]:
    """Prepared dataset directories for this run, checked against ``data`` and the model's ``vocab_size``.

    `runs_dir` (run.dir) holds the bundled corpus's cache when ``data.sources`` is empty.
    """
    if data.sources:
        paths = [Path(s).expanduser() for s in data.sources]
    else:
        paths = [prepare_bundled(data, runs_dir)]
    if data.weights and len(data.weights) != len(paths):
        raise UserError(
            f"data.weights has {len(data.weights)} entries but data.sources has {len(paths)}; "
            "give one weight per source"
        )
    for path in paths:
        ds = PreparedDataset(path)  # raises a UserError naming the path and prepare-data when not prepared
        check_tokenizer(data, path, ds)
        if ds.vocab_size > vocab_size:
            raise UserError(
                f"{path} has vocab_size {ds.vocab_size} but model.vocab_size is {vocab_size}; "
                f"set model.vocab_size >= {ds.vocab_size}"
            )
    return paths


def check_tokenizer(data: DataConfig, path: Path, ds: PreparedDataset) -> None:
    """One line when the prepared dataset at `path` was tokenized by another tokenizer than data.tokenizer
    (the ranks at their start, and `relaytrain.data.fit` before a run is planned or launched)."""
    expected = tokenizer_name(data.tokenizer)
    if ds.tokenizer_name == expected:
        return
    hint = (
        f"set data.tokenizer to {ds.tokenizer_file}"
        if ds.tokenizer_file is not None
        else 'set data.tokenizer = "byte"'
    )
    ours = repr(data.tokenizer)
    if data.tokenizer != expected:  # a file: name the tokenizer it holds
        ours += f" (that is {expected!r})"
    raise UserError(
        f"{path} was prepared with tokenizer {ds.tokenizer_name!r} but data.tokenizer is {ours}; "
        f"{hint}, or prepare the data with the same tokenizer"
    )
