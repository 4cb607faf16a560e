"""The per-step cost of the sample record's token digest (relaytrain/data/consumption.py `tokens_digest`):
the train loader's `next_batch` with its sample record (the digest of the token windows read, the index
digest, the chain, the data fingerprint, the line) against `next_batch` with no record at all, in one
invocation, rounds alternating, on the bundled corpus prepared into a temporary directory; and the token
digest alone.

    python -m bench.sample_digest [--steps 200]
    python -m bench.sample_digest --page-from bench/results/sample_digest-<date>.json   # the section

Shapes: the debug config's (16 sequences of 128 tokens over one rank) and a large model's share (64
sequences of 2048 tokens). Prints one line per shape and keeps the figures in
bench/results/sample_digest-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

from relaytrain.data.consumption import SampleRecorder, tokens_digest
from relaytrain.data.loader import TrainLoader
from relaytrain.data.prepare import prepare_dataset
from relaytrain.data.shards import PreparedDataset
from relaytrain.data.sources import BUNDLED_CORPUS
from relaytrain.job import RunDir

from bench import kept
from bench.report import machine_info, table, write_page

SHAPES = ((16, 128), (64, 2048))  # (sequences per rank and step, seq_len)


def _loader(data: PreparedDataset, batch: int, seq_len: int, recorder: SampleRecorder | None) -> TrainLoader:
    return TrainLoader([data], [1.0], seq_len, batch, 0, 1, seed=0, shuffle=True, recorder=recorder)


def _round(loader: TrainLoader, steps: int, first_step: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        loader.next_batch(first_step + i)
    return (time.perf_counter() - start) / steps * 1e6


def measure(data: PreparedDataset, run: RunDir, batch: int, seq_len: int, steps: int) -> dict[str, float]:
    """Median over 5 alternating rounds of the microseconds a step takes with the record and without."""
    on = _loader(data, batch, seq_len, SampleRecorder(run, 0, f"bench{batch}x{seq_len}", 0, 1, 1))
    off = _loader(data, batch, seq_len, None)
    with_record, without = [], []
    for r in range(5):
        with_record.append(_round(on, steps, r * steps + 1))
        without.append(_round(off, steps, r * steps + 1))
    windows = np.zeros((batch, seq_len + 1), dtype=np.int64)
    start = time.perf_counter()
    for _ in range(steps):
        tokens_digest(windows)
    digest_us = (time.perf_counter() - start) / steps * 1e6
    on_us, off_us = statistics.median(with_record), statistics.median(without)
    digest_ratio = round((off_us + digest_us) / off_us, 4)
    return {"on_us": round(on_us, 1), "off_us": round(off_us, 1), "ratio": round(on_us / off_us, 4),
            "digest_alone_us": round(digest_us, 1), "digest_ratio": digest_ratio}  # fmt: skip


SECTION = "sample-digest"


def _where(data: dict) -> str:
    machine = data.get("machine") or {}
    if not machine:
        return "machine not recorded"
    return f"{machine.get('cpu')}, {machine.get('cores')} cores, load {machine.get('load_start')}"


def render(runs: list[dict], sources: list[str]) -> str:
    """The page's section from the kept results files, one table row per run and shape."""
    header = ["run", "sequences x tokens per rank", "without a record", "with the record", "ratio",
              "token digest alone", "its ratio"]  # fmt: skip
    rows = []
    for data, source in zip(runs, sources, strict=True):
        run = f"{source} ({data['date']}; {_where(data)}; {data['steps']} steps a round)"
        for shape, f in data["per_step"].items():
            ratios = (f"x{f['ratio']}", f["digest_alone_us"], f"x{f['digest_ratio']}")
            rows.append((run, shape.replace("x", " x "), f["off_us"], f["on_us"], *ratios))
    intro = (
        f"Rewritten from the kept results by `python -m bench.sample_digest --page-from {' '.join(sources)}`;"
        " each run measured by `python -m bench.sample_digest`, rounds alternating in one invocation. What "
        "`relaytrain verify` reads back costs the train loader's `next_batch` this much a step, on one rank "
        "(microseconds; each ratio is against no record; the token digest alone is what verify's data "
        "check reads back, the rest is the record's index digest, chain and line):"
    )
    outro = (
        "The ratios are of the loader's step alone, not of a training step (whose forward and backward "
        "take milliseconds to seconds): against a whole step the record is smaller still."
    )
    body = ["## The sample record's token digest", "", intro, "", table(header, rows), "", outro]
    return "\n".join(body) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--page-from", nargs="+", help="only write the section, from these kept results files"
    )
    args = parser.parse_args()
    if args.page_from:
        runs = [kept.load(path) for path in args.page_from]
        write_page({SECTION: render(runs, [kept.relative(path) for path in args.page_from])})
        return 0
    machine = machine_info()
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = PreparedDataset(prepare_dataset([str(BUNDLED_CORPUS)], Path(tmp) / "data", val_fraction=0.02))
        run = RunDir(Path(tmp) / "run")
        for batch, seq_len in SHAPES:
            figures[f"{batch}x{seq_len}"] = result = measure(data, run, batch, seq_len, args.steps)
            print(f"next_batch, {batch} x {seq_len} tokens per rank: {result['on_us']} us with the sample "
                  f"record, {result['off_us']} us without (x{result['ratio']}); the token digest alone "
                  f"{result['digest_alone_us']} us (x{result['digest_ratio']} of the step without a "
                  "record)")  # fmt: skip
    today = date.today().isoformat()
    stamp = time.strftime("%Y-%m-%d-%H%M")  # a second run the same day is kept beside the first
    results = {
        "command": "python -m bench.sample_digest",
        "date": today,
        "steps": args.steps,
        "machine": machine,
        "per_step": figures,
    }
    path = kept.save(f"sample_digest-{stamp}.json", results)
    print(f"kept: {kept.relative(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
