"""The page: machine description, Markdown helpers, and merging regenerated sections into docs/benchmarks.md.

Sections live between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``. ``merge_page`` replaces the
blocks it is given, appends blocks the page does not have yet (after the last known block, in the order
given), and keeps every other byte of the page, so sections that other commands write survive a rerun.

Every section names the command that writes it, and a section rebuilt from kept results (bench/kept.py)
says so in one sentence, "Rewritten from the kept results by `COMMAND`." (REWRITTEN below):
tests/test_bench_pages.py runs that command against a copy of the page ($BENCH_PAGE) and requires the
copy to come out byte for byte the same.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from relaytrain.job.machine import cpu_model

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"

PAGE_TITLE = "# Benchmarks"
PAGE_INTRO = (
    "Every figure on this page comes from a command in `bench/`; `python -m bench` (or `bench/run.sh`) runs\n"
    "them all and rewrites the sections it measures (HTML comments `bench:NAME` mark them; other sections\n"
    "are kept as they are). Comparisons run side by\n"
    "side in one invocation, alternating A/B/A/B, and report medians and ratios, because shared machines\n"
    "are noisy. Tests never assert timings; this page is where performance is claimed.\n"
)

# The sentence that names the command rebuilding a section from kept results, as the page writes it.
REWRITTEN = re.compile(r"[Rr]ewritten from the kept results by `(?P<command>[^`]+)`")
_BLOCK = re.compile(r"<!-- bench:(?P<name>[\w.-]+) -->\n?(?P<body>.*?)<!-- /bench:(?P=name) -->\n?", re.S)


# -- statistics -----------------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """'min–max' of a sample, the honest companion of a median on a noisy machine."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{fmt(min(values))}–{fmt(max(values))}"


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits, no exponent for everyday magnitudes."""
    if value is None or value != value:
        return "–"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 10**digits:
        return f"{value:,.0f}"
    decimals = max(0, digits - 1 - int(f"{magnitude:e}".split("e")[1]))
    return f"{value:.{decimals}f}"


def pct(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:
        return "–"
    return f"{100 * value:.{digits}f}%"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def code(command: str) -> str:
    return f"`{command}`"


def verdict(met: bool | None, target: str) -> str:
    if met is None:
        return f"target {target}: not measured"
    return f"target {target}: **{'met' if met else 'missed'}**"


# -- machine --------------------------------------------------------------------------------------


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    """Date, CPU, cores, memory, torch and GPU: what a reader needs to compare a figure with theirs."""
    import torch

    info = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": None,
        "load_start": load_average(),
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (ValueError, OSError):
        info["memory_gib"] = None
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        info["gpu"] = f"{n} x {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    info["commit"] = commit or None
    return info


def render_machine(info: dict, command: str, load_end: list[float] | None) -> str:
    def load(values):
        return " / ".join(f"{v:.2f}" for v in values) if values else "unknown"

    rows = [
        ("date", info["date"]),
        ("command", code(command)),
        ("commit", info.get("commit") or "unknown"),
        ("CPU (torch CPU capability)", f"{info['cpu']} ({info.get('cpu_capability', '?')})"),
        ("cores", f"{info['cores']} (torch threads {info['torch_threads']})"),
        ("memory", f"{info['memory_gib']} GiB" if info.get("memory_gib") else "unknown"),
        ("GPU", info["gpu"] or "none"),
        ("Python / torch", f"{info['python']} / {info['torch']}"),
        ("load average 1/5/15 min, start -> end", f"{load(info.get('load_start'))} -> {load(load_end)}"),
    ]
    note = ""
    cores = info.get("cores") or 1
    if info.get("load_start") and max(info["load_start"][0], (load_end or [0])[0]) > cores:
        note = (
            "\nThe load average exceeded the core count while measuring: other processes shared the CPU, so "
            "absolute figures are low and noisy; the side-by-side ratios are the figures to read.\n"
        )
    return "The machine and run behind the figures below:\n\n" + table(["", ""], rows) + note


# -- the page -------------------------------------------------------------------------------------


def block(name: str, body: str) -> str:
    return f"<!-- bench:{name} -->\n{body.rstrip()}\n<!-- /bench:{name} -->\n"


def section_names(page: str) -> list[str]:
    return [m.group("name") for m in _BLOCK.finditer(page)]


def section_body(page: str, name: str) -> str | None:
    for m in _BLOCK.finditer(page):
        if m.group("name") == name:
            return m.group("body")
    return None


def merge_page(page: str, sections: dict[str, str], order: Sequence[str] = ()) -> str:
    """``page`` with the blocks named in ``sections`` replaced (or added); every other byte kept.

    A new block goes after the nearest block that precedes it in ``order`` and is on the page, else
    before the nearest one that follows it, else at the end; ``order`` defaults to the order of
    ``sections``.
    """
    if not page.strip():
        page = f"{PAGE_TITLE}\n\n{PAGE_INTRO}\n"
    order = list(order) or list(sections)
    done: set[str] = set()

    def replace(m: re.Match) -> str:
        name = m.group("name")
        if name in sections and name not in done:
            done.add(name)
            return block(name, sections[name])
        return m.group(0)

    page = _BLOCK.sub(replace, page)
    for name in [n for n in order if n in sections] + [n for n in sections if n not in order]:
        if name in done:
            continue
        new = block(name, sections[name])
        position = order.index(name) if name in order else len(order)
        blocks = {m.group("name"): m for m in _BLOCK.finditer(page)}
        before = next((blocks[n] for n in reversed(order[:position]) if n in blocks), None)
        after = next((blocks[n] for n in order[position + 1 :] if n in blocks), None)
        if before is not None:
            page = page[: before.end()] + "\n" + new + page[before.end() :]
        elif after is not None:
            page = page[: after.start()] + new + "\n" + page[after.start() :]
        else:
            page = page.rstrip("\n") + "\n\n" + new
        done.add(name)
    return page


def page_path() -> Path:
    """The page the generators write: docs/benchmarks.md, or the file `$BENCH_PAGE` names (a copy that
    tests/test_bench_pages.py regenerates sections into, to compare them with the page byte for byte)."""
    return Path(os.environ.get("BENCH_PAGE") or PAGE)


def write_page(sections: dict[str, str], order: Sequence[str] = (), path: Path | None = None) -> Path:
    """Merge ``sections`` into the page on disk (re-read now, so concurrent edits by others survive)."""
    path = path or page_path()
    old = path.read_text() if path.exists() else ""
    new = merge_page(old, sections, order)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(new)
    os.replace(tmp, path)
    return path


def python_command(module: str, args: Sequence[str] = ()) -> str:
    """How to rerun one figure, as a reader would type it from the repository root."""
    return " ".join(["python -m", module, *args])


def this_python() -> str:
    return sys.executable
