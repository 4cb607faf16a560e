"""relaytrain against torchtitan (its PyPI release) on GPUs: same model shape, sequence length and batch.

    pip install torchtitan==0.3.0 triton   # plus its declared dependencies; 0.2.2 on torch 2.11
    python -m bench.torchtitan_gpu [--shape debug|8b] [--gpus N] [--pairs 3] [--steps 30] [--warmup 5]
                                   [--seq N] [--batch N]

Alternates torchtitan / relaytrain runs (``--pairs`` of each) under ``torchrun --standalone``. torchtitan
runs its ``llama3_debugmodel`` config (dim 256, 6 layers, 16 heads, FFN 768, vocab 2048, RoPE theta 5e5)
with activation checkpointing off, no checkpoints, a log line per step; relaytrain trains the same shape
(`--model.*` overrides) with the same per-GPU batch and sequence length. Per-step tokens/s per GPU and MFU
are parsed from torchtitan's console lines (``step: N  loss: ...  tps: T  tflops: F  mfu: M%``) and read
from relaytrain's metrics.jsonl; the first ``--warmup`` steps are dropped; medians and the ratio are
reported. Both sides report their model's parameter count so that a shape mismatch is visible.

``--shape debug`` (the default) is that debug model on one GPU: at dim 256 a step is a few milliseconds of
kernel launches, so it compares per-step overheads, not MFU. ``--shape 8b`` is torchtitan's 8B recipe
(config ``llama3_8b``: dim 4096, 32 layers, GQA 32/8, FFN 14336, vocab 128256) on one 8-GPU node: FSDP
over the 8 GPUs, bf16 parameters, seq 8192, one sequence per GPU, selective activation checkpointing on
both sides. The torchtitan config name and flags are read from its sources, not yet run here: if a
release renames one, pass ``--titan-arg``. (A realistic shape on one GPU without torchtitan: ``python -m
bench.overhead`` with a larger model, which runs both of its sides on the GPU in bf16.)

Precision: on one GPU torchtitan applies no FSDP and trains in fp32, so relaytrain runs
``--parallel.param_dtype=float32`` too; with ``--gpus`` > 1 both use FSDP2 with bf16 parameters and fp32
reduction. torchtitan 0.3's debug model uses flex attention with a per-document causal mask (0.2's causal
SDPA), relaytrain causal SDPA: the attention kernels may differ, the matmul work is the same.

torchtitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims`, which torch 2.11 lacks; with a
torchtitan 0.2.x installed the script passes that release's flags (`--model.flavor` instead of 0.3's
`--module`/`--config`).

torchtitan's config reads ``./tests/assets/tokenizer`` and the ``c4_test`` dataset from its repository,
which the wheel does not ship; this script writes both into its work directory (a byte-level BPE with
2,000 tokens trained on relaytrain's bundled corpus, and that corpus as ``c4_test/data.json``), so nothing
is downloaded. ``--titan-arg`` passes extra flags to torchtitan if a release renames one.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import kept
from bench.procs import WORK, read_metrics, run, shown, train_records
from bench.report import fmt, median, table, write_page

MODULE = "bench.torchtitan_gpu"
# torchtitan's llama3 "debugmodel" flavour, as relaytrain overrides.
SHAPE = {
    "dim": 256,
    "n_layers": 6,
    "n_heads": 16,
    "n_kv_heads": 16,
    "ffn_dim": 768,
    "vocab_size": 2048,
    "rope_theta": 500000.0,
    "norm_eps": 1e-5,
}
# torchtitan's llama3 "8B" flavour (Llama 3.1 8B: FFN 14336 from multiplier 1.3 and multiple of 1024).
SHAPE_8B = {
    "dim": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn_dim": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "norm_eps": 1e-5,
}


@dataclass(frozen=True)
class Preset:
    """One comparison: torchtitan's config, the same shape for relaytrain, and the defaults of the run."""

    titan_config: str
    shape: dict
    gpus: int
    seq: int
    batch: int  # sequences per GPU per step
    ac: str  # activation checkpointing on both sides: "none" or "selective"
    why: str


