"""`python -m bench.simulated_table`: docs/benchmarks.md's "Simulated at scale" section (`simulated`).

    python -m bench.simulated_table                    # render the section from the kept outputs
    python -m bench.simulated_table --run ID,ID        # simulate those rows again, then render
    python -m bench.simulated_table --run held-out     # every held-out row (also: tuned, missing, all)
    python -m bench.simulated_table --list             # the rows, their commands and kept outputs

Each row (bench/simulated_rows.py) is one `relaytrain plan ... --simulate --json`; its stdout is kept
as it is in bench/results/simulated/ID.json, and how it ran (command, date, wall time, torch, commit,
load) in ID.run.json. The section is rendered from those files only: a row without a kept output is
listed as not reproduced, never shown with figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.report import REPO, load_average, table, write_page
from bench.simulated_rows import ROWS, Row

RESULTS = REPO / "bench" / "results" / "simulated"
SECTION = "simulated"
TOLERANCE = 0.10  # per category, as plan's AGREEMENT is in total
GIB = 1024**3
CATEGORIES = ("parameters", "gradients", "optimizer state", "gathered layers", "activations+logits")
HEADERS = ("parameters", "gradients", "AdamW state", "gathered layers", "activations+loss")
TOTAL = "tensors at the peak"


def run_row(row: Row, out: Path = RESULTS) -> dict:
    """Simulate one row now; keep its stdout and how it ran."""
    out.mkdir(parents=True, exist_ok=True)
    import torch

    load = load_average()
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True, text=True).stdout.strip():
        commit += " with uncommitted changes in src/"
    start = time.monotonic()
    command = [sys.executable, "-m", "relaytrain.cli", *row.args]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    if proc.returncode not in (0, 1) or not proc.stdout.strip():  # 1: plan's verdict is "impossible"
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{row.id}: exit {proc.returncode}: {tail}")
    json.loads(proc.stdout)  # a record, or fail here rather than at rendering
    (out / f"{row.id}.json").write_text(proc.stdout)
    meta = {
        "command": row.command,
        "exit": proc.returncode,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": round(wall, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "commit": commit or None,
        "load_start": load,
        "load_end": load_average(),
    }
    (out / f"{row.id}.run.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def kept(row: Row, where: Path = RESULTS) -> tuple[dict, dict] | None:
    """(record, how it ran) of a row's kept output, or None."""
    record, meta = where / f"{row.id}.json", where / f"{row.id}.run.json"
    if not (record.is_file() and meta.is_file()):
        return None
    return json.loads(record.read_text()), json.loads(meta.read_text())


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}" if value >= GIB / 100 else f"{value / GIB:.3f}"


def _cell(c: dict) -> str:
    rel = c["relative"]
    diff = "-" if rel is None else f"{rel:+.0%}"
    return f"{_gib(c['plan_bytes'])} / {_gib(c['simulated_bytes'])} ({diff})"


def _lead(row: Row, record: dict) -> list[str]:
    """The row's first columns: id, model, nodes x GPUs, layout, AC, tokens, sample."""
    from relaytrain.config import load_config

    cfg = load_config(REPO / row.config, row.config_overrides)
    layout = record.get("layout") or ""
    micro = layout.split("micro batch ")[1].split(" x ")[0] if "micro batch " in layout else "?"
    return [
        f"`{row.id}`",
        row.model.upper(),
        f"{row.nodes} x {row.gpus}",
        row.layout,
        cfg.parallel.activation_checkpointing,
        f"{cfg.train.seq_len} x {micro}",
        row.sample,
    ]


def top_rank(record: dict) -> dict | None:
    ranks = record.get("ranks") or []
    return max(ranks, key=lambda r: r["peak_bytes"]) if ranks else None


def errors(record: dict) -> dict[str, float | None]:
    """Relative error of plan per category and in total, on the rank that holds the most."""
    rank = top_rank(record)
    if rank is None:
        return {}
    return {c["category"]: c["relative"] for c in rank["detail_comparison"]}


