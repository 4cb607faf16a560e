"""Render docs/config.md from the schema: every key, its type, default and the comment beside it.

`python -m relaytrain.config.docs > docs/config.md`; tests/test_config_docs.py keeps the page current.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from relaytrain.config import schema
from relaytrain.config.loader import _type_name

HEADER = """# Configuration reference

One TOML file, ten sections. `relaytrain train CONFIG --section.key=value ...` overrides any key
(values are TOML literals: `--optim.betas=[0.9,0.95]`, `--parallel.compile=true`; bare words are
strings). The embedded default is `configs/debug.toml`. Unknown keys, wrong types and impossible
combinations are refused before any work starts, with one line that names the key.

This page is generated from `src/relaytrain/config/schema.py` by `python -m relaytrain.config.docs`.
"""


def _comments(cls: type) -> dict[str, str]:
    out = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+):.*?#\s*(.*)$", line)
        if match:
            out[match.group(1)] = match.group(2)
    return out


def render() -> str:
    parts = [HEADER]
    for section in dataclasses.fields(schema.Config):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        comments = _comments(cls)
        parts.append(
            f"\n## [{section.name}]\n\n| key | type | default | meaning |\n| --- | --- | --- | --- |"
        )
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            parts.append(
                f"| `{f.name}` | {_type_name(hints[f.name])} | `{default!r}` | {comments.get(f.name, '')} |"
            )
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
