"""The first hour on a GPU machine: every GPU-only check of relaytrain, one command, figures into the docs.

    bench/gpu_first_hour.sh            # = python -m bench.gpu_first_hour (no network, no console script)
    python -m bench.gpu_first_hour [--only versions,matmul,...] [--no-write]

In order (each step is recorded with what to look for; a failed step is recorded as failed and the
others still run):

1. ``versions``: torch, CUDA, cuDNN and NCCL versions, the GPUs.
2. ``matmul``: the bf16 matmul peak (8192², ``bench.matmul_peak.time_matmul``): the MFU denominator.
3. ``smoke``: a single-GPU run of the debug config (bf16 autocast): the loss falls, tokens/s, the
   log window's peak memory and allocation retries (0 expected).
4. ``resume``: a sync save and an async save, each resumed, and the resumed run's loss at the last step
   against the uninterrupted smoke run (checkpoint writes and loads of CUDA tensors).
5. ``snapshot``: in-memory snapshots every step of a ~0.4 B-parameter model with AdamW (bench/snapshot.py's
   GPU part): the time each snapshot blocks the step (``snapshot_blocking_s``, the wait for the previous
   snapshot's background work apart) against the step time, and the step with snapshots against without.
6. ``compile``: a 12-block model (deeper than Dynamo's recompile limit of 8) with ``parallel.compile``
   and ``TORCH_LOGS=recompiles``: the recompiles logged (0 expected) and no recompile-limit hit.
7. ``mfu``: ``bench/gpu_mfu.py`` (the 1B preset, eager and compiled); it writes the ``gpu`` section.
8. ``layouts`` (2 to 8 GPUs): FSDP, TP, PP, HSDP, CP and FSDP with snapshots under torchrun on 2 or 4
   GPUs, the same global batch, the loss at the last step of each against FSDP's (bf16: close, not
   bit-identical; CP has never run anywhere before this).

Writes the ``gpu-first-hour`` section of docs/benchmarks.md (date, device, every figure) and, through
``bench.gpu_mfu``, its ``gpu`` section. On a machine without a CUDA GPU it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback

import torch

from bench import kept
from bench.procs import WORK, read_metrics, relaytrain_argv, run, shown, train_records
from bench.report import REPO, fmt, table, write_page

MODULE = "bench.gpu_first_hour"
SECTION = "gpu-first-hour"
STEPS = ("versions", "matmul", "smoke", "resume", "snapshot", "compile", "mfu", "layouts")
RUNS = WORK / "first-hour"
SMOKE = ["--train.max_steps=30", "--checkpoint.interval=0", "--train.eval_every=0", "--metrics.log_every=1"]
LAYOUTS = {  # name: overrides on top of the debug config, for 2 (or 4) GPUs
    "fsdp": [],
    "tp": ["--parallel.tp=2"],
    "pp": ["--parallel.pp=2"],
    "hsdp": ["--parallel.dp_replicate=2"],
    "cp": ["--parallel.cp=2"],
    "fsdp+snapshot": ["--checkpoint.snapshot_every=1"],
}


def _train(name: str, args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 1200):
    """One `relaytrain train` (torchrun for several GPUs); returns (train records, finished process)."""
    base = ["train", f"--run.dir={RUNS}", f"--run.name={name}", *args]
    argv = relaytrain_argv(base)
    if nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        argv += ["-m", "relaytrain.cli", *base]
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})  # bench.procs.run hands the process this environment
    try:
        done = run(argv, threads=4, timeout=timeout)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    return train_records(read_metrics(RUNS / name)), done


def _last_loss(records: list[dict]) -> float:
    return float(records[-1]["loss"])


def versions() -> dict:
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "gpus": torch.cuda.device_count(),
        "device": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "memory_gib": torch.cuda.get_device_properties(0).total_memory / 1024**3,
    }


def matmul() -> dict:
    from bench.matmul_peak import time_matmul

    return {"bf16_8192_tflops": time_matmul(8192, torch.bfloat16, "cuda", 2.0)["best_flops"] / 1e12}


def smoke() -> dict:
    records, done = _train("smoke", SMOKE)
    kept = records[5:]
    return {
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
        "loss_falls": records[-1]["loss"] < records[0]["loss"],
        "tokens_per_s": sorted(r["tokens_per_s"] for r in kept)[len(kept) // 2],
        "step_ms": 1000 * sorted(r["time_step_s"] for r in kept)[len(kept) // 2],
        "mem_peak_gib": max(r.get("mem_peak_gib", 0.0) for r in kept),
        "alloc_retries": max(r.get("mem_alloc_retries", 0.0) for r in records),
        "command": shown(done.argv),
    }


def resume(reference: float | None) -> dict:
    out = {}
    for mode in ("sync", "async"):
        name = f"resume-{mode}"
        shutil.rmtree(RUNS / name, ignore_errors=True)
        _train(
            name, [*SMOKE, "--checkpoint.interval=10", f"--checkpoint.mode={mode}", "--train.stop_at_step=15"]
        )
        records, done = _train(name, [*SMOKE, "--checkpoint.interval=10", f"--checkpoint.mode={mode}"])
        last = _last_loss(records)
        out[mode] = {
            "resumed": "resuming from" in done.stdout + done.stderr,
            "last_loss": last,
            "diff_vs_uninterrupted": None if reference is None else abs(last - reference),
        }
    return out


def snapshot() -> dict:
    """bench/snapshot.py's GPU part on the 0.4 B shape: snapshots every step against no snapshots."""
    from relaytrain.config import load_config
    from relaytrain.model import count_parameters

    from bench import snapshot as snapshot_bench

    r = snapshot_bench.gpu_share("0.4b", steps=10)
    return {
        "params_b": count_parameters(load_config(None, snapshot_bench.GPU_WIDE).model) / 1e9,
        "snapshot_gb": r["mb"] / 1e3,
        "blocking_ms": 1000 * r["blocking_s"],
        # of the blocking time, the wait for the previous snapshot's background work (every step: it may
        # not fit); the rest is the launch of the copies
        "waited_ms": 1000 * r["waited_s"],
        "blocking_share": (r["blocking_s"] - r["waited_s"]) / r["step_snap_s"],
        "step_ms": 1000 * r["step_snap_s"],
        "step_plain_ms": 1000 * r["step_plain_s"],
    }


