"""On one GPU: the bf16 matmul peak, and the MFU of the 1B preset (configs/1b.toml) with and without compile.

    python -m bench.gpu_mfu [--steps 20] [--warmup 5] [--batch 8] [--micro 2] [--seq 4096]

Runs `relaytrain train configs/1b.toml` twice per repeat (eager, then `--parallel.compile=true`), one
process on one GPU (bf16 autocast, `parallel.param_dtype = "auto"`), no checkpoints, a record per step.
Reports the median step, tokens/s and MFU, both against the vendor peak the trainer uses (its ``mfu`` field)
and against the bf16 matmul peak measured here. Needs CUDA; exits 2 without it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

import torch

from bench import kept
from bench.matmul_peak import time_matmul
from bench.procs import WORK, read_metrics, relaytrain_argv, run, shown, train_records
from bench.report import REPO, fmt, median, pct, table, write_page

MODULE = "bench.gpu_mfu"
CONFIG = REPO / "configs" / "1b.toml"


def trainer_argv(name: str, compile_: bool, steps: int, batch: int, micro: int, seq: int) -> list[str]:
    return relaytrain_argv(
        [
            "train",
            str(CONFIG),
            f"--run.dir={WORK / 'runs'}",
            f"--run.name={name}",
            f"--train.max_steps={steps}",
            "--optim.warmup_steps=1",
            f"--train.global_batch_size={batch}",
            f"--train.micro_batch_size={micro}",
            f"--train.seq_len={seq}",
            "--train.eval_every=0",
            "--metrics.log_every=1",
            "--checkpoint.enabled=false",
            f"--parallel.compile={'true' if compile_ else 'false'}",
            "--data.allow_small=true",  # speed of the 1B shape: the bundled corpus is enough (docs/data.md)
        ]
    )


def measure(
    quick: bool = False,
    steps: int = 20,
    warmup: int = 5,
    batch: int = 8,
    micro: int = 2,
    seq: int = 4096,
    repeats: int = 1,
) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_mfu needs a CUDA GPU")
    if quick:
        steps, warmup = 8, 3
    peak = time_matmul(8192, torch.bfloat16, "cuda", 1.0 if quick else 3.0)
    runs = []
    for i in range(repeats):
        for compile_ in (False, True):
            name = f"gpu-mfu-{'compile' if compile_ else 'eager'}-{i}"
            argv = trainer_argv(name, compile_, steps, batch, micro, seq)
            done = run(argv, threads=torch.get_num_threads(), timeout=1200)
            records = train_records(read_metrics(WORK / "runs" / name))
            shutil.rmtree(WORK / "runs" / name, ignore_errors=True)
            kept = records[warmup:]
            runs.append(
                {
                    "compile": compile_,
                    "command": shown(argv).replace(f"--run.name={name}", "--run.name=gpu-mfu"),
                    "wall_s": done.wall_s,
                    "first_step_s": records[0]["time_step_s"] if records else None,
                    "step_s": median(r["time_step_s"] for r in kept),
                    "tokens_per_s": median(r["tokens_per_s_per_device"] for r in kept),
                    "trainer_mfu": median(r.get("mfu") for r in kept),
                    "mem_peak_gib": max((r.get("mem_peak_gib") or 0) for r in kept) if kept else None,
                }
            )
    from relaytrain.config import load_config
    from relaytrain.model import flops_per_token

    cfg = load_config(str(CONFIG), [f"--train.seq_len={seq}"])
    fpt = flops_per_token(cfg.model, seq)
    for r in runs:
        r["measured_peak_mfu"] = r["tokens_per_s"] * fpt / peak["best_flops"]
    return {
        "ran": True,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"python -m {MODULE} --steps {steps} --warmup {warmup} --batch {batch} --micro {micro} "
        f"--seq {seq}",
        "gpu": torch.cuda.get_device_name(0),
        "bf16_peak_flops": peak["best_flops"],
        "flops_per_token": fpt,
        "runs": runs,
    }


def not_run(reason: str = "") -> dict:
    return {
        "ran": False,
        "reason": reason
        or "the figures on this page come from a machine without a CUDA GPU; run the command above on one",
        "command": f"python -m {MODULE}",
    }


def render(result: dict) -> str:
    out = "## GPU: bf16 matmul peak and MFU of the 1B preset\n\n"
    if result.get("transcribed"):  # kept history: a file copied from an earlier page (bench/kept.py)
        out += f"*Kept history, transcribed, not measured again: {result['transcribed']}.*\n\n"
    out += f"Command: `{result['command']}`\n\n"
    if not result["ran"]:
        return out + (
            f"**Not run**: {result['reason']}. The script is ready: on a machine with one CUDA GPU "
            "it measures the bf16 matmul peak (8192²) and trains `configs/1b.toml` (1.24 B parameters, "
            "seq 4096, micro batch 2, global batch 8) for 20 steps eager and 20 steps with "
            "`--parallel.compile=true`, and reports tokens/s and MFU against both the vendor peak (the "
            "trainer's `mfu`) and the measured matmul peak. `python -m bench` runs it whenever CUDA is "
            "available.\n"
        )
    rows = [
        (
            "compile" if r["compile"] else "eager",
            fmt(1000 * r["step_s"]),
            fmt(r["tokens_per_s"]),
            pct(r["trainer_mfu"]),
            pct(r["measured_peak_mfu"]),
            fmt(r["first_step_s"]),
            fmt(r["mem_peak_gib"]),
        )
        for r in result["runs"]
    ]
    peak = fmt(result["bf16_peak_flops"] / 1e12)
    out += f"Date: {result.get('date', 'not recorded')}. "
    out += f"GPU: {result['gpu']}; measured bf16 matmul peak {peak} TFLOP/s.\n\n"
    out += table(
        [
            "mode",
            "median step (ms)",
            "tokens/s",
            "MFU (vendor peak)",
            "MFU (measured peak)",
            "first step (s)",
            "peak mem (GiB)",
        ],
        rows,
    )
    out += f"\nTrainer command (eager): `{result['runs'][0]['command']}`\n"
    if result.get("kept"):
        out += "\n" + kept.rewritten(f"python -m {MODULE}", result["kept"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--write", action="store_true", help="also write the `gpu` section of docs/benchmarks.md"
    )
    parser.add_argument("--page-from", help="write the `gpu` section from a kept results file only")
    args = parser.parse_args(argv)
    if args.page_from:
        try:
            write_page({"gpu": render(kept.page_from(args.page_from))})
        except (ValueError, KeyError) as err:
            parser.error(f"--page-from: {err}")
        return 0
    if not torch.cuda.is_available():
        print("bench.gpu_mfu: no CUDA GPU here; run it on a machine with one", file=sys.stderr)
        return 2
    result = measure(False, args.steps, args.warmup, args.batch, args.micro, args.seq, args.repeats)
    result = kept.keep_gpu_run("gpu-mfu", result)  # every figure, the device and the versions
    print(json.dumps(result) if args.json else render(result))
    if args.write:
        write_page({"gpu": render(result)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
