"""The layouts of docs/benchmarks.md's "Simulated at scale" section, and how each one is simulated.

A row is one `relaytrain plan CONFIG --nodes N --gpus-per-node G --gpu h100 --simulate --json OVERRIDES`.
`tuned` rows are the layouts plan's formulas were fitted against (the section's first table, before
these rows were kept); the others were chosen after, to check the formulas out of sample: other model
sizes (125M, 350M, 3B, 7B without grouped-query attention), other sequence lengths, HSDP, interleaved
pipelines, a bf16 gradient reduction, and a layout the fake step cannot run (context parallel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TP8 = ("--parallel.tp=8",)
HSDP_4X8 = ("--parallel.dp_replicate=4", "--parallel.dp_shard=8")
PP2 = ("--parallel.pp=2", "--parallel.pp_microbatches=8")
INTERLEAVED = ("--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2")
NEVER = ("--parallel.reshard_after_forward=never",)
OFFLOAD = ("--parallel.cpu_offload=true", "--mem", "0")
MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Row:
    model: str  # configs/<model>.toml
    nodes: int
    gpus: int
    layout: str  # how the table names the layout
    overrides: tuple[str, ...] = ()
    mode: str = ""  # parallel.activation_checkpointing ("": the config's)
    tuned: bool = False
    fitted_by: str = ""  # a held-out row plan was fixed for after it was seen: the fixing commit

    @property
    def sample(self) -> str:
        """How the table labels the row: what plan's formulas were fitted to, and what they were not."""
        if self.tuned:
            return "tuned"
        return f"found out of sample, then fitted ({self.fitted_by})" if self.fitted_by else "held out"

    @property
    def config(self) -> str:
        return f"configs/{self.model}.toml"

    @property
    def args(self) -> list[str]:
        mode = (f"--parallel.activation_checkpointing={self.mode}",) if self.mode else ()
        return [
            "plan",
            self.config,
            "--nodes",
            str(self.nodes),
            "--gpus-per-node",
            str(self.gpus),
            "--gpu",
            "h100",
            "--simulate",
            "--json",
            "--data.allow_small=true",  # memory of a layout: the preset's data is not read (docs/data.md)
            *self.overrides,
            *mode,
        ]

    @property
    def config_overrides(self) -> list[str]:
        """The `--section.key=value` arguments of the command (without plan's own options)."""
        return [a for a in self.args[10:] if a.startswith("--") and "=" in a]

    @property
    def command(self) -> str:
        return "relaytrain " + " ".join(self.args)

    @property
    def id(self) -> str:
        words = [self.model, f"{self.nodes}x{self.gpus}", self.layout, self.mode or "default"]
        text = "-".join(words).lower()
        return re.sub("-+", "-", "".join(c if c.isalnum() else "-" for c in text)).strip("-")


def _modes(model, nodes, gpus, layout, overrides=(), tuned=False, modes=MODES) -> list[Row]:
    return [Row(model, nodes, gpus, layout, overrides, m, tuned) for m in modes]


TUNED = [
    *_modes("1b", 1, 1, "1 x 1", tuned=True),
    *_modes("1b", 1, 8, "FSDP 8", tuned=True),
    Row("1b", 1, 8, "FSDP 8, never reshard", NEVER, "none", True),
    *_modes("8b", 1, 8, "FSDP 8", tuned=True),
    Row("8b", 1, 8, "FSDP 8, CPU offload", OFFLOAD, "selective", True),
    *_modes("8b", 4, 8, "FSDP 32", tuned=True),
    *_modes("8b", 4, 8, "FSDP 4 x TP 8", TP8, tuned=True),
    *_modes("8b", 4, 8, "HSDP 4 x 8", HSDP_4X8, tuned=True),
    *_modes("70b", 8, 8, "FSDP 8 x TP 8", tuned=True),
    *_modes("70b", 16, 8, "FSDP 16 x TP 8", tuned=True),
    *_modes("70b", 16, 8, "FSDP 8 x TP 8 x PP 2 (1F1B)", PP2, tuned=True),
    *_modes("70b", 16, 8, "FSDP 8 x TP 8 x PP 2 (interleaved)", PP2 + INTERLEAVED, tuned=True),
]

SEQ_8192 = ("--train.seq_len=8192", "--model.max_seq_len=8192", "--train.micro_batch_size=1")
SEQ_2048 = ("--train.seq_len=2048",)
UNTIED = ("--model.tie_embeddings=false",)  # tensor parallelism splits the embedding and output apart
PP2_TP2_INTERLEAVED = ("--parallel.tp=2", *UNTIED, *PP2, *INTERLEAVED)
SEQ_4096_X2 = ("--train.seq_len=4096", "--train.micro_batch_size=2")
# Held-out rows keep the preset's widths, heads and vocabulary; most run fewer layers (the per-layer terms
# are what is checked, and each simulated layer costs seconds on a shared CPU).
L4, L8 = ("--model.n_layers=4",), ("--model.n_layers=8",)
HELD_OUT = [
    Row("125m", 1, 8, "FSDP 8", (), "none"),
    Row("125m", 1, 8, "FSDP 8", (), "full"),
    Row("8b", 2, 8, "TP 4 x CP 2", ("--parallel.tp=4", "--parallel.cp=2"), "selective"),
    Row("350m", 1, 8, "FSDP 2 x TP 2 x PP 2 (interleaved)", PP2_TP2_INTERLEAVED, "none"),
    Row("7b", 2, 8, "FSDP 2 x TP 8, 4 layers", (*TP8, *L4), "selective"),
    Row(
        "3b",
        2,
        8,
        "FSDP 4 x TP 2 x PP 2 (1F1B), 8 layers",
        ("--parallel.tp=2", *UNTIED, *PP2, *L8),
        "selective",
        fitted_by="264b507",  # its last stage's gathered layers were +25 %; plan was fixed for them
    ),
    Row(
        "1b",
        2,
        8,
        "FSDP 4 x TP 4, seq 8192, 4 layers",
        ("--parallel.tp=4", *UNTIED, *SEQ_8192, *L4),
        "selective",
    ),
    Row(
        "350m",
        2,
        8,
        "HSDP 2 x 8, 8 layers",
        ("--parallel.dp_replicate=2", "--parallel.dp_shard=8", *L8),
        "selective",
    ),
    Row("7b", 4, 8, "HSDP 4 x 8, seq 2048, 4 layers", (*HSDP_4X8, *SEQ_2048, *L4), "full"),
    Row("8b", 2, 8, "FSDP 16, seq 4096 x 2, 4 layers", (*SEQ_4096_X2, *L4), "selective"),
    Row("3b", 2, 8, "FSDP 8 x TP 2, 4 layers", ("--parallel.tp=2", *UNTIED, *L4), "full"),
    Row("1b", 1, 8, "FSDP 8, bf16 reduce, 4 layers", ("--parallel.reduce_dtype=bfloat16", *L4), "full"),
]

ROWS = HELD_OUT + TUNED