def compile_deep() -> dict:
    args = ["--model.n_layers=12", "--parallel.compile=true", "--train.max_steps=6", "--train.eval_every=0"]
    args += ["--checkpoint.enabled=false", "--metrics.log_every=1"]
    records, done = _train("compile", args, env={"TORCH_LOGS": "recompiles"})
    text = done.stdout + done.stderr
    return {
        "blocks": 12,
        "recompiles_logged": text.count("Recompiling function"),
        "recompile_limit_hit": "recompile_limit" in text,
        "step_ms_last": 1000 * records[-1]["time_step_s"],
    }


def mfu() -> dict:
    from bench import gpu_mfu

    result = kept.keep_gpu_run("gpu-mfu", gpu_mfu.measure())
    write_page({"gpu": gpu_mfu.render(result)})
    return {f"{'compile' if r['compile'] else 'eager'}_mfu": r["trainer_mfu"] for r in result["runs"]}


def layouts() -> dict:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": f"{gpus} GPU: needs 2 to 8"}
    nproc = 4 if gpus >= 4 else 2
    common = [*SMOKE, "--train.max_steps=20", "--checkpoint.enabled=false"]
    losses = {}
    for name, extra in LAYOUTS.items():
        try:
            records, _ = _train(f"layout-{name.replace('+', '-')}", [*common, *extra], nproc=nproc)
            losses[name] = _last_loss(records)
        except Exception as exc:  # noqa: BLE001 - one failed layout is a finding, not the end
            losses[name] = f"failed: {str(exc).splitlines()[0][:200]}"
    ref = losses.get("fsdp")
    return {
        "nproc": nproc,
        "last_loss": losses,
        "diff_vs_fsdp": {
            k: abs(v - ref) for k, v in losses.items() if isinstance(v, float) and isinstance(ref, float)
        },
    }


