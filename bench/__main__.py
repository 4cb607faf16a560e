"""`python -m bench`: run every benchmark and rewrite the sections of docs/benchmarks.md they own.

    python -m bench                  # full run (~5-10 min on 2 cores), rewrites docs/benchmarks.md
    python -m bench --quick          # ~2 min smoke run, writes bench/out/benchmarks.md instead
    python -m bench --only overhead,startup [--page PATH] [--no-write]
    python -m bench --render-only    # re-render the last results (bench/out/results.json), no measuring

Raw results go to bench/out/results.json. A section that fails keeps its previous text on the page; the
run then exits 1 after writing the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import checkpoint_section, gpu_mfu, kept, matmul_peak, overhead, startup, torchtitan_gpu
from bench.procs import WORK
from bench.report import PAGE, load_average, machine_info, merge_page, render_machine, write_page

# "checkpoint-io" is the checkpoint work's own analysis; the runner adds "checkpoint-io-run" after it.
ORDER = [
    "usage",
    "machine",
    "matmul-peak",
    "overhead",
    "startup",
    "checkpoint-io",
    "checkpoint-io-run",
    "torchtitan",
    "gpu",
]
LINKS = "links"


@dataclass
class Plan:
    quick: bool
    threads: int
    peak_flops: float | None = None


def _matmul(plan: Plan) -> tuple[dict, str]:
    result = matmul_peak.measure(seconds=2.0, quick=plan.quick)
    plan.peak_flops = result["cpu_peak_flops"]
    return result, matmul_peak.render(result)


def _overhead(plan: Plan) -> tuple[dict, str]:
    if plan.peak_flops is None:
        plan.peak_flops = matmul_peak.measure(seconds=1.0, quick=plan.quick)["cpu_peak_flops"]
    kwargs = {"pairs": 1, "steps": 10, "warmup": 3} if plan.quick else {"pairs": 6, "steps": 20, "warmup": 4}
    result = overhead.measure(**kwargs, threads=plan.threads, peak_flops=plan.peak_flops)
    return result, overhead.render(result)


def _startup(plan: Plan) -> tuple[dict, str]:
    result = startup.measure(repeats=1 if plan.quick else 3, threads=plan.threads)
    return result, startup.render(result)


def _checkpoint(plan: Plan) -> tuple[dict, str] | None:
    if not checkpoint_section.available():
        return None  # the checkpoint benchmark script is not in this checkout; keep the page's text
    result = checkpoint_section.measure(quick=plan.quick, threads=plan.threads)
    return result, checkpoint_section.render(result)


def _torchtitan(plan: Plan) -> tuple[dict, str]:
    if not torchtitan_gpu.can_run():
        result = torchtitan_gpu.not_run()
    else:  # a GPU run's figures are kept with the page (bench/kept.py)
        result = kept.keep_gpu_run("torchtitan", torchtitan_gpu.measure())
    return result, torchtitan_gpu.render(result)


def _gpu(plan: Plan) -> tuple[dict, str]:
    if not torch.cuda.is_available():
        result = gpu_mfu.not_run()
    elif plan.quick:  # a smoke run, not a figure
        result = gpu_mfu.measure(quick=True)
    else:
        result = kept.keep_gpu_run("gpu-mfu", gpu_mfu.measure())
    return result, gpu_mfu.render(result)


SECTIONS: dict[str, Callable[[Plan], tuple[dict, str] | None]] = {
    "matmul-peak": _matmul,
    "overhead": _overhead,
    "startup": _startup,
    "checkpoint-io-run": _checkpoint,
    "torchtitan": _torchtitan,
    "gpu": _gpu,
}


# `--only checkpoint-io` is how the checkpoint issue names the run; its block on the page is the analysis.
ALIASES = {"checkpoint-io": "checkpoint-io-run"}


RENDERERS: dict[str, Callable[[dict], str]] = {
    "matmul-peak": matmul_peak.render,
    "overhead": overhead.render,
    "startup": startup.render,
    "checkpoint-io-run": checkpoint_section.render,
    "torchtitan": torchtitan_gpu.render,
    "gpu": gpu_mfu.render,
}


def render_saved(results: dict) -> dict[str, str]:
    """Every section of a saved results.json, rendered again (after a change to the page's wording)."""
    sections = {name: render(results[name]) for name, render in RENDERERS.items() if name in results}
    if all(name in results for name in SECTIONS):
        sections["machine"] = render_machine(results["machine"], results["command"], results.get("load_end"))
        sections[LINKS] = links_section()
    sections["usage"] = usage_section()
    return sections


def usage_section() -> str:
    return (
        "## How to run\n\n"
        "```sh\n"
        "python -m bench            # everything (~5-10 min on 2 cores); rewrites this page\n"
        "bench/run.sh               # the same\n"
        "python -m bench --quick    # ~2 min smoke run; writes bench/out/benchmarks.md, not this page\n"
        "python -m bench --only overhead,startup   # a subset; other sections stay as they are\n"
        "python -m bench.overhead --pairs=4 --model.dim=512   # one benchmark, any config override\n"
        "```\n\n"
        "Sections: `matmul-peak` (bench/matmul_peak.py), `overhead` (bench/overhead.py, "
        "bench/plain_loop.py, bench/step_ab.py), `startup` (bench/startup.py), `checkpoint-io-run` "
        "(bench/checkpoint_io.py via bench/checkpoint_section.py), `torchtitan` "
        "(bench/torchtitan_gpu.py), `gpu` (bench/gpu_mfu.py). "
        "Raw results of the last run: bench/out/results.json (not committed). A section that fails keeps "
        "its previous text and the run exits 1. Each figure names the command that produced it. Runs are "
        "separate processes with `OMP_NUM_THREADS` = cores unless `--threads` says otherwise.\n\n"
        "On a machine with CUDA GPUs, run `bench/gpu_first_hour.sh` first (it needs no network and no "
        "installed console script; it is `python -m bench.gpu_first_hour`): in order it prints the versions "
        "and the device, measures the bf16 matmul peak, runs a single-GPU smoke run, saves sync and async "
        "and resumes from each, takes snapshots of a 0.4 B-parameter state and reports their blocking time, "
        "compiles a model deeper than Dynamo's recompile limit with recompiles logged, runs "
        "`python -m bench.gpu_mfu`, and on a node with 2 to 8 GPUs runs the FSDP, TP, PP, HSDP, CP and "
        "snapshot layouts under torchrun with their losses compared at the last step. It writes the "
        "`gpu-first-hour` section (with the date and the device; each step's figures and what to look for) "
        "and the `gpu` section of this page; `--only smoke,resume` runs a subset, `--no-write` leaves the "
        "page alone. Without a GPU it says so in one line and exits 0.\n"
    )


def links_section() -> str:
    return (
        "## Elsewhere\n\n"
        "- Throughput of every parallel layout (FSDP2, HSDP, TP, PP, ...) on CPU/gloo: "
        "[docs/parallelism.md](parallelism.md), measured by `python bench/parallel_layouts.py` "
        "(not part of `python -m bench`: it launches torchrun for each layout group).\n"
        '- Real Slurm jobs end to end: the "Slurm end to end" section of this page, measured on the local '
        "Slurm cluster (docs/local-cluster.md) with the commands it names; `python -m bench` keeps it as it "
        "is, like the checkpoint section's analysis above.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short smoke run (~2 min)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(SECTIONS)}")
    parser.add_argument("--page", type=Path, default=None, help="page to rewrite (default: see above)")
    parser.add_argument("--no-write", action="store_true", help="print the sections instead of writing")
    parser.add_argument(
        "--render-only", action="store_true", help="measure nothing: render bench/out/results.json again"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="threads per measured process (default: cores)"
    )
    args = parser.parse_args(argv)

    names = [ALIASES.get(n.strip(), n.strip()) for n in args.only.split(",") if n.strip()] or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    page = args.page or (WORK / "benchmarks.md" if args.quick else PAGE)
    if args.quick and args.page is None and PAGE.exists() and not page.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        page.write_text(PAGE.read_text())  # a quick run previews the whole page without touching docs/

    order = [*ORDER, LINKS]
    if args.render_only:
        saved = json.loads((WORK / "results.json").read_text())
        return publish(render_saved(saved), order, page, args.no_write, failed=[])

    plan = Plan(quick=args.quick, threads=args.threads or os.cpu_count() or 1)
    command = (
        "python -m bench" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    )
    info = machine_info()
    results: dict = {"machine": info, "command": command}
    sections: dict[str, str] = {}
    failed: list[str] = []
    for name in names:
        started = time.perf_counter()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            outcome = SECTIONS[name](plan)
        except Exception:  # one broken benchmark must not cost the others their figures
            failed.append(name)
            print(f"[bench] {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        if outcome is None:
            print(f"[bench] {name}: skipped (not available)", file=sys.stderr)
            continue
        results[name], sections[name] = outcome
        print(f"[bench] {name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    results["load_end"] = load_average()
    if set(names) == set(SECTIONS):
        sections["machine"] = render_machine(info, command, results["load_end"])
        sections[LINKS] = links_section()
    sections["usage"] = usage_section()
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "results.json").write_text(json.dumps(results, indent=1))
    return publish(sections, order, page, args.no_write, failed)


def publish(sections: dict[str, str], order: list[str], page: Path, no_write: bool, failed: list[str]) -> int:
    if no_write:
        old = page.read_text() if page.exists() else ""
        print(merge_page(old, sections, order))
    else:
        page.parent.mkdir(parents=True, exist_ok=True)
        write_page(sections, order, page)
        print(f"[bench] wrote {page} ({', '.join(sections) or 'nothing'})", file=sys.stderr)
    if failed:
        print(f"[bench] failed: {', '.join(failed)} (their previous text is kept)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