PRESETS = {
    # Launch-bound on a GPU (dim 256): it measures per-step overheads, not MFU.
    "debug": Preset("llama3_debugmodel", SHAPE, 1, 2048, 8, "none", "launch-bound: overheads, not MFU"),
    # torchtitan's own 8B recipe on one 8-GPU node: FSDP over 8, seq 8192, one sequence per GPU,
    # selective AC (torchtitan's per-op policy and relaytrain's differ in which matmuls they keep).
    "8b": Preset("llama3_8b", SHAPE_8B, 8, 8192, 1, "selective", "an 8B model on one 8-GPU node: MFU"),
}


TITAN_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-\d.naif]+).*?tps:\s*(?P<tps>[\d,]+)"
    r".*?tflops:\s*(?P<tflops>[\d.,]+)\s+mfu:\s*(?P<mfu>[\d.]+)%"
)
TITAN_PARAMS = re.compile(r"size:\s*([\d,]+)\s+total parameters")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def can_run() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("torchtitan") is not None


def torch_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def prepare_assets(workdir: Path, vocab_size: int = 2000) -> Path:
    """tests/assets/tokenizer (tokenizer.json + tokenizer_config.json) and tests/assets/c4_test/data.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from relaytrain.data.sources import BUNDLED_CORPUS

    assets = workdir / "tests" / "assets"
    tok_dir, data_dir = assets / "tokenizer", assets / "c4_test"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "data.json").exists():
        return assets
    text = gzip.decompress(BUNDLED_CORPUS.read_bytes()).decode("utf-8", errors="replace")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(paragraphs, trainer)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "add_bos_token": True, "add_eos_token": False})
    )
    with open(data_dir / "data.json", "w") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p}) + "\n")
    return assets


# torchtitan before 0.3 names a model by name and flavour (its config registry came with 0.3).
LEGACY_FLAVOR = {"llama3_debugmodel": "debugmodel", "llama3_8b": "8B"}


def titan_release() -> tuple[int, ...]:
    """The installed torchtitan's version; 0.3.0 (the flags' own release) where none is installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in re.findall(r"\d+", version("torchtitan"))[:3])
    except PackageNotFoundError:
        return (0, 3, 0)


def legacy_titan_argv(preset: Preset, gpus: int, steps: int, seq: int, batch: int) -> list[str]:
    """torchtitan 0.2.x's flags (0.3.0 needs a torch newer than 2.11: `fsdp.DataParallelMeshDims`)."""
    flavor = LEGACY_FLAVOR[preset.titan_config]
    argv = ["-m", "torchtitan.train", "--model.name=llama3", f"--model.flavor={flavor}"]
    argv += [f"--training.steps={steps}", f"--training.seq_len={seq}", f"--training.local_batch_size={batch}"]
    argv += ["--metrics.log_freq=1", f"--activation_checkpoint.mode={preset.ac}"]
    if gpus == 1:
        return [*argv, "--training.mixed_precision_param=float32"]
    return [*argv, f"--parallelism.data_parallel_shard_degree={gpus}"]


