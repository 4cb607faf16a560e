"""`python -m bench`: run every benchmark and rewrite the sections of docs/benchmarks.md they own.

    python -m bench                  # full run (~5-10 min on 2 cores), rewrites docs/benchmarks.md
    python -m bench --quick          # ~2 min smoke run, writes bench/out/benchmarks.md instead
    python -m bench --only overhead,startup [--page PATH] [--no-write]
    python -m bench --page-from bench/results/bench-<date>-<time>.json ...   # measure nothing: rewrite
                                     # the CPU sections from kept results only (--render-only: all of them)

Each run keeps its raw results as bench/results/bench-<UTC date>-<time>.json (a second run the same day is
kept beside the first; bench/out/results.json holds a copy of the last), and the sections `machine`,
`matmul-peak`, `overhead`, `startup`, `progress-marks` and `checkpoint-io-run` are rendered from every kept
run, the latest first, each section naming its files and the command that rewrites it (`--page-from`), so
tests/test_bench_pages.py rebuilds them byte for byte. A section that fails keeps its previous text on the
page; the run then exits 1 after writing the others. A GPU section that did not run (no GPU) is left as it
is on the page.
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

from bench import (
    checkpoint_section,
    gpu_mfu,
    kept,
    matmul_peak,
    overhead,
    progress_marks,
    startup,
    torchtitan_gpu,
)
from bench.procs import WORK
from bench.report import (
    PAGE,
    load_average,
    machine_info,
    merge_page,
    page_path,
    render_machine,
    write_page,
)

# "checkpoint-io" is the checkpoint work's own analysis; the runner adds "checkpoint-io-run" after it.
ORDER = [
    "usage",
    "machine",
    "matmul-peak",
    "overhead",
    "startup",
    "progress-marks",
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


def _progress_marks(plan: Plan) -> tuple[dict, str]:
    steps = 10 if plan.quick else 30
    result = progress_marks.measure(steps=steps, threads=plan.threads)
    result["tensor_parallel"] = progress_marks.measure(steps, plan.threads, overrides=["--parallel.tp=2"])
    return result, progress_marks.render(result)


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
    "progress-marks": _progress_marks,
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
    "progress-marks": progress_marks.render,
    "checkpoint-io-run": checkpoint_section.render,
    "torchtitan": torchtitan_gpu.render,
    "gpu": gpu_mfu.render,
}


# The sections rendered from the kept runs (bench/results/bench-*.json), every kept run on the page.
KEPT_SECTIONS = ["machine", "matmul-peak", "overhead", "startup", "progress-marks", "checkpoint-io-run"]
KEPT_PREFIX = "bench-"
# A run these sections showed before any run was kept: named, not shown (its raw results are lost).
LEFT_OUT = (
    "Not shown: the full `python -m bench` run of 2026-11-22 (commit 27f86d8) whose figures these sections "
    "held before runs were kept; its raw results were never kept, so none of its figures can be rebuilt "
    "(the page's history in the repository has them)."
)


def kept_runs() -> list[Path]:
    """Every kept `python -m bench` run, oldest first (the names sort by UTC date and time)."""
    return sorted(kept.RESULTS_DIR.glob(f"{KEPT_PREFIX}*.json"))


def _loads(values: list[float] | None) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "unknown"


def measured_by(data: dict) -> str:
    """When, where and by what command a kept run measured its figures."""
    m = data["machine"]
    said = (
        f"Measured {m['date']} by `{data['command']}` on {m['cpu']}, {m['cores']} cores (load average "
        f"1/5/15 min {_loads(m.get('load_start'))} at the start, {_loads(data.get('load_end'))} at the end)."
    )
    first = [values[0] for values in (m.get("load_start"), data.get("load_end")) if values]
    if first and max(first) > (m.get("cores") or 1):
        said += (
            " The load exceeded the core count: other processes held the cores, so these figures (and any "
            "verdict against a target below) measure the shared machine more than the code."
        )
    return said


def _render_one(name: str, data: dict) -> str:
    if name == "machine":
        return render_machine(data["machine"], data["command"], data.get("load_end"))
    return RENDERERS[name](data[name])


def _after_heading(body: str, lines: list[str]) -> str:
    """`lines` as paragraphs after the section's heading (or first, where it has none)."""
    insert = "\n\n".join(lines)
    if body.startswith("#"):
        heading, _, rest = body.partition("\n\n")
        return f"{heading}\n\n{insert}\n\n{rest}"
    return f"{insert}\n\n{body}"