STEP_FUNCTIONS = {
    "versions": versions,
    "matmul": matmul,
    "smoke": smoke,
    "snapshot": snapshot,
    "compile": compile_deep,
    "mfu": mfu,
    "layouts": layouts,
}


def measure(only: list[str]) -> dict:
    RUNS.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": {}}
    for step in only:
        started = time.perf_counter()
        print(f"gpu_first_hour: {step} ...", flush=True)
        try:
            if step == "resume":
                figures = resume(result["steps"].get("smoke", {}).get("figures", {}).get("loss_last"))
            else:
                figures = STEP_FUNCTIONS[step]()
            result["steps"][step] = {"ok": True, "figures": figures}
        except Exception as exc:  # noqa: BLE001 - every other step still runs
            traceback.print_exc()
            error = str(exc).splitlines()[0] if str(exc) else repr(exc)
            # as a reader would type it: `relaytrain`, paths inside the repository relative to it
            error = error.replace(f"{sys.executable} -m relaytrain.cli", "relaytrain")
            result["steps"][step] = {"ok": False, "error": error.replace(f"{REPO}/", "")[:300]}
        result["steps"][step]["seconds"] = time.perf_counter() - started
        print(f"gpu_first_hour: {step}: {json.dumps(result['steps'][step])}", flush=True)
    result["device"] = result["steps"].get("versions", {}).get("figures", {}).get(
        "device"
    ) or torch.cuda.get_device_name(0)
    return result


LOOK_FOR = {
    "versions": "the GPU and CUDA the figures below belong to",
    "matmul": "H100 SXM: about 700-800 TFLOP/s bf16 dense at 8192²",
    "smoke": "the loss falls; allocation retries 0",
    "resume": "both modes resume; the last loss close to the uninterrupted run's (bf16, a few 1e-3)",
    "snapshot": "blocking_share (blocking time less the wait for the previous snapshot's background work: "
    "the launch of the copies, which run beside the next step) at most 5 %; step_ms close to "
    "step_plain_ms; a wait means the background work does not fit a step",
    "compile": "0 recompiles and no recompile-limit hit with 12 blocks",
    "mfu": "the `gpu` section below has the table",
    "layouts": "every layout's last loss close to FSDP's; CP is the one never run before",
}


def _cell(value) -> str:
    if isinstance(value, float):
        return fmt(value) if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_cell(v)}" for k, v in value.items())
    return str(value)


def render(result: dict) -> str:
    out = "## GPU: the first hour\n\n"
    out += f"Command: `bench/gpu_first_hour.sh` (= `python -m {MODULE}`)\n\n"
    out += f"Date: {result['date']}. Device: {result['device']}.\n\n"
    rows = []
    for step, entry in result["steps"].items():
        figures = _cell(entry["figures"]) if entry["ok"] else f"**failed**: {entry['error']}"
        rows.append((step, figures, LOOK_FOR.get(step, ""), f"{entry['seconds']:.0f}"))
    out += table(["step", "figures", "what to look for", "s"], rows)
    if result.get("kept"):
        out += "\n" + kept.rewritten(f"python -m {MODULE}", result["kept"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(STEPS), help=f"a subset of {','.join(STEPS)}")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave the page alone")
    parser.add_argument("--page-from", help="write the section from a kept results file only")
    args = parser.parse_args(argv)
    if args.page_from:
        try:
            write_page(
                {SECTION: render(kept.page_from(args.page_from))}, order=["torchtitan", SECTION, "gpu"]
            )
        except (ValueError, KeyError) as err:
            parser.error(f"--page-from: {err}")
        return 0
    if not torch.cuda.is_available():
        print("gpu_first_hour: no CUDA GPU on this machine; nothing to do")
        return 0
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        print(f"gpu_first_hour: unknown step(s) {unknown}; choose from {','.join(STEPS)}", file=sys.stderr)
        return 2
    result = measure(only)
    (WORK / "first-hour.json").write_text(json.dumps(result, indent=1))
    result = kept.keep_gpu_run("gpu-first-hour", result)  # every figure, the device and the versions
    section = render(result)
    print(section)
    if not args.no_write:
        write_page({SECTION: section}, order=["torchtitan", SECTION, "gpu"])
    return 0 if all(e["ok"] for e in result["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