def titan_argv(preset: Preset, gpus: int, steps: int, seq: int, batch: int, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    if titan_release() < (0, 3):
        return [*argv, *legacy_titan_argv(preset, gpus, steps, seq, batch), *extra]
    argv += ["-m", "torchtitan.train", "--module", "llama3", "--config", preset.titan_config]
    argv += [
        f"--training.steps={steps}",
        f"--training.seq_len={seq}",
        f"--training.local_batch_size={batch}",
        "--metrics.log_freq=1",
        f"--checkpoint.interval={steps * 100}",
        "--parallelism.spmd_backend=partial_dtensor",
    ]
    if gpus == 1:
        argv.append("--training.mixed_precision_param=float32")
    else:
        argv.append(f"--parallelism.data_parallel_shard_degree={gpus}")
    return [*argv, *extra, f"activation-checkpoint:{preset.ac}"]


def relaytrain_gpu_argv(
    preset: Preset, gpus: int, run_root: Path, name: str, steps: int, seq: int, batch: int
) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    argv += ["-m", "relaytrain.cli", "train", f"--run.dir={run_root}", f"--run.name={name}"]
    argv += [f"--model.{k}={v}" for k, v in preset.shape.items()]
    argv += [
        f"--model.max_seq_len={seq}",
        f"--train.seq_len={seq}",
        f"--train.global_batch_size={batch * gpus}",
        f"--train.micro_batch_size={batch}",
        f"--train.max_steps={steps}",
        "--optim.warmup_steps=2",
        "--train.eval_every=0",
        "--metrics.log_every=1",
        "--checkpoint.enabled=false",
        f"--parallel.activation_checkpointing={preset.ac}",
        f"--parallel.param_dtype={'float32' if gpus == 1 else 'bfloat16'}",
    ]
    return argv


def parse_titan(output: str) -> tuple[list[dict], int | None]:
    clean = ANSI.sub("", output)
    steps = [
        {"step": int(m["step"]), "tps": float(m["tps"].replace(",", "")), "mfu": float(m["mfu"]) / 100}
        for m in TITAN_LINE.finditer(clean)
    ]
    params = TITAN_PARAMS.search(clean)
    return steps, int(params.group(1).replace(",", "")) if params else None


def measure(
    gpus: int | None = None,
    pairs: int = 3,
    steps: int = 30,
    warmup: int = 5,
    seq: int | None = None,
    batch: int | None = None,
    titan_extra: list[str] | None = None,
    shape: str = "debug",
) -> dict:
    from relaytrain.config import load_config
    from relaytrain.model import count_parameters

    preset = PRESETS[shape]
    gpus, seq, batch = gpus or preset.gpus, seq or preset.seq, batch or preset.batch
    workdir = WORK / "torchtitan"
    prepare_assets(workdir)
    run_root = WORK / "runs"
    runs = []
    titan_params = None
    for i in range(pairs):
        argv = titan_argv(preset, gpus, steps, seq, batch, list(titan_extra or []))
        out = run(argv, threads=4, cwd=workdir, timeout=1200)
        parsed, titan_params = parse_titan(out.stdout + out.stderr)
        if not parsed:
            raise RuntimeError(
                f"no torchtitan step lines in its output:\n{(out.stdout + out.stderr)[-3000:]}"
            )
        kept = [p for p in parsed if p["step"] > warmup]
        runs.append(
            {
                "side": "torchtitan",
                "order": 2 * i,
                "command": shown(argv),
                "tps": median(p["tps"] for p in kept),
                "mfu": median(p["mfu"] for p in kept),
            }
        )
        name = f"titan-cmp-{i}"
        argv = relaytrain_gpu_argv(preset, gpus, run_root, name, steps, seq, batch)
        run(argv, threads=4, timeout=1200)
        records = train_records(read_metrics(run_root / name))[warmup:]
        shutil.rmtree(run_root / name, ignore_errors=True)
        runs.append(
            {
                "side": "relaytrain",
                "order": 2 * i + 1,
                "command": shown(argv).replace(f"--run.name={name}", "--run.name=titan-cmp"),
                "tps": median(r["tokens_per_s_per_device"] for r in records),
                "mfu": median(r.get("mfu") for r in records),
            }
        )
    cfg = load_config(None, [f"--model.{k}={v}" for k, v in preset.shape.items()])
    import torch

    titan = median(r["tps"] for r in runs if r["side"] == "torchtitan")
    ours = median(r["tps"] for r in runs if r["side"] == "relaytrain")
    return {
        "ran": True,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"python -m {MODULE} --shape {shape} --gpus {gpus} --pairs {pairs} --steps {steps} "
        f"--warmup {warmup} --seq {seq} --batch {batch}",
        "shape": shape,
        "why": preset.why,
        "gpu": f"{gpus} x {torch.cuda.get_device_name(0)}",
        "params": {"relaytrain": count_parameters(cfg.model), "torchtitan": titan_params},
        "runs": runs,
        "ratio": ours / titan,
    }


def not_run(reason: str = "") -> dict:
    return {
        "ran": False,
        "reason": reason
        or "the figures on this page come from a machine without a CUDA GPU and without torchtitan installed",
        "command": f"python -m {MODULE}",
    }


def render(result: dict) -> str:
    out = "## relaytrain vs torchtitan\n\n"
    out += f"Command: `{result['command']}`\n\n"
    if not result["ran"]:
        return out + (
            f"**Not run**: {result['reason']}. On CPU torchtitan 0.3.0 does not run as shipped: it needs an "
            "87-line shim for 7 blockers (no CPU device option, FlexAttention has no CPU backward, "
            "`ReduceOp.PREMUL_SUM` is not supported by gloo, an API newer than torch 2.13, ...), and a run "
            "through that shim measures the shim. On "
            "CPU the anchor is therefore the plain PyTorch loop above. `bench/torchtitan_gpu.py` is ready for"
            " a machine with GPUs: `pip install torchtitan==0.3.0 triton` (and its declared dependencies), "
            "then `python -m bench.torchtitan_gpu --gpus 1`; `python -m bench` runs it whenever CUDA and "
            "torchtitan are both available. It alternates torchtitan's `llama3_debugmodel` and relaytrain on "
            "the same shape, sequence length (2048) and per-GPU batch (8), and reports tokens/s per GPU, MFU "
            "and the ratio.\n"
        )
    p = result["params"]
    out += f"Shape `{result.get('shape', 'debug')}`: {result.get('why', PRESETS['debug'].why)}.\n\n"
    out += (
        f"Date: {result.get('date', 'not recorded')}. GPU: {result['gpu']}. "
        f"Parameters: relaytrain {p['relaytrain']:,}, torchtitan "
        f"{p['torchtitan'] if p['torchtitan'] is None else format(p['torchtitan'], ',')}.\n\n"
    )
    rows = [
        (r["side"], r["order"], fmt(r["tps"]), f"{100 * r['mfu']:.2f}%" if r["mfu"] else "–")
        for r in sorted(result["runs"], key=lambda r: r["order"])
    ]
    out += table(["side", "run", "tokens/s per GPU (median)", "MFU"], rows)
    out += f"\n**relaytrain / torchtitan tokens/s: {result['ratio']:.3f}**\n\nCommands as run:\n\n"
    for side in ("torchtitan", "relaytrain"):
        out += f"- {side}: `{next(r['command'] for r in result['runs'] if r['side'] == side)}`\n"
    if result.get("kept"):
        out += "\n" + kept.rewritten(f"python -m {MODULE}", result["kept"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape",
        choices=sorted(PRESETS),
        default="debug",
        help="debug: torchtitan's debug model (launch-bound); 8b: its 8B recipe on an 8-GPU node",
    )
    parser.add_argument("--gpus", type=int, default=None, help="default: the shape's (debug 1, 8b 8)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=None, help="default: the shape's (debug 2048, 8b 8192)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per GPU per step (debug 8, 8b 1)")
    parser.add_argument("--titan-arg", action="append", default=[], help="extra torchtitan flag (repeatable)")
    parser.add_argument(
        "--prepare-only", type=Path, default=None, help="only write torchtitan's assets there"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--write", action="store_true", help="also write the `torchtitan` section of docs/benchmarks.md"
    )
    parser.add_argument("--page-from", help="write the `torchtitan` section from a kept results file only")
    args = parser.parse_args(argv)
    if args.page_from:
        try:
            write_page({"torchtitan": render(kept.page_from(args.page_from))})
        except (ValueError, KeyError) as err:
            parser.error(f"--page-from: {err}")
        return 0
    if args.prepare_only:
        print(prepare_assets(args.prepare_only))
        return 0
    if not can_run():
        print("bench.torchtitan_gpu needs CUDA and an installed torchtitan", file=sys.stderr)
        return 2
    if args.gpus and args.gpus > torch_gpus():
        print(f"bench.torchtitan_gpu --gpus {args.gpus}: only {torch_gpus()} GPU(s) visible", file=sys.stderr)
        return 2
    result = measure(
        args.gpus, args.pairs, args.steps, args.warmup, args.seq, args.batch, args.titan_arg, args.shape
    )
    result = kept.keep_gpu_run("torchtitan", result)  # every figure, the device and the versions
    print(json.dumps(result) if args.json else render(result))
    if args.write:
        write_page({"torchtitan": render(result)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
