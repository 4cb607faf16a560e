"""The one parser of `[CONFIG] [--section.key=value ...]` command lines, used by every command."""

from __future__ import annotations

import datetime
import tomllib
from typing import Any

from relaytrain.errors import ConfigError

_SHAPE = "overrides look like --section.key=value"


def parse_override(text: str) -> tuple[str, str, Any]:
    """`--section.key=value` -> (section, key, value). Values are TOML literals, else strings."""
    body = text[2:] if text.startswith("--") else ""
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"unexpected argument {text!r}: {_SHAPE}")
    path, raw = body.split("=", 1)
    section, key = path.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        value = raw
    if isinstance(value, (datetime.date, datetime.time)):
        value = raw  # `--slurm.time=02:00:00` is a duration string, not a TOML time
    return section, key, value


def check_overrides(args: list[str]) -> list[str]:
    """The arguments unchanged, after refusing any that is not a `--section.key=value` override."""
    for text in args:
        parse_override(text)
    return list(args)


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] [--section.key=value ...] -> (config path or None, overrides)."""
    rest = list(args)
    config = rest.pop(0) if rest and not rest[0].startswith("--") else None
    return config, check_overrides(rest)
