"""Tokens/s of the tiny model (dim 64, 4 layers, vocab 256, seq 32, global batch 8) per parallel layout.

Usage: python bench/parallel_layouts.py [--steps 10] [--compile]
Runs the one-process layouts in this process and the others under `torchrun --standalone` (gloo, CPU),
running the layouts listed in tests/parallel_cases.py (LAYOUTS, shared with the parity tests), and
prints a Markdown table (median step after the first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
WORKER = TESTS / "parallel_cases.py"


def run_torchrun(nproc: int, cases: list[str], steps: int, workdir: str) -> list[dict]:
    env = dict(
        os.environ,
        PARALLEL_CASES_STEPS=str(steps),
        OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CACHE_DIR=os.path.join(workdir, "inductor"),
    )
    proc = subprocess.run(
        ["torchrun", "--standalone", f"--nproc_per_node={nproc}", str(WORKER), *cases],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time fsdp_compile (inductor, slow cold)")
    args = parser.parse_args()
    os.environ["PARALLEL_CASES_STEPS"] = str(args.steps)
    sys.path.insert(0, str(TESTS))
    import torch

    from parallel_cases import BENCH_OPT_IN, LAYOUTS, run_case

    torch.set_num_threads(1)  # as each torchrun rank; the machine is 2 cores
    rows = [(1, run_case(name, 1, 0, 1)) for name in LAYOUTS[1]]
    with tempfile.TemporaryDirectory() as workdir:
        for nproc in (2, 4):
            cases = [case for case in LAYOUTS[nproc] if args.compile or case not in BENCH_OPT_IN]
            rows += [(nproc, r) for r in run_torchrun(nproc, cases, args.steps, workdir)]
    print(
        f"{date.today()} on {platform.node()}: {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"{args.steps} steps, median step after the first"
    )
    print("| processes | layout | step (s) | tokens/s |\n| --- | --- | --- | --- |")
    for nproc, r in rows:
        print(f"| {nproc} | {r['case']} | {r['steady_step_s']:.3f} | {r['tokens_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
