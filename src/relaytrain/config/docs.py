"""Render docs/reference/config.md from the schema: every key, its type, default and the comment beside it.

`python docs/reference/generate.py` writes it with the other reference pages; tests/test_config_docs.py
keeps the page current and fails on a key without a comment.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from relaytrain.config import schema
from relaytrain.config.domains import domain_of
from relaytrain.config.loader import _type_name

HEADER = """# Configuration reference

One TOML file, eleven sections. `relaytrain train CONFIG --section.key=value ...` overrides any key
(values are TOML literals: `--optim.betas=[0.9,0.95]`, `--parallel.compile=true`; bare words are
strings). The embedded default is `configs/debug.toml`. Unknown keys, wrong types and impossible
combinations are refused before any work starts. The one line names the key, the value and what is
allowed. `train`, `plan`, `launch`, `sweep`, `chain` and `doctor` check the config before they import
torch, so a mistake is reported in a fraction of a second.

Every key's allowed values are checked against the "allowed" column below. Besides that, every float
must be finite (no `nan`, `inf`) and every string printable UTF-8 (no NUL, line breaks or other
control characters). Checks between keys (`model.n_heads` divides `model.dim`, `optim.min_lr <=
optim.lr`, ...) follow; the parallel layout is checked against the world size when the ranks start.

Short runs just work: `--train.max_steps=5` trains 5 steps. When the run is shorter than the LR
schedule, the schedule (not the config) is fitted and one warning line says how. The warmup runs at
most `train.max_steps - 1` steps, so the peak LR is reached and the last step decays. With
`schedule = "wsd"` the decay runs only the steps left after the warmup. Evaluation, checkpointing
and logging also happen at the last step, so intervals longer than the run need no change.

**Relative paths.** The keys that name something the run reads are `data.sources`, `data.tokenizer`
(unless `"byte"`), `checkpoint.init_from`, `checkpoint.resume` (unless `"auto"` or `"none"`) and
`slurm.profile` (when it is a path: it ends in `.toml` or has a `/`; a bare name is looked up in
`configs/clusters/`). In a config file their relative paths are relative to the directory of that
file, so a config works from any directory; given on the command line (`--data.sources='["data/x"]'`)
they are relative to the current directory. Either way they are made absolute when the config is
loaded, so the config a run saves, and the one a launched job trains from, name the same files
wherever they are read. Everything else stays as written and is relative to the current directory:
what the run writes (`run.dir`, `checkpoint.dir`: `relaytrain train configs/debug.toml` run from the
repository writes `./runs/debug`) and what the job's shell reads (`slurm.venv`, `slurm.uv_project`,
`slurm.setup`, `slurm.container_*`, in the directory the job was launched from). The embedded default
has no input paths (it trains on the bundled corpus).

This page is generated from `src/relaytrain/config/schema.py` by `python docs/reference/generate.py`.
"""


def _comments(cls: type) -> dict[str, str]:
    """A field's comment: at the end of its line, else the comment lines directly above it."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        own = re.match(r"\s+#\s*(.*)$", line)
        if own:
            above.append(own.group(1))
            continue
        match = re.match(r"\s+(\w+):[^#]*?(?:#\s*(.*))?$", line)
        if match:
            out[match.group(1)] = match.group(2) or " ".join(above)
        above = []
    return out


def undescribed() -> list[str]:
    """`section.key` of every key without a comment (the reference would show it without a meaning)."""
    return [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(schema.Config)
        for f in dataclasses.fields(section.default_factory)
        if not _comments(section.default_factory).get(f.name)
    ]


def render() -> str:
    parts = [HEADER]
    for section in dataclasses.fields(schema.Config):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        comments = _comments(cls)
        parts.append(
            f"\n## [{section.name}]\n\n| key | type | default | allowed | meaning |\n"
            "| --- | --- | --- | --- | --- |"
        )
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            domain = domain_of(f)
            allowed = domain.describe() if domain else ""
            parts.append(
                f"| `{f.name}` | {_type_name(hints[f.name])} | `{default!r}` | {allowed} "
                f"| {comments.get(f.name, '')} |"
            )
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
