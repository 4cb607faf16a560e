"""Tokens/s of the tiny model (dim 64, 4 layers, vocab 256, seq 32, global batch 8) per parallel layout.

    python -m bench.parallel_layouts [--steps 10] [--compile] [--layouts fsdp,tp] [--no-write]
    python -m bench.parallel_layouts --page-from bench/results/parallel-layouts-<date>.json

Runs the one-process layouts in this process and the others under `torchrun --standalone` (gloo, CPU, one
thread per process), running the layouts listed in tests/parallel_cases.py (LAYOUTS, shared with the
parity tests), or those `--layouts` names, and times the median step after the first. Writes the
`parallel-layouts` section of docs/benchmarks.md and keeps the figures in
bench/results/parallel-layouts-<UTC date and time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench import kept
from bench.report import REPO, fmt, load_average, machine_info, python_command, table

MODULE = "bench.parallel_layouts"
SECTION = "parallel-layouts"
ORDER = ["gpu", SECTION, "links"]
TESTS = REPO / "tests"
WORKER = TESTS / "parallel_cases.py"

# How the page names each case of tests/parallel_cases.py.
LABELS = {
    "single": "one process",
    "ac_full": "AC full",
    "ac_selective": "AC selective",
    "autocast_bf16": "bf16 autocast",
    "fsdp": "FSDP",
    "fsdp_reshard_never": "FSDP, reshard never (micro batches of 1)",
    "fsdp_cpu_offload": "FSDP + CPU offload",
    "fsdp_ac_full": "FSDP + AC full",
    "fsdp_ac_selective": "FSDP + AC selective",
    "fsdp_compile": "FSDP + compile (inductor)",
    "fsdp_bf16": "FSDP bf16 params, fp32 reduce",
    "hsdp_2x1": "HSDP 2 x 1",
    "tp": "TP 2 (+SP, loss parallel)",
    "tp_no_loss_parallel": "TP 2 without loss parallel",
    "tp_ac_selective": "TP 2 + AC selective",
    "pp_gpipe": "PP 2, GPipe",
    "pp_1f1b": "PP 2, 1F1B",
    "pp_interleaved": "PP 2, interleaved 1F1B (2 virtual)",
    "hsdp_2x2": "HSDP 2 x 2",
    "fsdp_tp": "FSDP 2 x TP 2",
    "pp_fsdp_pp_outer_order": "PP 2 x FSDP 2 (PP outermost)",
    "pp_fsdp": "PP 2 x FSDP 2",
    "pp_tp": "PP 2 x TP 2",
    "pp_tp_interleaved": "PP 2 x TP 2, interleaved",
}


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


def unknown_layouts(layouts: list[str]) -> list[str]:
    """The names in ``layouts`` that are none of tests/parallel_cases.py's LAYOUTS."""
    sys.path.insert(0, str(TESTS))
    from parallel_cases import LAYOUTS

    known = {case for cases in LAYOUTS.values() for case in cases}
    return [name for name in layouts if name not in known]


def measure(steps: int, compile_: bool, layouts: list[str]) -> list[dict]:
    """One row a layout: processes, case, median step after the first, tokens/s. Every layout but the
    opt-in ones (fsdp_compile: with ``compile_``), or only those ``layouts`` names."""
    os.environ["PARALLEL_CASES_STEPS"] = str(steps)
    sys.path.insert(0, str(TESTS))
    import torch

    from parallel_cases import BENCH_OPT_IN, LAYOUTS, run_case

    def timed(case: str) -> bool:
        return case in layouts if layouts else compile_ or case not in BENCH_OPT_IN

    torch.set_num_threads(1)  # as each torchrun rank
    results = [(1, run_case(name, 1, 0, 1)) for name in LAYOUTS[1] if timed(name)]
    with tempfile.TemporaryDirectory() as workdir:
        for nproc in (2, 4):
            cases = [case for case in LAYOUTS[nproc] if timed(case)]
            if cases:
                results += [(nproc, r) for r in run_torchrun(nproc, cases, steps, workdir)]
    keys = ("case", "steady_step_s", "tokens_per_s", "total_s")
    return [{"processes": nproc, **{k: r[k] for k in keys}} for nproc, r in results]


def render(data: dict) -> str:
    m, a = data["machine"], data["args"]
    rows = [
        (r["processes"], LABELS.get(r["case"], r["case"]), fmt(r["steady_step_s"]), fmt(r["tokens_per_s"]))
        for r in data["rows"]
    ]
    loads = f"load average {m['load_start'][0]} at the start, {data['load_end'][0]} at the end"
    timed = {r["case"] for r in data["rows"]}
    untimed = "" if "fsdp_compile" in timed else " FSDP + compile is timed only with `--compile`."
    single = next((r["tokens_per_s"] for r in data["rows"] if r["case"] == "single"), None)
    others = [r for r in data["rows"] if r["processes"] > 1]
    slower = sum(r["tokens_per_s"] < single for r in others) if single else 0
    counted = (
        f": {slower} of the {len(others)} layouts of 2 or 4 processes were slower than one process, on a "
        "model this small"
        if single and others
        else ""
    )
    busy = max(m["load_start"][0], data["load_end"][0]) > m["cores"]
    noisy = (
        " The load average exceeded the core count: other work shared the cores, so the figures are low "
        "and noisy."
        if busy
        else ""
    )
    lines = [
        "## Parallel layouts on CPU",
        "",
        f"{m['date']}, {m['cpu']} ({m['cores']} cores, {loads}), torch {m['torch']}, commit "
        f"{m['commit']}. The tiny model (dim 64, 4 layers, 4 heads, 2 KV heads, vocab 256, seq 32, global "
        f"batch 8; AdamW), {a['steps']} steps a layout, the median step after the first; gloo, one thread "
        f"a process. Command: `{data['command']}`.",
        "",
        table(["processes", "layout", "step (s)", "tokens/s"], rows).rstrip(),
        "",
        f"The figures show relative costs on CPU, not capabilities{counted}.{noisy} The layouts exist for "
        f"GPUs; run the command on a GPU machine for figures there.{untimed} Which layout runs on which "
        "device: [docs/parallelism.md](parallelism.md).",
        "",
        kept.rewritten(python_command(MODULE), kept.relative(data["kept"])).rstrip(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time fsdp_compile (inductor, slow cold)")
    parser.add_argument(
        "--layouts", default="", help="time only these, comma-separated (tests/parallel_cases.py)"
    )
    parser.add_argument("--no-write", action="store_true", help="print the section, leave the page alone")
    parser.add_argument("--page-from", default="", help="measure nothing: rewrite the section from this file")
    args = parser.parse_args(argv)
    if args.page_from:
        kept.rewrite_from(args.page_from, render, SECTION, ORDER, parser.error)
        return 0
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = unknown_layouts(layouts)
    if unknown:
        parser.error(f"--layouts: no such layout: {', '.join(unknown)} (tests/parallel_cases.py, LAYOUTS)")
    shown = [f"--steps={args.steps}"] + (["--compile"] if args.compile else [])
    shown += [f"--layouts={','.join(layouts)}"] if layouts else []
    data = {"machine": machine_info(), "command": python_command(MODULE, shown), "args": vars(args)}
    data["rows"] = measure(args.steps, args.compile, layouts)
    data["load_end"] = load_average()
    kept.keep_and_show("parallel-layouts", data, render, SECTION, ORDER, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
