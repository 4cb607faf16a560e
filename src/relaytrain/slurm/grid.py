"""`relaytrain sweep --grid`: the grid's keys and values, and the command of each point of a --command sweep.

A grid key is a config key (`section.key`, an override of every point's config) or, with --command, a
bare name (`lr`) that exists only as a placeholder. In the command, `{key}` is replaced by the point's
value (shell-quoted); `${VAR}` stays the shell's. Every `{name}` must be a grid key and every bare
name must appear in the command, so a typo is refused instead of sweeping nothing.
"""

from __future__ import annotations

import re
import shlex

from relaytrain.config import parse_override
from relaytrain.errors import UserError

_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# `{lr}`, `{optim.lr}`; not `${VAR}` (the shell's) and not `{ a; }` or awk's `{print $1}`.
PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\}")


def parse_grid(items: list[str], command: str | None = None) -> list[tuple[str, list[str]]]:
    """`--grid KEY=V1,V2` items -> [(key, values)]; with a command, check its placeholders too."""
    grid = []
    for item in items:
        body = item[2:] if item.startswith("--") else item
        key, sep, values = body.partition("=")
        bare = command is not None and _BARE.fullmatch(key) is not None
        if not sep or not (bare or "." in key):
            shape = "name=v1,v2 or section.key=v1,v2" if command is not None else "section.key=value1,value2"
            raise UserError(f"--grid {item!r} must look like {shape}")
        if key.startswith("slurm.") or key.startswith("run."):
            raise UserError(
                f"--grid {key}: sweep points share one job array, so slurm.* and run.* "
                "cannot vary; launch separate jobs instead"
            )
        options = [v for v in values.split(",") if v != ""]
        if not options:
            raise UserError(f"--grid {item!r} lists no values")
        if key in dict(grid):
            raise UserError(f"--grid {key} is given twice; list all its values in one --grid")
        if not bare:
            parse_override(f"--{key}={options[0]}")
        grid.append((key, options))
    if not grid:
        raise UserError("relaytrain sweep needs at least one --grid section.key=v1,v2")
    if command is not None:
        check_placeholders(command, [key for key, _ in grid])
    return grid


def check_placeholders(command: str, keys: list[str]) -> None:
    used = set(PLACEHOLDER.findall(command))
    unknown = sorted(used - set(keys))
    if unknown:
        raise UserError(
            f"--command uses {{{unknown[0]}}}, which is not a --grid key ({', '.join(keys)}); "
            f"add --grid {unknown[0]}=V1,V2 or write ${{{unknown[0]}}} for a shell variable"
        )
    unused = [key for key in keys if "." not in key and key not in used]
    if unused:
        raise UserError(f"--grid {unused[0]} is not used by --command: put {{{unused[0]}}} where it goes")


def render_command(command: str, point: dict[str, str]) -> str:
    """The command of one grid point: each `{key}` replaced by its value, shell-quoted."""
    return PLACEHOLDER.sub(lambda m: shlex.quote(point[m.group(1)]), command)
