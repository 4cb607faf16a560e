"""In-memory snapshots: what a snapshot blocks of a training step, and how fast a large state is copied,
written to /dev/shm and read back.

    python bench/snapshot.py [--steps 12] [--state-gb 1.2]

1. The debug config (configs/debug.toml), one process, `checkpoint.snapshot_every=1`, against the same
   run without snapshots: the median step time of each and the median blocking time per snapshot
   (`snapshot_blocking_s` in metrics.jsonl), steps 3.. (the first ones warm up).
2. A state of `--state-gb` GB (fp32 tensors of 4 M elements, about a 100 M-parameter model with AdamW): the
   blocking copy into the reused host buffer (second and later snapshots), the background write to
   /dev/shm with its checksum, and reading and decoding it back (a restore from local memory).
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _train(work: Path, name: str, steps: int, every: int) -> list[dict]:
    args = [sys.executable, "-m", "relaytrain.cli", "train", str(REPO / "configs/debug.toml")]
    args += [f"--run.dir={work}", f"--run.name={name}", f"--train.max_steps={steps}", "--train.eval_every=0"]
    args += ["--checkpoint.interval=0", "--metrics.log_every=1", "--metrics.tensorboard=false"]
    args += [f"--checkpoint.snapshot_every={every}", f"--checkpoint.snapshot_dir={work / 'shm'}"]
    subprocess.run(args, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = (work / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train" and r["step"] >= 3]


def debug_model(steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plain = _train(work, "plain", steps, 0)
        snap = _train(work, "snap", steps, 1)
    blocking = [r["snapshot_blocking_s"] for r in snap[:-1]]  # the last step takes none
    return {
        "step_plain_s": statistics.median(r["time_step_s"] for r in plain),
        "step_snap_s": statistics.median(r["time_step_s"] for r in snap),
        "blocking_s": statistics.median(blocking),
        "blocking_max_s": max(blocking),
        "mb": snap[0]["snapshot_bytes"] / 1e6,
    }


def large_state(gb: float) -> dict[str, float]:
    import torch

    from relaytrain.checkpoint.snapshot import store
    from relaytrain.checkpoint.snapshot.format import Staging, decode

    count = max(1, int(gb * 1e9 / 4 / 4_000_000))
    tree = {"model": {f"t{i}": torch.randn(4_000_000) for i in range(count)}}
    staging = Staging()
    staging.stage(tree, {})  # the first one allocates the buffer
    started = time.perf_counter()
    staged = staging.stage(tree, {})
    blocking = time.perf_counter() - started
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        started = time.perf_counter()
        entry = store.write_snapshot(folder, 0, staged.chunks(), {"step": 1}, writer=0)
        written = time.perf_counter() - started
        started = time.perf_counter()
        data = store.read_verified(folder, 0, entry["checksum"])
        decode(data)
        restored = time.perf_counter() - started
    finally:
        shutil.rmtree(folder)
    return {"gb": staged.size / 1e9, "blocking_s": blocking, "write_s": written, "restore_s": restored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--state-gb", type=float, default=1.2)
    args = parser.parse_args()
    debug = debug_model(args.steps)
    large = large_state(args.state_gb)
    share = debug["blocking_s"] / debug["step_snap_s"]
    print("| measure | value |\n| --- | --- |")
    print(f"| debug config: step without snapshots (median) | {debug['step_plain_s']:.3f} s |")
    print(f"| debug config: step with `snapshot_every=1` (median) | {debug['step_snap_s']:.3f} s |")
    print(
        f"| debug config: blocking per snapshot, median (max) | {debug['blocking_s']:.4f} s "
        f"({debug['blocking_max_s']:.4f} s), {share:.1%} of the step, {debug['mb']:.1f} MB per rank |"
    )
    print(f"| {large['gb']:.2f} GB state: blocking copy into the host buffer | {large['blocking_s']:.3f} s |")
    written = f"{large['write_s']:.3f} s"
    print(f"| {large['gb']:.2f} GB state: write to /dev/shm with checksum (background) | {written} |")
    print(f"| {large['gb']:.2f} GB state: read, verify and decode (restore) | {large['restore_s']:.3f} s |")


if __name__ == "__main__":
    main()
