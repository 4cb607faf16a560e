"""TOML loading, `--section.key=value` overrides and type checking against the schema; the loaded config
is validated and then frozen."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import tomli_w

from relaytrain.config.overrides import parse_override
from relaytrain.config.schema import Config, freeze
from relaytrain.errors import ConfigError


def _closest(name: str, choices: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return "; valid: " + ", ".join(prefix + c for c in choices)


def _quote(text: str) -> str:
    """`'text'` on one line, with line breaks, NUL and undecodable bytes escaped."""
    return f"'{text}'" if text.isprintable() else repr(text)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "table of strings"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return `value` checked against `tp`, or raise a ConfigError naming key, type and value."""
    origin = typing.get_origin(tp)
    ok = True
    if origin in (typing.Union, types.UnionType):  # the first alternative that takes the value
        for alternative in typing.get_args(tp):
            try:
                return _coerce(key, value, alternative)
            except ConfigError:
                continue
        ok = False
    elif origin is typing.Literal:
        # `True == 1`: a literal matches only a value of its own type
        ok = any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    elif origin is list:
        if not isinstance(value, list):
            ok = False
        else:
            return [_coerce(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value)]
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(v, (str, int, float)) for v in value.values())
        if ok:
            return {str(k): str(v) for k, v in value.items()}
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            return float(value)
    elif tp is str:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")
    return value


def _section_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _is_text(section: str, key: str) -> bool:
    """Whether `section.key` is a plain string field (unknown names: no; _apply names them)."""
    section_cls = _section_types(Config).get(section)
    return isinstance(section_cls, type) and _section_types(section_cls).get(key) is str


def _apply(cfg: Config, data: dict[str, Any], source: str) -> None:
    sections = _section_types(Config)
    for section_name, table in data.items():
        if section_name not in sections:
            raise ConfigError(
                f"{source}: unknown config section {_quote('[' + section_name + ']')}"
                + _closest(section_name, list(sections))
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: '{section_name}' must be a table ([{section_name}])")
        section = getattr(cfg, section_name)
        fields = _section_types(type(section))
        for key, value in table.items():
            full = f"{section_name}.{key}"
            if key not in fields:
                raise ConfigError(
                    f"{source}: unknown config key {_quote(full)}"
                    + _closest(key, list(fields), prefix=f"{section_name}.")
                )
            setattr(section, key, _coerce(full, value, fields[key]))


# Keys that name a file or directory the run reads, each with the words that are not paths. They are
# made absolute at load: in a config file against that file's directory (a config travels with its data
# and tokenizer), on the command line (overrides, a command's flags) against the current directory. So
# a saved config (the run's, the one a launched job trains from) means the same wherever it is loaded.
# Outputs (run.dir, checkpoint.dir) and what the job's shell reads (slurm.venv, slurm.setup, ...) stay
# as written: relative to the current directory of the command or the job.
INPUT_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    ("data", "sources"): (),
    ("data", "tokenizer"): ("byte",),
    ("checkpoint", "init_from"): (),
    ("checkpoint", "resume"): ("auto", "none"),
    ("slurm", "profile"): (),  # only a path (`*.toml` or with a `/`); a bare name is a profile name
}


def _against(base: Path, section: str, key: str, value: str) -> str:
    if not value or value in INPUT_PATHS[(section, key)] or Path(value).expanduser().is_absolute():
        return value
    if (section, key) == ("slurm", "profile") and not (value.endswith(".toml") or "/" in value):
        return value
    return str(base / value)


def _with_absolute_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """`data` ({section: {key: value}}) with the relative input paths joined to `base`; values of a
    wrong type are left for the type check to name."""
    out = dict(data)
    for section, key in INPUT_PATHS:
        table = data.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        value = table[key]
        if isinstance(value, str):
            value = _against(base, section, key, value)
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = [_against(base, section, key, v) for v in value]
        out[section] = {**out[section], key: value}
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    derived: dict[str, dict[str, Any]] | None = None,
) -> Config:
    """Load a TOML config (None: the embedded debug default), apply overrides, then `derived` values
    ({section: {key: value}}: what a command takes from outside the config, such as the launcher's
    cluster profile and flags), then validate the whole and freeze it (schema.Section): the validated
    config is the one every component uses, unchanged. Input paths come out absolute (INPUT_PATHS)."""
    from relaytrain.config.validate import validate

    cfg = Config()
    if path is not None:
        path = Path(path)
        shown = repr(str(path))
        if not path.is_file():
            raise ConfigError(f"config file {shown} not found; pass an existing TOML file")
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {shown} is not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {shown} is not valid TOML: {exc}") from None
        _apply(cfg, _with_absolute_paths(data, path.absolute().parent), shown)
    for text in overrides or []:
        section, key, value = parse_override(text)
        if not isinstance(value, str) and _is_text(section, key):
            value = text.split("=", 1)[1]  # `--slurm.time=30` is 30 minutes, not the integer 30
        _apply(cfg, _with_absolute_paths({section: {key: value}}, Path.cwd()), "override")
    _apply(cfg, _with_absolute_paths(derived or {}, Path.cwd()), "derived setting")
    validate(cfg)
    return freeze(cfg)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    _apply(cfg, data, "saved config")
    return cfg


def config_to_toml(cfg: Config) -> str:
    return tomli_w.dumps(config_to_dict(cfg))


def config_hash(cfg: Config) -> str:
    """Hash of everything that shapes the model and data stream (not run name or logging)."""
    d = config_to_dict(cfg)
    key = {k: d[k] for k in ("model", "data", "train", "optim")}
    key["train"] = {k: v for k, v in key["train"].items() if k != "stop_at_step"}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
