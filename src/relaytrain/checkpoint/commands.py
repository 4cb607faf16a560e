"""`relaytrain export` and `relaytrain import-hf`: move weights between relaytrain and other formats."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's model as a Hugging Face Llama directory or one torch file",
        description=(
            "Export the model weights of CHECKPOINT (a step_<N> directory, a checkpoints directory or a "
            "run directory, which stand for their latest complete checkpoint). With --format hf it writes "
            "config.json, generation_config.json, safetensors (sharded with model.safetensors.index.json "
            "above --max-shard-size) and the run's tokenizer files. With --format torch it writes one file "
            "holding the state dict and the model config, loadable with torch.load(weights_only=True)."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="step dir, checkpoints dir or run dir")
    p.add_argument("--format", choices=["hf", "torch"], default="hf", help="output format (default: hf)")
    p.add_argument("--out", required=True, help="output directory (hf; must be new or empty) or .pt file")
    p.add_argument("--max-shard-size", default="5GB", help="hf: largest safetensors file (default: 5GB)")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weight dtype of the export (default: the checkpoint's)",
    )
    p.set_defaults(func=run_export)

    q = subparsers.add_parser(
        "import-hf",
        help="turn Hugging Face Llama weights into a relaytrain checkpoint (for checkpoint.init_from)",
        description=(
            "Convert a local Hugging Face Llama directory (config.json + model.safetensors or sharded "
            "safetensors with an index) into a committed relaytrain step directory holding the weights, "
            "metadata.json, config.toml (model section from config.json) and the tokenizer.json if any. "
            "Start training from it with --checkpoint.init_from=OUT."
        ),
    )
    q.add_argument("hf_dir", metavar="DIR", help="Hugging Face model directory")
    q.add_argument("--out", required=True, help="checkpoint directory to create (must be new or empty)")
    q.set_defaults(func=run_import_hf)


def run_export(args: argparse.Namespace) -> int:
    from relaytrain.checkpoint.export import export_checkpoint

    target = export_checkpoint(args.checkpoint, args.out, args.format, args.max_shard_size, args.dtype)
    print(f"exported {args.checkpoint} -> {target}")
    return 0


def run_import_hf(args: argparse.Namespace) -> int:
    from relaytrain.checkpoint.export import import_hf

    out = import_hf(args.hf_dir, args.out)
    print(f"imported {args.hf_dir} -> {out}; start from it with --checkpoint.init_from={out}")
    return 0
