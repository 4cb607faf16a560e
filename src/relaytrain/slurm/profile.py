"""Cluster profiles and where each SLURM setting comes from.

Precedence, highest first: command-line flag > the config's `[slurm]` section (and `--slurm.key=value`
overrides) > the cluster profile > built-in defaults. `env` tables merge key by key in the same order;
`setup`, `modules`, `extra_sbatch` and `container_mounts` lists are concatenated, profile entries first.
`gpus_per_node` that nobody sets comes from the partition's GRES in `sinfo` (0 on CPU-only nodes), and
is 8 only where `sinfo` cannot answer.

A profile is a TOML file with `SlurmConfig` keys at the top level (or inside a `[slurm]` table). It is
found by path, or by name in `configs/clusters/<name>.toml` (current directory), then in
`$RELAYTRAIN_CLUSTERS_DIR`, then `~/.config/relaytrain/clusters/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from relaytrain.config import SlurmConfig, config_from_dict, parse_override
from relaytrain.errors import UserError
from relaytrain.slurm.command_gpus import choose_command_gpus
from relaytrain.slurm.partition import DEFAULT_GPUS_PER_NODE, mem_bytes, partition_facts
from relaytrain.slurm.resources import choose_resources

MERGED_LISTS = ("setup", "modules", "extra_sbatch", "container_mounts")
_SLURM_KEYS = {f.name for f in dataclasses.fields(SlurmConfig)}


def profile_search_paths(name: str) -> list[Path]:
    dirs = [Path("configs/clusters")]
    if os.environ.get("RELAYTRAIN_CLUSTERS_DIR"):
        dirs.append(Path(os.environ["RELAYTRAIN_CLUSTERS_DIR"]))
    dirs.append(Path.home() / ".config/relaytrain/clusters")
    return [d / f"{name}.toml" for d in dirs]


def find_profile(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or "/" in name_or_path:
        if path.is_file():
            return path
        raise UserError(f"cluster profile '{name_or_path}' not found; pass an existing TOML file")
    candidates = profile_search_paths(name_or_path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UserError(
        f"cluster profile '{name_or_path}' not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); pass a path or create one of those"
    )


def load_profile(name_or_path: str) -> dict[str, Any]:
    """The profile's keys, type-checked against SlurmConfig (only keys the file sets)."""
    path = find_profile(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"cluster profile '{path}' is not valid TOML: {exc}") from None
    table = data.get("slurm", data)
    table = {k: v for k, v in table.items() if k not in ("description", "slurm")}
    if "profile" in table:
        raise UserError(f"cluster profile '{path}' must not set 'profile'")
    checked = config_from_dict({"slurm": table}).slurm  # raises on unknown keys and wrong types
    return {key: getattr(checked, key) for key in table}


def explicit_config_keys(config_path: str | Path | None, overrides: list[str]) -> set[str]:
    """The [slurm] keys the config file or overrides set (defaults do not count)."""
    keys: set[str] = set()
    if config_path is not None and Path(config_path).is_file():
        with contextlib.suppress(tomllib.TOMLDecodeError):  # load_config reports it
            keys |= set(tomllib.loads(Path(config_path).read_text()).get("slurm", {}))
    for text in overrides:
        section, key, _ = parse_override(text)
        if section == "slurm":
            keys.add(key)
    return keys & _SLURM_KEYS


def _merge(base: SlurmConfig, key: str, value: Any) -> None:
    current = getattr(base, key)
    if key == "env":
        setattr(base, key, {**current, **value})
    elif key in MERGED_LISTS:
        setattr(base, key, list(current) + [v for v in value if v not in current])
    else:
        setattr(base, key, value)


def resolve_slurm(
    config_slurm: SlurmConfig,
    explicit: set[str],
    cli: dict[str, Any],
    profile: str | None = None,
    notes: list[str] | None = None,
    command: str | None = None,
) -> SlurmConfig:
    """Merge defaults < profile < config (`explicit` keys of `config_slurm`) < CLI (non-None values).

    With `notes` (a list), CPUs, memory and exclusivity nobody set are chosen (relaytrain.slurm.resources)
    and the line saying what was chosen is appended to it; without, they stay as given. With `command`
    (a --command job) the GPUs per node are those its processes use (relaytrain.slurm.command_gpus).
    """
    resolved = SlurmConfig()
    given = set(explicit) | {key for key, value in cli.items() if value is not None}
    profile_name = profile or config_slurm.profile
    if profile_name:
        for key, value in load_profile(profile_name).items():
            _merge(resolved, key, value)
            given.add(key)
        resolved.profile = profile_name
    for key in sorted(explicit):
        if key != "profile":
            _merge(resolved, key, getattr(config_slurm, key))
    for key, value in cli.items():
        if value is not None:
            if key not in _SLURM_KEYS:
                raise ValueError(f"not a slurm key: {key}")
            _merge(resolved, key, value)
    if resolved.gpus_per_node < 0:
        facts = partition_facts(resolved.partition)
        resolved.gpus_per_node = facts.gpus_per_node if facts else DEFAULT_GPUS_PER_NODE
    if command is not None:
        user_set = "gpus_per_node" in explicit or cli.get("gpus_per_node") is not None
        lines = choose_command_gpus(resolved, command, user_set)
        if notes is not None:
            notes.extend(lines)
    _check(resolved)
    if notes is not None:
        notes.extend(choose_resources(resolved, given))
    return resolved


def _check(s: SlurmConfig) -> None:
    if s.nodes < 1:
        raise UserError(f"slurm.nodes must be >= 1, got {s.nodes}")
    if s.min_nodes > s.nodes:
        raise UserError(
            f"slurm.min_nodes={s.min_nodes} is above slurm.nodes={s.nodes}; a node range is MIN-MAX "
            f"(--nodes {s.nodes}-{s.min_nodes}?)"
        )
    if s.mem:
        mem_bytes(s.mem)
    if s.gpus_per_node == 0 and s.tasks_per_node < 1:
        raise UserError(
            "slurm.gpus_per_node=0 (CPU-only nodes) needs slurm.tasks_per_node >= 1 (--tasks-per-node T)"
        )
    if s.tasks_per_node < 0 or s.cpus_per_task < 0:
        raise UserError("slurm.tasks_per_node and slurm.cpus_per_task must be >= 0")
    for key in s.env:
        if not key.isidentifier() or not key.isascii():
            raise UserError(f"slurm.env key {key!r} is not a valid environment variable name")


def is_rocm(s: SlurmConfig) -> bool:
    return s.gpu_type.lower().startswith("mi")