def render(where: Path = RESULTS, rows: list[Row] = ROWS) -> str:
    found = {row.id: kept(row, where) for row in rows}
    done = [row for row in rows if found[row.id] is not None]
    metas = [found[row.id][1] for row in done]
    lines = [
        "## Simulated at scale",
        "",
        "`relaytrain plan --simulate` (docs/launching.md) builds the layout through the trainer's own "
        "`parallelize` path at the real world size on PyTorch's fake process group and runs one training "
        "step on fake tensors. Rewritten from the kept results by `python -m bench.simulated_table`: the "
        "kept outputs of each row's command (bench/results/simulated/ID.json, its stdout as printed; "
        "ID.run.json says when and how it ran); `python -m bench.simulated_table --run ID` simulates a row "
        "again.",
        "",
    ]
    if metas:
        dates = sorted({m["date"][:10] for m in metas})
        torches = sorted({m["torch"] for m in metas})
        commits = sorted({m["commit"] or "?" for m in metas})
        lines += [
            f"Simulated {', '.join(dates)} on {metas[0]['cores']} CPU cores shared with other work, torch "
            f"{', '.join(torches)}, commits {', '.join(commits)}. Cells are plan / simulated GiB per GPU "
            "(plan's difference in brackets), one line per simulated rank, the rank that holds the most (the "
            'one a GPU must fit) first; "tensors at the peak" is plan\'s tensor total (its 3 GiB CUDA '
            "context and 10 % fragmentation left out: no tensor shows them) against the simulated peak. "
            "Tokens are seq_len x micro batch. Wall time is the whole command, every simulated rank "
            "included; host memory the largest simulating process's peak resident set. No timing of the "
            "training step is implied: nothing is computed.",
            "",
            "*Tuned* rows are the layouts plan's formulas were fitted against; *held out* rows were chosen "
            "after, to check them out of sample, and plan was not changed for them; a row *found out of "
            "sample, then fitted* was held out until plan was fixed for what it showed (the fixing commit "
            "in brackets): its figures are in-sample now.",
            "",
        ]
    header = ["row", "model", "nodes x GPUs", "layout", "AC", "tokens", "sample", "rank", *HEADERS, TOTAL]
    body = []
    for row in done:
        record = found[row.id][0]
        lead = _lead(row, record)
        ranks = sorted(record.get("ranks") or [], key=lambda r: -r["peak_bytes"])
        if not ranks:
            why = record.get("simulation_warning") or f"plan's verdict: {record.get('verdict')}"
            body.append([*lead, "-", f"not simulated: {why}", *[""] * len(HEADERS)])
        for rank in ranks:
            by = {c["category"]: c for c in rank["detail_comparison"]}
            body.append([*lead, str(rank["rank"]), *(_cell(by[c]) for c in (*CATEGORIES, TOTAL))])
    if body:
        lines += [table(header, body).rstrip(), ""]
        lines += _timings(done, found)
        lines += _summary(done, found)
    lines += [LIMITS]
    missing = [row for row in rows if found[row.id] is None]
    if missing:
        lines += [
            "Not reproduced here (no kept output; `python -m bench.simulated_table --run ID` simulates "
            "them): " + ", ".join(f"`{row.id}`" for row in missing) + ".",
            "",
        ]
    return "\n".join(lines)


def _timings(done: list[Row], found: dict) -> list[str]:
    header = ["row", "ranks simulated", "peak at (rank that holds the most)", "wall s", "host GiB", "command"]
    body = []
    for row in done:
        record, meta = found[row.id]
        rank = top_rank(record)
        ranks = record.get("ranks") or []
        host = max((r["host_peak_bytes"] for r in ranks), default=0) / GIB
        body.append(
            [f"`{row.id}`", str(len(ranks)), rank["peak_at"] if rank else "-", f"{meta['wall_s']:.0f}",
             f"{host:.2f}" if ranks else "-", f"`{meta['command']}`"]
        )  # fmt: skip
    return ["How each row ran:", "", table(header, body).rstrip(), ""]