def render_kept(paths: list[str | Path]) -> dict[str, str]:
    """The CPU sections from kept results files only: each section shows every run that measured it, the
    latest in full first, then each earlier one, and names the command that rewrites it from these files."""
    runs = [(kept.relative(path), kept.load(path)) for path in paths]
    names = [name for name, _ in runs]
    source = (
        f"Results: {', '.join(f'`{name}`' for name in names)}. Rewritten from the kept results by "
        f"`python -m bench --page-from {' '.join(names)}`."
    )
    sections: dict[str, str] = {}
    for section in KEPT_SECTIONS:
        have = [(name, data) for name, data in runs if section == "machine" or section in data]
        parts = []
        for i, (name, data) in enumerate(reversed(have)):
            body = _render_one(section, data).rstrip("\n")
            if i == 0:
                parts.append(_after_heading(body, [source, measured_by(data)]))
                continue
            if body.startswith("#"):
                body = body.partition("\n\n")[2]
            parts.append(f"**An earlier run**, `{name}`. {measured_by(data)}\n\n{body}")
        if section == "machine":
            parts.append(LEFT_OUT)
        if parts:
            sections[section] = "\n\n".join(parts) + "\n"
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
        "python -m bench --page-from bench/results/bench-<date>-<time>.json   # measure nothing; see below\n"
        "```\n\n"
        "Sections: `matmul-peak` (bench/matmul_peak.py), `overhead` (bench/overhead.py, "
        "bench/plain_loop.py, bench/step_ab.py), `startup` (bench/startup.py), `progress-marks` "
        "(bench/progress_marks.py: the progress board's publishing cost as a ratio), `checkpoint-io-run` "
        "(bench/checkpoint_io.py via bench/checkpoint_section.py), `torchtitan` "
        "(bench/torchtitan_gpu.py), `gpu` (bench/gpu_mfu.py). "
        "Each run keeps its raw results in bench/results/bench-<UTC date>-<time>.json; the sections "
        "`machine`, `matmul-peak`, `overhead`, `startup`, `progress-marks` and `checkpoint-io-run` show "
        "every kept run, the latest first, and `python -m bench --page-from FILE...` rewrites them from "
        "kept files only, measuring nothing. A section that fails keeps its previous text and the run "
        "exits 1; without a GPU the GPU sections stay as they are. Each figure names the command that "
        "produced it. Runs are "
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
        "- Throughput of every parallel layout (FSDP2, HSDP, TP, PP, ...) on CPU/gloo: the section "
        '"Parallel layouts on CPU" above, measured by `python -m bench.parallel_layouts` (not part of '
        "`python -m bench`: it launches torchrun for each layout group).\n"
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
        "--page-from",
        nargs="+",
        type=Path,
        help=f"measure nothing: rewrite {', '.join(KEPT_SECTIONS)} from these kept results files",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="--page-from every kept run (bench/results/bench-*.json)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="threads per measured process (default: cores)"
    )
    args = parser.parse_args(argv)

    names = [ALIASES.get(n.strip(), n.strip()) for n in args.only.split(",") if n.strip()] or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.page_from or args.render_only:
        paths = args.page_from or kept_runs()
        try:
            sections = render_kept(paths)
        except (ValueError, KeyError) as err:
            parser.error(f"--page-from: {err!r}")
        return publish(sections, [*ORDER, LINKS], args.page or page_path(), args.no_write, failed=[])
    page = args.page or (WORK / "benchmarks.md" if args.quick else PAGE)
    if args.quick and args.page is None and PAGE.exists() and not page.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        page.write_text(PAGE.read_text())  # a quick run previews the whole page without touching docs/

    order = [*ORDER, LINKS]
    plan = Plan(quick=args.quick, threads=args.threads or os.cpu_count() or 1)
    command = (
        "python -m bench"
        + (" --quick" if args.quick else "")
        + (f" --only {args.only}" if args.only else "")
        + (f" --threads {args.threads}" if args.threads else "")
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
        if outcome[0].get("ran") is False:  # no GPU here: the page keeps its GPU run's text
            del sections[name]
        print(f"[bench] {name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    results["load_end"] = load_average()
    if set(names) == set(SECTIONS):
        sections[LINKS] = links_section()
    sections["usage"] = usage_section()
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "results.json").write_text(json.dumps(results, indent=1))
    # Kept with the page, one file per run (a second run the same day is kept beside the first).
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    kept_path = kept.save(f"bench-{stamp}.json", results)
    print(f"[bench] kept: {kept.relative(kept_path)}", file=sys.stderr, flush=True)
    sections.update(render_kept(kept_runs()))  # every kept run, this one included, from its file
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
