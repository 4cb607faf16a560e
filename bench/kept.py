"""Kept results: the files under bench/results/, committed with the page.

Each benchmark that measures a figure the page or an extrapolation uses writes its invocation's results
here (`save`): the command that measured them, the date, and the figures. A section rebuilt from kept
results (`python -m bench.chaos --page-from ...`, `python -m bench.goodput --crash-page-from ...`) and
every measured input of the extrapolations (bench/cluster/goodput_extrapolation.py) is read from these
files (`load`), never typed in. A file transcribed from an earlier page, because its run's own results
file was not kept, says so in its `transcribed` field: which command measured it and where the figures
were copied from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.report import REPO, write_page

RESULTS_DIR = REPO / "bench" / "results"


def path_of(name: str | Path) -> Path:
    """A kept file by its name (`chaos-seed41.json`) or its path (relative to the repository root)."""
    path = Path(name)
    if path.is_absolute():
        return path
    return RESULTS_DIR / path if len(path.parts) == 1 else REPO / path


def relative(path: str | Path) -> str:
    """How the page names a kept file: its path from the repository root."""
    resolved = path_of(path).resolve()
    try:
        return resolved.relative_to(REPO.resolve()).as_posix()
    except ValueError:  # outside the repository (a test's copy)
        return str(resolved)


# The checkout a bench ran in, before its own work folder: another clone's or worktree's absolute path.
_CHECKOUT_PREFIX = re.compile(r"(?<![\w.-])/[^\s'\"]*?/(?=bench/out/)")


def in_repository(text: str) -> str:
    """`text` (a kept error or command) with each path into the bench's work folder named from the
    repository root (`bench/out/...`): a page names no path outside the repository, whichever checkout
    the run was made in."""
    return _CHECKOUT_PREFIX.sub("", text)


def save(name: str, data: dict[str, Any]) -> Path:
    path = path_of(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def keep_and_show(
    prefix: str, data: dict[str, Any], render: Callable[[dict[str, Any]], str], section: str,
    order: Sequence[str], write: bool = True,
) -> Path:  # fmt: skip
    """Keep ``data`` as ``<prefix>-<UTC minute>.json``, print its section (``render`` of the data with
    ``kept``: where it is) and, unless ``write`` is false, rewrite that section of docs/benchmarks.md."""
    name = f"{prefix}-{datetime.now(UTC).strftime('%Y-%m-%d-%H%M')}.json"
    path = save(name, data)
    print(render({**data, "kept": path}))
    if write:
        print(f"wrote {write_page({section: render({**data, 'kept': name})}, order)}")
    return path


def load(name: str | Path) -> dict[str, Any]:
    path = path_of(name)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"kept results {relative(path)}: {err.strerror}") from None
    except ValueError as err:
        raise ValueError(f"kept results {relative(path)} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"kept results {relative(path)}: expected a JSON object")
    return data


def figure(data: dict[str, Any], key: str, name: str = "") -> float:
    """One measured figure of a kept file; a clear error when the file does not record it."""
    figures = data.get("figures", {})
    if key not in figures:
        raise ValueError(f"kept results {name or data.get('command', '?')} record no figure {key!r}")
    return float(figures[key])


def keep_gpu_run(prefix: str, result: dict[str, Any]) -> dict[str, Any]:
    """Keep a GPU benchmark's whole result (with the versions of torch and CUDA it ran under) as
    bench/results/PREFIX-<UTC date and time>.json; the result, with `kept` naming that file, is what its
    section is rendered from, so `--page-from` rewrites the section byte for byte."""
    import time

    import torch

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    name = f"{prefix}-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}.json"
    kept = {**result, "versions": {**versions, **result.get("versions", {})}}
    kept["kept"] = relative(save(name, {k: v for k, v in kept.items() if k != "kept"}))
    return kept


def page_from(path: str | Path) -> dict[str, Any]:
    """A kept GPU result as its section renders it (see keep_gpu_run)."""
    return {**load(path), "kept": relative(path)}


def rewrite_from(
    path: str, render: Callable[[dict[str, Any]], str], section: str, order: Sequence[str], error
) -> None:
    """``--page-from PATH``: the section rewritten from the kept results at ``path`` (``render`` of them
    with ``kept``: that path); a file that is not kept results goes to ``error`` (the parser's)."""
    try:
        data = page_from(path)
    except ValueError as err:
        error(f"--page-from: {err}")
    print(f"wrote {write_page({section: render(data)}, order)}")


def transcription(path: str | Path) -> str:
    """Where a kept file is a transcription (its `transcribed` field), the sentence by which a page that
    reads it says so, in the file's own words; "" for a file a run wrote."""
    said = load(path).get("transcribed")
    return f"`{relative(path)}` is kept history, transcribed: {said.rstrip('.')}." if said else ""


def rewritten(command: str, path: str) -> str:
    """The sentence by which a section says where it comes from (bench.report.REWRITTEN reads it)."""
    return f"Results: `{path}`. Rewritten from the kept results by `{command} --page-from {path}`.\n"