def _summary(done: list[Row], found: dict) -> list[str]:
    """Per category, the largest error of plan on each sample of rows, and the rows over tolerance."""
    lines = [
        f"Largest difference of plan per category (rank that holds the most; tolerance {TOLERANCE:.0%}):",
        "",
    ]
    header = ["sample", "rows", *HEADERS, TOTAL, f"rows over {TOLERANCE:.0%} in a category"]
    body = []
    for name in ("held out", "found out of sample, then fitted", "tuned"):
        rows = [row for row in done if row.sample.split(" (")[0] == name and top_rank(found[row.id][0])]
        if not rows:
            continue
        cells, over = [], []
        for category in (*CATEGORIES, TOTAL):
            worst = max(
                (
                    (abs(e), e, row.id)
                    for row in rows
                    if (e := errors(found[row.id][0]).get(category)) is not None
                ),
                default=None,
            )
            cells.append("-" if worst is None else f"{worst[1]:+.0%} (`{worst[2]}`)")
        for row in rows:
            bad = [c for c, e in errors(found[row.id][0]).items() if e is not None and abs(e) > TOLERANCE]
            if bad:
                over.append(f"`{row.id}` ({', '.join(bad)})")
        body.append([name, str(len(rows)), *cells, "; ".join(over) or "none"])
    return lines + [table(header, body).rstrip(), ""]


LIMITS = """What no row can show as such:

* Context parallel (`parallel.cp` > 1) shards attention with CUDA's kernels; the fake step runs on the
  CPU, which has no such strategy, so a cp row stays plan only (its one-line warning is in the table).
* What no tensor holds: the CUDA context, NCCL's buffers and allocator fragmentation (plan's 3 GiB and
  10 %) are outside every comparison.
* `parallel.compile`: the simulated step runs eagerly; compiled blocks are taken to hold what eager
  ones hold. The attention kernel is the CPU one, `_scaled_dot_product_flash_attention_for_cpu`, which
  keeps the output and a log-sum-exp per head and position for backward as CUDA's flash attention
  does (no s x s scores on either).
* Not every micro batch runs: without a pipeline 2 of the step's micro batches (the peak is reached by
  the second; each further one repeats it), with one the fewest at which the schedule reaches its
  steady state (pp + 1 for 1F1B, 2 pp interleaved, all for GPipe) plus the receive buffers of the
  others. A pipeline's stage boundary shapes are declared from the config (the trainer's schedule
  learns them by a vote that reads tensor values, which fake tensors do not have).
* With CPU offload the states live in host memory; the simulation, on the CPU, counts them in the same
  categories. On 1 x 1 (no FSDP) autocast's bf16 weight copies, plan's gathered layers, are counted by
  the tracker with the activations, so those two columns trade.
* A pipeline's ranks differ by design: plan's figure is for the rank that holds the most (the last
  stage with full checkpointing, where the loss lives, else the first, with pp micro batches in
  flight), and the other end's line is below it.
"""


def select(spec: str) -> list[Row]:
    groups = {
        "all": ROWS,
        "tuned": [r for r in ROWS if r.tuned],
        "held-out": [r for r in ROWS if not r.tuned],
        "missing": [r for r in ROWS if kept(r) is None],
    }
    if spec in groups:
        return groups[spec]
    by_id = {r.id: r for r in ROWS}
    unknown = [i for i in spec.split(",") if i not in by_id]
    if unknown:
        raise SystemExit(f"unknown row {unknown[0]!r}: see `python -m bench.simulated_table --list`")
    return [by_id[i] for i in spec.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.simulated_table", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--run", default="", help="rows to simulate first: IDs, held-out, tuned, missing, all"
    )
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument(
        "--no-write", action="store_true", help="print the section instead of writing the page"
    )
    args = parser.parse_args(argv)
    if args.list:
        for row in ROWS:
            print(f"{row.id}\t{'kept' if kept(row) else 'missing'}\t{row.command}")
        return 0
    failed = 0
    for row in select(args.run) if args.run else []:
        print(f"simulating {row.id}: {row.command}", file=sys.stderr, flush=True)
        try:
            meta = run_row(row)
            print(f"  {meta['wall_s']:.0f} s", file=sys.stderr, flush=True)
        except RuntimeError as exc:
            failed += 1
            print(f"  failed: {exc}", file=sys.stderr, flush=True)
    section = render()
    if args.no_write:
        print(section)
    else:
        print(f"wrote {write_page({SECTION: section})}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
