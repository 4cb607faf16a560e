"""The per-step cost of the sample record (relaytrain/data/consumption.py): what the train loader adds to
each step for `relaytrain verify` - the digest of the slice read, the next sample chain and one appended
line - timed alone, for a small and a large per-rank batch.

    python -m bench.sample_record [--steps 5000]

Prints one line per batch size and keeps the figures in bench/results/sample_record-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

from relaytrain.data.consumption import Consumed, SampleRecorder, chain_next, range_digest
from relaytrain.job import RunDir

from bench import kept

BATCHES = (8, 1024)  # sequences per rank and step: the debug config's, and a large model's


def per_step_us(local_batch: int, steps: int, run: RunDir) -> float:
    """Median over 5 rounds of the mean cost of one step's record, microseconds."""
    recorder = SampleRecorder(run, 0, f"bench{local_batch}", 0, 8)
    global_batch, chain = local_batch * 8, "start"
    rounds = []
    for r in range(5):
        start = time.perf_counter()
        for i in range(steps):
            step = r * steps + i + 1
            first = (step - 1) * global_batch
            after = chain_next(chain, first, global_batch)
            digest = range_digest(first, local_batch)
            recorder.record(step, Consumed(first, local_batch, digest, chain, after))
            chain = after
        rounds.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp))
        figures = {str(b): round(per_step_us(b, args.steps, run), 2) for b in BATCHES}
    for batch, us in figures.items():
        print(f"sample record, {batch} sequences per rank: {us} us per step")
    today = date.today().isoformat()
    results = {"command": "python -m bench.sample_record", "date": today, "us_per_step": figures}
    path = kept.save(f"sample_record-{today}.json", results)
    print(f"kept: {kept.relative(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
